"""The ``nestfed`` command line: ``run`` an experiment (one or several methods; a method whose
clients run compressed models, FedSLM's or FedMKT's, makes it the compressed comparison),
``compare`` runs, ``export``, ``eval``, ``methods`` (the registry).

Bad input (unknown method, section or key, bad ranks, missing or malformed data, a run directory
that cannot be resumed) prints one line naming the key or file and exits with code 2, before any
run directory is created.

What a command runs is imported when it runs: this module imports only the config loader and the
registry's declarations (nestfed.methods.method), so ``--help``, ``nestfed methods`` and a config
error answer without loading torch. The commands' imports are the top layer's own; import-linter
checks them like any other (tests/test_architecture.py).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nestfed import config as C
from nestfed import methods
from nestfed.config import ExperimentConfig
from nestfed.errors import NestfedError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Federated fine-tuning of LLMs under heterogeneity.",
    rich_markup_mode="markdown",  # a docstring's paragraph is rewrapped to the terminal, not broken at its source lines
)
console = Console(stderr=True, highlight=False)
out = Console(width=max(Console().width, 132), highlight=False)


def say(text: str) -> None:
    """One plain line on stderr (no rich markup: text in square brackets is printed as it is)."""
    console.print(text, markup=False, soft_wrap=True)


def prepared_line(prep) -> str:
    """What preparation found: every client (rank, n_k, labels), or, beyond INLINE_CLIENTS clients,
    the clients per rank and the spread of n_k."""
    head = f"prepared {len(prep.clients)} clients in {prep.prepare_time_s:.1f} s"
    if len(prep.clients) <= C.INLINE_CLIENTS:
        return (
            head
            + ": "
            + ", ".join(f"c{c.cid} rank {c.rank} n={c.num_examples} ({prep.label(c.cid)})" for c in prep.clients)
        )
    counts: dict[int, int] = {}
    for c in prep.clients:
        counts[c.rank] = counts.get(c.rank, 0) + 1
    n = sorted(c.num_examples for c in prep.clients)
    return (
        f"{head} (a client's data are built when it is first sampled or evaluated): clients per rank "
        + ", ".join(f"{r}: {k}" for r, k in sorted(counts.items()))
        + f"; n_k min {n[0]}, median {n[len(n) // 2]}, max {n[-1]}"
    )


def _progress() -> Progress:
    """The live bar on stderr. While it runs on a terminal it takes over stdout too, unless stdout
    is a pipe or file: what is written there must reach it (:func:`_round_lines`)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        redirect_stdout=out.is_terminal,
    )


def _round_lines() -> Console | None:
    """Where one plain line per round goes as it happens, for logs, CI, a pipe or a file: stderr when
    it is not a terminal; else stdout when that is not one (``nestfed run ... | tee log`` keeps the
    bar on the terminal and the rounds in the log); None when both are terminals (the bar shows them)."""
    if not console.is_terminal:
        return console
    return out if not out.is_terminal else None


def _print_line(target: Console, text: str) -> None:
    """``text`` as one plain line on ``target``, flushed at once (a pipe's reader sees it now)."""
    target.print(text, markup=False, soft_wrap=True)
    target.file.flush()


