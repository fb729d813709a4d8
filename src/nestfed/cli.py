"""The ``nestfed`` command line: ``run`` (one or several methods over seeds; FedSLM's or FedMKT's
compressed clients make it the compressed comparison), ``compare``, ``export``, ``eval``, ``methods``.

A command parses its options, calls a recipe (nestfed.experiments.campaign, whose checks before
anything is written are nestfed.experiments.preflight's) and prints what it reports. Bad input prints
one line naming the key or file and exits with code 2, before any run directory is created.

What a command runs is imported when it runs, so ``--help``, ``nestfed methods`` and a config error
answer without loading torch; import-linter checks these imports like any other.
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

from nestfed import methods
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
    """Print one plain line on stderr (no rich markup: text in square brackets is printed as it is).

    Args:
        text: the line.
    """
    console.print(text, markup=False, soft_wrap=True)


def _progress() -> Progress:
    """The live bar on stderr. While it runs on a terminal it takes over stdout too, unless stdout
    is a pipe or file: what is written there must reach it (``_round_lines``)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=False, redirect_stdout=out.is_terminal)


def _round_lines() -> Console | None:
    """Where one plain line per round goes as it happens, for logs, CI, a pipe or a file: stderr when
    it is not a terminal; else stdout when that is not one (``nestfed run ... | tee log`` keeps the
    bar on the terminal and the rounds in the log); None when both are terminals (the bar shows them)."""
    if not console.is_terminal:
        return console
    return out if not out.is_terminal else None


def show(thing) -> None:
    """Print on stdout.

    Args:
        thing: a rich table, or text printed as it is (no markup).
    """
    if isinstance(thing, str):
        out.print(thing, markup=False)
    else:
        out.print(thing)


def _run_campaign(campaign) -> None:
    """Prepare once under a status line, then run every method of ``campaign``
    (nestfed.experiments.campaign) under one progress bar each."""
    from nestfed.experiments import campaign as recipe

    with console.status("preparing") as status:
        prep = recipe.prepare_runs(campaign, on_status=lambda s: status.update(s))
    say(recipe.prepared_line(prep))
    lines = _round_lines()
    with _progress() as progress:

        def start(key: str, total: int, done: int):
            task = progress.add_task(key, total=total, completed=done)

            def on_step(step: recipe.Step) -> None:
                if step.log is not None:
                    progress.console.print(step.log, markup=False)
                if step.advance or step.description is not None:  # description None: unchanged
                    progress.update(task, advance=step.advance, description=step.description)
                if step.line is not None and lines is not None:  # logs, CI, pipes: one plain line per round
                    lines.print(step.line, markup=False, soft_wrap=True)
                    lines.file.flush()  # a pipe's reader sees it now

            return on_step

        recipe.run_all(campaign, prep, start)


