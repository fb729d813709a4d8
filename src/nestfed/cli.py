"""The ``nestfed`` command line: ``run`` an experiment (one or several methods), ``compare`` runs.

Bad input (unknown method or key, bad ranks, missing or malformed data) prints one line naming
the key or file and exits with code 2, before any run directory is created.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nestfed import config as C
from nestfed.errors import NestfedError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated fine-tuning of LLMs under heterogeneity.")
console = Console(stderr=True)
out = Console(width=max(Console().width, 132))


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def _run_methods(cfg: C.ExperimentConfig, methods: list[str], parent: Path | None,
                 resume_dirs: dict[str, Path] | None = None) -> list[Path]:
    from nestfed.experiment import new_run_dir, prepare, run_experiment

    with console.status("preparing") as status:
        prep = prepare(cfg, on_status=lambda s: status.update(s))
    console.print(f"prepared {len(prep.clients)} clients in {prep.prepare_time_s:.1f} s: "
                  + ", ".join(f"c{c.cid} rank {c.rank} n={c.num_examples} ({prep.data[c.cid].label})"
                              for c in prep.clients))
    run_dirs = []
    with _progress() as progress:
        for method in methods:
            mcfg = C.replace(cfg, strategy={"name": method})
            resume = resume_dirs is not None and method in resume_dirs
            run_dir = resume_dirs[method] if resume else new_run_dir(mcfg, parent)
            k = max(1, round(mcfg.federation.fraction * len(prep.clients)))
            task = progress.add_task(f"{method}", total=mcfg.federation.rounds * k)

            def on_event(kind, info, task=task, method=method):
                if kind == "client_done":
                    progress.update(task, advance=1, description=f"{method} round {info['round']} client {info['cid']}")
                elif kind == "round_done":
                    ev = info["line"]["eval"]
                    mean = sum(v["ppl"] for v in ev.values()) / len(ev)
                    progress.update(task, description=f"{method} round {info['round']}: mean ppl {mean:.2f}")
                    if not console.is_terminal:  # logs and CI: one plain line per round
                        console.print(f"{method} round {info['round']}/{mcfg.federation.rounds}: mean held-out ppl "
                                      f"{mean:.2f}, {info['line']['time_s']:.0f} s, "
                                      f"{len(info['line']['rejected'])} rejected")

            if resume:
                from nestfed.federation.runner import latest_checkpoint, load_checkpoint

                ck = latest_checkpoint(run_dir)
                done = load_checkpoint(ck)[0] if ck else 0
                progress.update(task, completed=done * k)
            summary = run_experiment(prep, mcfg, run_dir, resume=resume, on_event=on_event)
            for msg in summary["rejections"]:
                console.print(f"[yellow]{msg}[/]")
            run_dirs.append(run_dir)
    return run_dirs


def _report(run_dirs: list[Path], parent: Path | None) -> None:
    from nestfed import report
    from nestfed.experiment import write_text_atomic

    rows = report.comparison_rows(run_dirs)
    out.print(report.comparison_table(rows))
    if parent is not None:
        write_text_atomic(parent / "comparison.md", report.comparison_markdown(rows))
        write_text_atomic(parent / "comparison.json", json.dumps(rows, indent=2))
        png = report.comparison_plot(rows, parent / "comparison.png")
        out.print(f"wrote {parent}/comparison.md, comparison.json and {png.name}")
    for rd in run_dirs:
        out.print(f"run directory: {rd}")


@app.command()
def run(
    config: Annotated[Optional[Path], typer.Argument(help="experiment TOML file")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override section.key=value")] = None,
    methods: Annotated[Optional[str], typer.Option(help="comma-separated methods run on the same clients, then compared")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="continue an interrupted run directory")] = None,
) -> None:
    """Run an experiment: federated rounds, checkpoints, PEFT adapter, plots, a comparison table."""
    t0 = time.perf_counter()
    if resume is not None:
        resume_dirs, parent = _resumable(resume)
        cfg = C.load(next(iter(resume_dirs.values())) / "config.toml", set_ or [])
        method_list = list(resume_dirs)
        run_dirs = _run_methods(cfg, method_list, parent, resume_dirs)
        if parent is not None:
            run_dirs = sorted(p.parent for p in parent.glob("*/summary.json"))
    else:
        if config is None:
            raise NestfedError("give a CONFIG.toml (or --resume RUN_DIR)")
        cfg = C.load(config, set_ or [])
        method_list = [m.strip() for m in methods.split(",")] if methods else [cfg.strategy.name]
        for m in method_list:
            if m not in C.STRATEGIES:
                raise C.ConfigError(f"--methods: unknown method '{m}' (known: {', '.join(C.STRATEGIES)})")
            C.replace(cfg, strategy={"name": m})  # validates e.g. fedavg with unequal ranks
        parent = None
        if len(method_list) > 1:
            from nestfed.experiment import new_run_dir

            parent = new_run_dir(C.replace(cfg, output={"name": cfg.output.name or "compare"}))
        run_dirs = _run_methods(cfg, method_list, parent)
    _report(run_dirs, parent)
    out.print(f"total wall time {time.perf_counter() - t0:.0f} s")


def _resumable(path: Path) -> tuple[dict[str, Path], Path | None]:
    """Unfinished method runs under ``path`` (a run directory, or a multi-method parent)."""
    if (path / "config.toml").is_file():
        cfg = C.load(path / "config.toml")
        return {cfg.strategy.name: path}, None
    subs = sorted(p.parent for p in path.glob("*/config.toml"))
    if not subs:
        raise NestfedError(f"--resume: {path} is not a nestfed run directory (no config.toml)")
    todo = {C.load(p / "config.toml").strategy.name: p for p in subs if not (p / "summary.json").is_file()}
    finished = {C.load(p / "config.toml").strategy.name for p in subs if (p / "summary.json").is_file()}
    if not todo:
        raise NestfedError(f"--resume: every run under {path} has finished")
    return todo, path if finished or len(todo) > 1 or len(subs) > 1 else None


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="finished run directories (or a multi-method parent)")],
    plot: Annotated[Optional[Path], typer.Option(help="write the comparison plot here")] = None,
) -> None:
    """Print a side-by-side table of finished runs and write one comparison plot."""
    from nestfed import report

    dirs = []
    for d in run_dirs:
        dirs += sorted(p.parent for p in d.glob("*/summary.json")) if not (d / "summary.json").exists() else [d]
    if not dirs:
        raise NestfedError(f"no finished run directory among {', '.join(map(str, run_dirs))}")
    rows = report.comparison_rows(dirs)
    out.print(report.comparison_table(rows))
    png = report.comparison_plot(rows, plot or Path(dirs[0]).parent / "comparison.png")
    out.print(f"wrote {png}")


@app.command("fedslm")
def fedslm(
    config: Annotated[Path, typer.Argument(help="experiment TOML file (e.g. configs/fedslm_bbc_news.toml)")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override section.key=value")] = None,
    methods: Annotated[str, typer.Option(help="comma-separated: fedslm, fedmkt, fedavg, hetlora")] = "fedslm,fedmkt,fedavg,hetlora",
) -> None:
    """FedSLM against FedMKT, FedAvg+LoRA and HetLoRA on the same clients: client and server
    perplexity, client memory, bytes per round (nestfed/compressed_comparison.py)."""
    from nestfed.compressed_comparison import compare

    t0 = time.perf_counter()
    cfg = C.load(config, set_ or [])

    def on_event(kind, info):
        if kind == "round_done":
            ev = info["line"]["eval"]
            console.print(f"  round {info['round']}: mean client held-out ppl "
                          f"{sum(v['ppl'] for v in ev.values()) / len(ev):.2f}, {info['line']['time_s']:.0f} s")

    parent = compare(cfg, [m.strip() for m in methods.split(",") if m.strip()],
                     on_status=lambda s: console.print(s), on_event=on_event)
    out.print((parent / "comparison.md").read_text())
    out.print(f"run directory: {parent}")
    out.print(f"total wall time {time.perf_counter() - t0:.0f} s")


def main() -> None:
    """Entry point: run the Typer app, turning nestfed's input errors into one line and exit 2."""
    try:
        app(standalone_mode=False)
    except NestfedError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