def _run_methods(cfgs: dict[str, ExperimentConfig], run_dirs: dict[str, Path], resume: bool) -> None:
    """Prepare once (from the first config), check every method against the model, then run each."""
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import check_method, run_method
    from nestfed.federation.run_dir import RunDir

    first = next(iter(cfgs.values()))
    with console.status("preparing") as status:
        prep = prepare(first, on_status=lambda s: status.update(s))
    for cfg in cfgs.values():  # nothing is written before every method's settings fit the model
        check_method(prep, cfg)
    say(prepared_line(prep))
    lines = _round_lines()
    with _progress() as progress:
        for name, cfg in cfgs.items():
            k = C.sampled_per_round(cfg)
            task = progress.add_task(name, total=cfg.federation.rounds * k)
            if resume:
                done = RunDir(run_dirs[name]).checkpoints()
                progress.update(task, completed=(done[-1][0] if done else 0) * k)

            def on_event(kind, info, task=task, name=name, rounds=cfg.federation.rounds):
                if kind == "client_done":
                    progress.update(task, advance=1, description=f"{name} round {info['round']} client {info['cid']}")
                elif kind == "log":
                    progress.console.print(info["text"], markup=False)
                elif kind == "generated":  # the generated evaluation after the last round
                    progress.update(task, description=f"{name} answers generated {info['done']}/{info['total']}")
                elif kind == "round_done":
                    ln = info["line"]
                    ev = ln.get("eval") or {}
                    mean = sum(v["ppl"] for v in ev.values()) / len(ev) if ev else float("nan")
                    who = "" if len(ev) == len(prep.clients) else f" over {len(ev)} of {len(prep.clients)} clients"
                    what = f"mean held-out ppl {mean:.2f}{who}" if ev else "not evaluated"
                    progress.update(task, description=f"{name} round {info['round']}: {what}")
                    if lines is not None:  # logs, CI, pipes: one plain line per round
                        glob = f", global {ln['eval_global']['ppl']:.2f}" if "eval_global" in ln else ""
                        _print_line(
                            lines,
                            f"{name} round {info['round']}/{rounds}: {what}{glob}, "
                            f"{ln['time_s']:.0f} s, {len(ln['rejected'])} rejected",
                        )

            run_method(prep, cfg, run_dirs[name], resume=resume, on_event=on_event)


def _finished(parent: Path) -> list[Path]:
    """The finished runs under a multi-method parent: ``<method>/`` or, over seeds, ``seed<N>/<method>/``."""
    return sorted({p.parent for p in [*parent.glob("*/summary.json"), *parent.glob("*/*/summary.json")]})


def _report(
    run_dirs: list[Path],
    parent: Path | None,
    plot: Path | None = None,
    reference: str | None = None,
    table: Path | None = None,
) -> None:
    """Print the comparison; write comparison.md / .json / .png (and, where the runs measured them,
    truncation.png and dimension_importance.png) into ``parent``, or only the plot at ``plot``. Runs
    of one label over several seeds are reported with 95% intervals and paired differences against
    ``reference`` (default: the first label; nestfed.experiments.seed_report). ``table``: also write
    the Markdown tables there and the rows beside it as JSON (same stem)."""
    from nestfed.experiments import comparison, generation_report, group_report, report, seed_report
    from nestfed.io import atomic

    rows = report.comparison_rows(run_dirs)
    try:
        groups = seed_report.by_label(rows)
    except ValueError as exc:  # two runs of one label and seed: different experiments, or one run twice
        raise NestfedError(
            f"{exc}: these runs share a label, a seed and every config field (the same run twice?); "
            "give each run once, or set output.label on them"
        ) from None
    over_seeds = any(len(g) > 1 for g in groups.values())
    if reference is not None and reference not in groups:
        raise NestfedError(f"--reference: '{reference}' is not among the compared runs ({', '.join(groups)})")
    curves, importance = seed_report.truncation_stats(rows), seed_report.importance_stats(rows)
    many = report.many_clients(rows)
    if many and over_seeds:  # by rank group (nestfed.experiments.group_report)
        out.print(
            group_report.seeds_table(rows, group_report.seed_stats(rows, groups, reference or next(iter(groups))))
        )
        bars = group_report.plot(rows)
    elif many:
        out.print(group_report.table(rows))
        bars = group_report.plot(rows)
    elif over_seeds:
        stats = seed_report.label_stats(rows, reference)
        out.print(seed_report.seeds_table(rows, stats))
        bars = seed_report.comparison_plot(rows, stats)
    else:
        out.print(report.comparison_table(rows))
        bars = report.comparison_plot(rows)
    markdown = comparison.markdown(rows, reference)
    answers = generation_report.markdown(rows, reference)
    if answers:  # the generated evaluation's scores (ROUGE-L, accuracy) with their intervals
        out.print(answers, markup=False)
    figures = {
        "truncation.png": seed_report.truncation_plot(curves) if curves else None,
        "dimension_importance.png": seed_report.importance_plot(importance) if importance else None,
    }
    if parent is not None:
        atomic.write_text(parent / "comparison.md", markdown)
        atomic.write_json(parent / "comparison.json", rows)
        atomic.write_bytes(parent / "comparison.png", bars)
        written = ["comparison.md", "comparison.json", "comparison.png"]
        for name, data in figures.items():
            if data is not None:
                atomic.write_bytes(parent / name, data)
                written.append(name)
        out.print(f"wrote {', '.join(written)} into {parent}", markup=False)
    if plot is not None:
        written = [atomic.write_bytes(plot, bars)]
        for name, data in figures.items():
            if data is not None:
                written.append(atomic.write_bytes(plot.with_name(f"{plot.stem}_{name}"), data))
        out.print(f"wrote {', '.join(map(str, written))}", markup=False)
    if table is not None:
        atomic.write_text(table, markdown)
        atomic.write_json(table.with_suffix(".json"), rows)
        out.print(f"wrote {table} and {table.with_suffix('.json')}", markup=False)
    if curves and parent is None:
        out.print(seed_report.truncation_markdown(curves), markup=False)