def _new_campaign(config: Path | None, overrides: list[str], methods_: str | None, seeds: int):
    """The campaign of ``nestfed run CONFIG``: its methods over its seeds, the config and the
    options checked before any model library loads; None once a comparison with compressed
    clients (which runs its own recipe) has run and been printed."""
    if config is None:
        raise NestfedError("give a CONFIG.toml (or --resume RUN_DIR)")
    cfg = methods.load_config(config, overrides)
    names = methods.named(methods_, cfg.strategy.name)
    if seeds < 1:
        raise NestfedError(f"--seeds must be >= 1, got {seeds}")
    compressed = [m for m in names if methods.get(m).comparison == "compressed"]
    if compressed and seeds > 1:
        raise NestfedError(f"--seeds: the comparison with {compressed[0]} runs one seed")
    per_method = {} if compressed else {m: methods.with_method(cfg, m) for m in names}  # e.g. fedavg, unequal ranks
    from nestfed.experiments import campaign  # the model libraries load once the config is valid

    if not compressed:
        return campaign.Campaign.new(per_method, seeds)
    parent = campaign.compressed(cfg, names, say)  # clients run compressed models: that comparison's figures
    show((parent / "comparison.md").read_text())
    show(f"run directory: {parent}")
    return None


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
    """Run an experiment: federated rounds, checkpoints, PEFT adapter, plots, a comparison table.

    Over seeds: means with 95% intervals and paired differences against the first method.
    """
    t0 = time.perf_counter()
    if resume is not None:
        if config is not None or methods_:
            raise NestfedError(
                "--resume runs the run directory's own config and methods; drop CONFIG and --methods "
                "(--set may restate a value or raise federation.rounds)"
            )
        from nestfed.experiments.campaign import Campaign

        campaign = Campaign.resumed(resume, set_ or [], say)
    else:
        campaign = _new_campaign(config, set_ or [], methods_, seeds)
    if campaign is not None:
        from nestfed.experiments.campaign import write_comparison

        _run_campaign(campaign)
        run_dirs = campaign.reported()
        write_comparison(run_dirs, campaign.parent, show)
        for rd in run_dirs:
            show(f"run directory: {rd}")
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
    """Print a side-by-side table of finished runs and write the comparison plot.

    The plot goes to ./comparison.png by default, the truncation curve, dimension importance and
    held-out perplexity by round beside it when measured. Runs of one method over several seeds
    are reported with 95% intervals and paired differences. Runs of different experiments (their
    model or data sections differ) are compared with a warning: the first row is the first run's
    round 0.
    """
    from nestfed.experiments import campaign

    dirs = campaign.finished_runs(run_dirs)
    warning = campaign.mixed_experiments(dirs)
    if warning is not None:
        say(warning)
    campaign.write_comparison(dirs, None, show, plot, reference, table)


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
    """Write a PEFT adapter that PEFT runs exactly as nestfed does.

    The global adapter truncated to rank r (lora_alpha set so that PEFT's lora_alpha / r is the
    client's scale), or client k's own adapter (src/nestfed/experiments/export.py).
    """
    from nestfed.experiments.export import export_adapter

    path, info = export_adapter(run_dir, rank, client, out_dir)
    who = f"client {info['client']}'s adapter" if info["client"] is not None else "the global adapter"
    show(
        f"{who} of {info['method']} after round {info['round']}: rank {info['rank']}, scale {info['scale']:g}, "
        f"base model {info['base_model'] or '(none: a tiny random model)'}"
    )
    show(f"PEFT adapter: {path}")


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
    """Score the backbone and each run's final adapter on FlowerTune's General-NLP protocol.

    MMLU STEM / social sciences / humanities, its prompt, greedy one-token answers, and by the
    letters' log-likelihood, through EleutherAI's lm-evaluation-harness with the local MMLU files
    (nestfed/evaluation/harness.py, nestfed/experiments/general_nlp.py).
    """
    from nestfed.evaluation import harness
    from nestfed.experiments import general_nlp

    cats = tuple(c.strip() for c in categories.split(",") if c.strip())
    protocol = harness.Protocol(str(mmlu_root), cats, fraction, seed, batch_size, device, dtype, quantization)
    text, target = general_nlp.evaluate(run_dirs, protocol, backbone, out_dir, say)
    show(text)
    show(f"wrote flowertune_general_nlp.md and .json into {target}")


@app.command("methods")
def list_methods(
    name: Annotated[Optional[str], typer.Argument(help="a method: show its options, defaults and meaning")] = None,
) -> None:
    """List the registered methods: name, the config sections they own, whether they run on Flower.

    With NAME, that method's options (section, key, default, meaning).
    """
    if name is None:
        for line in methods.listing():  # plain lines: one per method, whatever the terminal's width
            print(line)
        return
    if name not in methods.REGISTRY:
        raise NestfedError(f"methods: unknown method '{name}' (known: {', '.join(methods.REGISTRY)})")
    from rich.table import Table

    from nestfed.config.option_docs import option_docs

    m = methods.REGISTRY[name]
    show(f"{m.name}: {m.summary}")
    if not m.sections:
        show("no options of its own: the core sections apply ([lora], [train], ...: docs/reference.md)")
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