def _resumable(path: Path, overrides: list[str]) -> tuple[dict[str, Path], Path | None]:
    """The method runs under ``path`` (a run directory, or a multi-method parent, over seeds or not)
    to continue, keyed by their path below the parent (``prelort``, ``seed1/prelort``): the
    unfinished ones, and finished ones whose ``--set federation.rounds`` asks for more rounds."""
    from nestfed.federation.run_dir import RunDir

    def wanted(p: Path) -> bool:  # unfinished, or asked for rounds past its latest checkpoint (a
        rd = RunDir(p)  # continuation that crashed keeps the earlier summary.json and resumes so too)
        if not rd.finished:
            return True
        found = rd.checkpoints()
        asked = methods.load_run_config(p / "config.toml", overrides).federation.rounds
        return bool(found) and asked > found[-1][0]

    more = "; --set federation.rounds=N with N above its rounds continues it"
    if (path / "config.toml").is_file():
        if not wanted(path):
            raise NestfedError(f"--resume: {path} has finished (summary.json exists){more}")
        return {methods.load_run_config(path / "config.toml").strategy.name: path}, None
    subs = sorted({p.parent for p in [*path.glob("*/config.toml"), *path.glob("*/*/config.toml")]})
    if not subs:
        raise NestfedError(f"--resume: {path} is not a nestfed run directory (no config.toml)")
    todo = {str(p.relative_to(path)): p for p in subs if wanted(p)}
    if not todo:
        raise NestfedError(f"--resume: every run under {path} has finished{more}")
    return todo, path if len(subs) > 1 else None


def _resume_configs(todo: dict[str, Path], overrides: list[str]) -> dict[str, ExperimentConfig]:
    """The config of every run to resume: the stored one. ``--set`` may restate it or raise
    ``federation.rounds`` (config.toml is rewritten, the change printed); any other difference is
    refused, naming the keys; so is a run without a readable checkpoint, or without the per-client
    state its method needs."""
    from nestfed.experiments.run import stored_config
    from nestfed.federation.run_dir import RunDir

    cfgs = {}
    for name, d in todo.items():
        rd = RunDir(d)
        stored = stored_config(rd)  # the recorded config: an edit of config.toml shows as a difference
        wanted = methods.load_run_config(rd.config_path, overrides)
        rd.check_resume(methods.get(wanted.strategy.name).keeps_client_state(wanted))  # fails here, before any work
        for change in rd.accept_config(stored, wanted, C.dumps_toml(wanted)):
            say(f"resume {d}: config.toml now has {change}")
        cfgs[name] = wanted
    return cfgs


def _run_compressed(cfg, names: list[str]) -> None:
    """A comparison in which some clients run compressed models (a method declaring ``comparison =
    "compressed"``): client and server perplexity, client memory and bytes per round for every
    method (nestfed.experiments.compressed_comparison), one run directory per method under one parent."""
    from nestfed.experiments.compressed_comparison import compare as compare_compressed

    def on_event(kind, info):
        if kind == "round_done" and "eval" in info["line"]:
            ev = info["line"]["eval"]
            say(
                f"  round {info['round']}: mean client held-out ppl "
                f"{sum(v['ppl'] for v in ev.values()) / len(ev):.2f}, {info['line']['time_s']:.0f} s"
            )
        elif kind == "log":
            say(info["text"])

    parent = compare_compressed(cfg, names, on_status=say, on_event=on_event)
    out.print((parent / "comparison.md").read_text(), markup=False)
    out.print(f"run directory: {parent}", markup=False)


@app.command()
def run(
    config: Annotated[Optional[Path], typer.Argument(help="experiment TOML file")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override section.key=value")] = None,
    methods_: Annotated[
        Optional[str], typer.Option("--methods", help="comma-separated methods run on the same clients, then compared")
    ] = None,
    resume: Annotated[
        Optional[Path],
        typer.Option(
            help="continue an interrupted run directory (a finished one: with --set federation.rounds=N, more)"
        ),
    ] = None,
    seeds: Annotated[
        int,
        typer.Option(
            "--seeds",
            help="repeat every method over N seeds (federation.seed and "
            "lora.init_seed + 0..N-1: data order, initialisation, client sampling) on "
            "the same clients; report means with 95% intervals",
        ),
    ] = 1,
) -> None:
    """Run an experiment: federated rounds, checkpoints, PEFT adapter, plots, a comparison table
    (over seeds: means with 95% intervals and paired differences against the first method)."""
    t0 = time.perf_counter()
    if resume is not None:
        if config is not None or methods_:
            raise NestfedError(
                "--resume runs the run directory's own config and methods; drop CONFIG and --methods "
                "(--set may restate a value or raise federation.rounds)"
            )
        todo, parent = _resumable(resume, set_ or [])
        cfgs = _resume_configs(todo, set_ or [])
        _run_methods(cfgs, todo, resume=True)
        run_dirs = _finished(parent) if parent is not None else list(todo.values())
    else:
        if config is None:
            raise NestfedError("give a CONFIG.toml (or --resume RUN_DIR)")
        cfg = methods.load_config(config, set_ or [])
        names = [m.strip() for m in methods_.split(",")] if methods_ is not None else [cfg.strategy.name]
        for m in names:
            if m not in methods.REGISTRY:
                raise NestfedError(f"--methods: unknown method '{m}' (known: {', '.join(methods.REGISTRY)})")
            if names.count(m) > 1:
                raise NestfedError(f"--methods: '{m}' is listed twice")
        if seeds < 1:
            raise NestfedError(f"--seeds must be >= 1, got {seeds}")
        compressed = [m for m in names if methods.get(m).comparison == "compressed"]
        if compressed:  # clients run compressed models: every method gets the compressed comparison's figures
            if seeds > 1:
                raise NestfedError(f"--seeds: the comparison with {compressed[0]} runs one seed")
            _run_compressed(cfg, names)
            out.print(f"total wall time {time.perf_counter() - t0:.0f} s")
            return
        per_method = {m: methods.with_method(cfg, m) for m in names}  # validates e.g. fedavg with unequal ranks
        from nestfed.experiments.run import new_run_dir  # the model libraries load once the config is valid

        parent = None
        if len(names) > 1 or seeds > 1:
            parent = new_run_dir(methods.replace_config(cfg, output={"name": cfg.output.name or "compare"}))
        cfgs, dirs = {}, {}
        for i in range(seeds):
            for m, c in per_method.items():
                if seeds == 1:
                    cfgs[m], dirs[m] = c, new_run_dir(c, parent)
                    continue
                c = methods.replace_config(
                    c, federation={"seed": c.federation.seed + i}, lora={"init_seed": c.lora.init_seed + i}
                )
                key = f"seed{c.federation.seed}/{m}"
                cfgs[key], dirs[key] = c, parent / key
        _run_methods(cfgs, dirs, resume=False)
        run_dirs = list(dirs.values())
    _report(run_dirs, parent)
    for rd in run_dirs:
        out.print(f"run directory: {rd}", markup=False)
    out.print(f"total wall time {time.perf_counter() - t0:.0f} s")


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="finished run directories (or a multi-method parent)")],
    plot: Annotated[Path, typer.Option(help="write the comparison plot here")] = Path("comparison.png"),
    reference: Annotated[
        Optional[str],
        typer.Option(help="the method (label) the others are paired against over seeds (default: the first)"),
    ] = None,
    table: Annotated[
        Optional[Path], typer.Option(help="also write the Markdown tables here (and the rows as JSON beside it)")
    ] = None,
) -> None:
    """Print a side-by-side table of finished runs and write the comparison plot (default
    ./comparison.png; the truncation curve and dimension importance beside it when measured). Runs
    of one method over several seeds are reported with 95% intervals and paired differences. Runs
    of different experiments (their model or data sections differ) are compared with a warning: the
    first row is the first run's round 0."""
    dirs: list[Path] = []
    for d in run_dirs:
        for p in _finished(d) if not (d / "summary.json").exists() else [d]:
            if p.resolve() not in [x.resolve() for x in dirs]:
                dirs.append(p)
    if not dirs:
        raise NestfedError(f"no finished run directory among {', '.join(map(str, run_dirs))}")
    experiments = {
        (str(C.to_dict(c)["model"]), str(C.to_dict(c)["data"]))
        for c in (methods.load_run_config(d / "config.toml") for d in dirs)
    }
    if len(experiments) > 1:
        say(
            "warning: these runs differ in [model] or [data]: their perplexities are not on one test set, and the "
            f"first row is {dirs[0]}'s round 0"
        )
    _report(dirs, None, plot, reference, table)


@app.command("export")
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (its latest checkpoint is exported)")],
    rank: Annotated[
        Optional[int],
        typer.Option("--rank", help="the global adapter's prefix of rank r, at the scale a client of rank r runs it"),
    ] = None,
    client: Annotated[
        Optional[int], typer.Option("--client", help="exactly the adapter client k runs (its rank, its kept state)")
    ] = None,
    out_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            help="where to write the PEFT adapter directory "
            "(default RUN_DIR/adapter_r<r> or RUN_DIR/adapter_client<k>)",
        ),
    ] = None,
) -> None:
    """Write a PEFT adapter that PEFT runs exactly as nestfed does: the global adapter truncated to
    rank r (lora_alpha set so that PEFT's lora_alpha / r is the client's scale), or client k's own
    adapter (src/nestfed/experiments/export.py)."""
    from nestfed.experiments.export import export_adapter

    path, info = export_adapter(run_dir, rank, client, out_dir)
    who = f"client {info['client']}'s adapter" if info["client"] is not None else "the global adapter"
    out.print(
        f"{who} of {info['method']} after round {info['round']}: rank {info['rank']}, scale {info['scale']:g}, "
        f"base model {info['base_model'] or '(none: a tiny random model)'}",
        markup=False,
    )
    out.print(f"PEFT adapter: {path}", markup=False)


@app.command("eval")
def eval_(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="run directories, or a parent holding them (e.g. runs/bbc_news-<stamp>)")
    ],
    mmlu_root: Annotated[Path, typer.Option("--mmlu", help="MMLU root folder holding test/<subject>_test.csv")] = Path(
        "../shared/data/mmlu"
    ),
    fraction: Annotated[
        float,
        typer.Option(
            "--fraction",
            help="score a seeded sample of this fraction of every subject (1 = FlowerTune's whole protocol)",
        ),
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="the sample's seed")] = 0,
    categories: Annotated[
        str, typer.Option("--categories", help="comma-separated, of stem, social_sciences, humanities")
    ] = "stem,social_sciences,humanities",
    batch_size: Annotated[int, typer.Option("--batch-size", help="prompts per forward pass")] = 16,
    device: Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[
        str, typer.Option("--dtype", help="auto (float32 on the CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16")
    ] = "auto",
    quantization: Annotated[
        str,
        typer.Option(
            "--quantization",
            help="the backbone held by bitsandbytes: 4 (nf4, FlowerTune's leaderboard), 8 (int8) or none",
        ),
    ] = "none",
    backbone: Annotated[
        bool,
        typer.Option(
            "--backbone/--no-backbone", help="also score the bare backbone (the reference of the paired differences)"
        ),
    ] = True,
    out_dir: Annotated[
        Optional[Path],
        typer.Option("--out", help="where the per-model results and the table go (default <first run's parent>/eval)"),
    ] = None,
) -> None:
    """Score the backbone and each run's final adapter on FlowerTune's General-NLP protocol (MMLU
    STEM / social sciences / humanities, its prompt, greedy one-token answers) and by the letters'
    log-likelihood, through EleutherAI's lm-evaluation-harness with the local MMLU files
    (nestfed/evaluation/harness.py, nestfed/experiments/general_nlp.py)."""
    from nestfed.evaluation import harness
    from nestfed.experiments import general_nlp
    from nestfed.io import atomic

    base, entries = general_nlp.models(run_dirs, backbone)
    protocol = harness.Protocol(
        str(mmlu_root),
        tuple(c.strip() for c in categories.split(",") if c.strip()),
        fraction,
        seed,
        batch_size,
        device,
        dtype,
        harness.quantization_name(quantization),
    )
    protocol.placement()  # a bad --device or --dtype is one line before anything runs
    target = (
        out_dir or (run_dirs[0].resolve().parent if (run_dirs[0] / "config.toml").is_file() else run_dirs[0]) / "eval"
    )
    target.mkdir(parents=True, exist_ok=True)

    def progress(label: str, cached: bool) -> None:
        say(f"{label}: {'scored before (same protocol and adapter)' if cached else 'scoring through lm-eval'}")

    results = general_nlp.score(base, entries, protocol, target, progress)
    table = general_nlp.rows(results)
    text = general_nlp.markdown(table, leaderboard=base.name == "smollm2-135m-instruct")
    out.print(text, markup=False)
    atomic.write_text(target / "flowertune_general_nlp.md", text)
    atomic.write_json(target / "flowertune_general_nlp.json", table)
    out.print(f"wrote flowertune_general_nlp.md and .json into {target}", markup=False)


@app.command("methods")
def list_methods(
    name: Annotated[Optional[str], typer.Argument(help="a method: show its options, defaults and meaning")] = None,
) -> None:
    """The registered methods: name, the config sections they own, whether they run on Flower; with
    NAME, that method's options (section, key, default, meaning)."""
    if name is None:
        rows = [
            (
                m.name,
                ", ".join(f"[{s}]" for s in m.sections) or "-",
                "flower" if m.on_flower else "embedded only",
                m.summary,
            )
            for m in methods.REGISTRY.values()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:  # plain lines: one per method, whatever the terminal's width
            print(" ".join(f"{v:{w}s}" for v, w in zip(r, widths)), r[3])
        return
    if name not in methods.REGISTRY:
        raise NestfedError(f"methods: unknown method '{name}' (known: {', '.join(methods.REGISTRY)})")
    from rich.table import Table

    from nestfed.config.option_docs import option_docs

    m = methods.REGISTRY[name]
    out.print(f"{m.name}: {m.summary}", markup=False)
    if not m.sections:
        out.print(
            "no options of its own: the core sections apply ([lora], [train], ...: docs/reference.md)", markup=False
        )
        return
    table = Table("option", "default", "meaning", show_lines=False)
    for section, cls in m.sections.items():
        for doc in option_docs(cls):
            table.add_row(f"{section}.{doc.key}", doc.default, doc.meaning or "-")
    out.print(table)


def main() -> None:
    """Entry point: run the Typer app, turning nestfed's input errors into one line and exit 2."""
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        app(standalone_mode=False)
    except NestfedError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except click.ClickException as exc:  # usage errors
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
