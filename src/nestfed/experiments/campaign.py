"""An experiment campaign: the method runs one ``nestfed run`` makes and the comparison it writes.

A ``Campaign`` is every method over every seed on the same clients (``Campaign.new``), or the
runs under a run directory left to continue (``Campaign.resumed``: resume discovery). It is:

- prepared once (``prepare_runs``: every method checked against the model before the first run
  directory);
- run method by method (``run_all``);
- and its finished runs compared (``write_comparison``: comparison.md / .json / .png and the
  mechanism figures).

A comparison whose clients run compressed models has its own recipe (``compressed``,
nestfed.experiments.compressed_comparison).

Everything is reported through callbacks (one plain line, a table or text to show, a run's
progress as ``Step`` events), so the command line prints it and nothing here prints.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nestfed import config, methods
from nestfed.config import ExperimentConfig
from nestfed.errors import NestfedError
from nestfed.experiments import (
    comparison,
    generation_report,
    preflight,
    report,
    round_report,
    seed_report,
    tier_report,
)
from nestfed.experiments.compressed_comparison import compare as compare_compressed
from nestfed.experiments.prepare import prepare
from nestfed.experiments.run import new_run_dir, run_method
from nestfed.federation.loop import OnEvent
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import RunDir
from nestfed.io import atomic

PLAN = "campaign"  # <parent>/campaign/<key>.toml: every run's config, written before the first run
Line = Callable[[str], None]  # one plain line for the log
Show = Callable[[Any], None]  # a rich table, or text to print as it is


@dataclass(frozen=True)
class Step:
    """What one event of a method's run shows.

    Attributes:
        advance: sampled clients done; default 0.
        description: the progress bar's new description; None leaves it unchanged.
        log: a line to print above the progress bar; None for none.
        line: after a round, that round's one plain line (for logs, CI and pipes); None otherwise.
    """

    advance: int = 0
    description: str | None = None
    log: str | None = None
    line: str | None = None


#: start(key, total, done) -> the callback of that run's steps: total and done in sampled clients
Start = Callable[[str, int, int], Callable[[Step], None]]


@dataclass
class Campaign:
    """The method runs of one ``nestfed run``.

    Attributes:
        configs: {key: the run's validated config}, keyed by the method's name or, over seeds,
            ``seed<N>/<method>``.
        dirs: {key: the run's directory}, keyed as ``configs``.
        parent: their common directory, which receives the comparison; None for a single run.
        resume: the runs continue after their latest checkpoints; default False.
    """

    configs: dict[str, ExperimentConfig]
    dirs: dict[str, Path]
    parent: Path | None = None
    resume: bool = False

    @classmethod
    def new(cls, per_method: dict[str, ExperimentConfig], seeds: int = 1) -> Campaign:
        """Every method over every seed, in new run directories.

        The directories: ``<parent>/<method>`` or ``<parent>/seed<N>/<method>`` under one new
        parent when there are several runs.

        Args:
            per_method: {name: its validated config}.
            seeds: how many seeds: federation.seed and lora.init_seed + 0..seeds-1.

        Returns:
            The campaign.
        """
        first = next(iter(per_method.values()))
        parent = None
        if len(per_method) > 1 or seeds > 1:
            parent = new_run_dir(methods.replace_config(first, output={"name": first.output.name or "compare"}))
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
        return cls(cfgs, dirs, parent)

    @classmethod
    def resumed(cls, path: Path, overrides: list[str], on_line: Line) -> Campaign:
        """The runs under a directory to continue (``resumable``), each with its stored config.

        Args:
            path: a run directory, or a multi-method parent.
            overrides: ``--set`` overrides; they may restate the stored config or raise
                ``federation.rounds`` (config.toml is then rewritten).
            on_line: called with each change made to a config.toml.

        Returns:
            The campaign, with ``resume`` set.

        Raises:
            NestfedError: when there is nothing to continue, for any other config difference
                (naming the keys), or a run without a readable checkpoint or without the
                per-client state its method needs (nestfed.experiments.preflight.accept_resume).
            DataError: for a corrupted checkpoint or metrics file.
        """
        todo, parent = resumable(path, overrides)
        cfgs = {}
        for name, d in todo.items():
            rd = RunDir(d)
            if not rd.config_path.is_file():  # never started: it runs from its recorded config
                cfgs[name] = methods.load_run_config(planned_config(path, name), overrides)
                continue
            wanted = methods.load_run_config(rd.config_path, overrides)
            for change in preflight.accept_resume(rd, wanted):  # fails here, before any work
                on_line(f"resume {d}: config.toml now has {change}")
            cfgs[name] = wanted
        return cls(cfgs, todo, parent, resume=True)

    def record_plan(self) -> None:
        """Write every run's config under ``<parent>/campaign/`` before the first run starts.

        So a campaign interrupted at any instant resumes every run, those never started too
        (``resumable``). Written into a staging folder renamed into place, so the record is whole
        or absent. Nothing is written for a single run or a resume.
        """
        if self.parent is None or self.resume:
            return
        staging = self.parent / f".{PLAN}.tmp"  # all or none: the folder is renamed into place
        shutil.rmtree(staging, ignore_errors=True)
        for key, cfg in self.configs.items():
            path = staging / f"{key}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(path, config.dumps_toml(cfg))
        os.replace(staging, self.parent / PLAN)

    def reported(self) -> list[Path]:
        """The runs the comparison reports once these have run.

        Returns:
            Every finished run under the parent of a resume (those finished before it too), else
            these runs in order.
        """
        return finished_under(self.parent) if self.resume and self.parent is not None else list(self.dirs.values())


def prepared_line(prep: Prepared) -> str:
    """Say what preparation found, in one line.

    Args:
        prep: the prepared model and clients.

    Returns:
        Every client (rank, n_k, labels), or, beyond config.INLINE_CLIENTS clients, the clients per
        rank and the spread of n_k.
    """
    head = f"prepared {len(prep.clients)} clients in {prep.prepare_time_s:.1f} s"
    if len(prep.clients) <= config.INLINE_CLIENTS:
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


def prepare_runs(c: Campaign, on_status: Line) -> Prepared:
    """Prepare once (from the first config), then check every method against the model.

    Nothing is written before every method's settings fit the model.

    Args:
        c: the campaign.
        on_status: called with what preparation is doing.

    Returns:
        The prepared model and clients.

    Raises:
        ConfigError: when a method's settings do not fit the model.
    """
    prep = prepare(next(iter(c.configs.values())), on_status=on_status)
    preflight.check_models(prep, c.configs.values())
    return prep


def run_all(c: Campaign, prep: Prepared, start: Start) -> None:
    """Run (or continue) every method of a campaign, one after another.

    Args:
        c: the campaign.
        prep: the prepared model and clients.
        start: called as ``start(key, total, done)`` (in sampled clients) as each run begins;
            returns where that run's ``Step`` events go.
    """
    c.record_plan()
    for key, cfg in c.configs.items():
        k = config.sampled_per_round(cfg)
        resume = c.resume and RunDir(c.dirs[key]).config_path.is_file()  # else never started: a new run
        found = RunDir(c.dirs[key]).checkpoints() if resume else []
        show = start(key, cfg.federation.rounds * k, (found[-1][0] if found else 0) * k)
        on_event = steps(key, cfg.federation.rounds, len(prep.clients), show)
        run_method(prep, cfg, c.dirs[key], resume=resume, on_event=on_event)


def steps(name: str, rounds: int, clients: int, show: Callable[[Step], None]) -> OnEvent:
    """Turn the round loop's events (nestfed.federation.loop) into ``Step`` events.

    Args:
        name: the run's key, shown on each step.
        rounds: the run's rounds.
        clients: the number of clients (a round evaluated over fewer says so).
        show: called with each step.

    Returns:
        The loop's ``on_event``: a client done, a log line, the generated evaluation's answers, a
        round's mean held-out perplexity (and the global held-out set's), time and rejections.
    """

    def on_event(kind: str, info: dict[str, Any]) -> None:
        if kind == "client_done":
            show(Step(1, f"{name} round {info['round']} client {info['cid']}"))
        elif kind == "log":
            show(Step(log=info["text"]))
        elif kind == "generated":  # the generated evaluation after the last round
            show(Step(description=f"{name} answers generated {info['done']}/{info['total']}"))
        elif kind == "round_done":
            ln = info["line"]
            ev = ln.get("eval") or {}
            mean = sum(v["ppl"] for v in ev.values()) / len(ev) if ev else float("nan")
            who = "" if len(ev) == clients else f" over {len(ev)} of {clients} clients"
            what = f"mean held-out ppl {mean:.2f}{who}" if ev else "not evaluated"
            glob = f", global {ln['eval_global']['ppl']:.2f}" if "eval_global" in ln else ""
            line = (
                f"{name} round {info['round']}/{rounds}: {what}{glob}, "
                f"{ln['time_s']:.0f} s, {len(ln['rejected'])} rejected"
            )
            show(Step(description=f"{name} round {info['round']}: {what}", line=line))

    return on_event


def resumable(path: Path, overrides: list[str]) -> tuple[dict[str, Path], Path | None]:
    """Find the method runs under a directory to continue.

    Args:
        path: a run directory, or a multi-method parent, over seeds or not.
        overrides: ``--set`` overrides; a ``federation.rounds`` above a finished run's rounds
            continues it.

    Returns:
        ({key: run directory}, the parent whose comparison is rewritten or None for a single run):
        the unfinished runs, those the campaign recorded but never started (``planned_config``),
        and finished ones asked for more rounds, keyed by their path below the parent
        (``prelort``, ``seed1/prelort``).

    Raises:
        NestfedError: when there is none.
    """

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
    plan = path / PLAN
    planned = sorted({path / p.relative_to(plan).with_suffix("") for p in plan.rglob("*.toml")})
    subs = sorted({*subs, *planned})
    if not subs:
        raise NestfedError(f"--resume: {path} is not a nestfed run directory (no config.toml)")
    todo = {str(p.relative_to(path)): p for p in subs if not (p / "config.toml").is_file() or wanted(p)}
    if not todo:
        raise NestfedError(f"--resume: every run under {path} has finished{more}")
    return todo, path if len(subs) > 1 else None


def planned_config(parent: Path, key: str) -> Path:
    """Where a campaign records a run's config before it starts (``Campaign.record_plan``).

    Args:
        parent: the campaign's parent directory.
        key: the run's key (``prelort``, ``seed1/prelort``).

    Returns:
        ``<parent>/campaign/<key>.toml``.
    """
    return parent / PLAN / f"{key}.toml"


def finished_under(parent: Path) -> list[Path]:
    """List the finished runs under a multi-method parent.

    Args:
        parent: the parent directory.

    Returns:
        Its ``<method>/`` or, over seeds, ``seed<N>/<method>/`` directories holding a summary.json, sorted.
    """
    return sorted({p.parent for p in [*parent.glob("*/summary.json"), *parent.glob("*/*/summary.json")]})


def finished_runs(paths: Sequence[Path]) -> list[Path]:
    """List the finished run directories among some paths, each once, in order.

    Args:
        paths: run directories or multi-method parents.

    Returns:
        The finished run directories.

    Raises:
        NestfedError: when there is none.
    """
    dirs: list[Path] = []
    for d in paths:
        for p in finished_under(d) if not (d / "summary.json").exists() else [d]:
            if p.resolve() not in [x.resolve() for x in dirs]:
                dirs.append(p)
    if not dirs:
        raise NestfedError(f"no finished run directory among {', '.join(map(str, paths))}")
    return dirs


def mixed_experiments(dirs: Sequence[Path]) -> str | None:
    """Warn when runs differ in [model] or [data]: their perplexities are not on one test set.

    Args:
        dirs: the run directories.

    Returns:
        The warning; None when they agree.
    """
    experiments = {
        (str(config.to_dict(c)["model"]), str(config.to_dict(c)["data"]))
        for c in (methods.load_run_config(d / "config.toml") for d in dirs)
    }
    if len(experiments) == 1:
        return None
    return (
        "warning: these runs differ in [model] or [data]: their perplexities are not on one test set, and the "
        f"first row is {dirs[0]}'s round 0"
    )


def write_comparison(
    run_dirs: list[Path],
    parent: Path | None,
    show: Show,
    plot: Path | None = None,
    reference: str | None = None,
    table: Path | None = None,
) -> None:
    """Show the comparison of finished runs and write its files.

    Runs of one label over several seeds are reported with 95% intervals and paired differences
    against the reference (nestfed.experiments.seed_report).

    Args:
        run_dirs: the finished run directories.
        parent: where comparison.md / .json / .png (and, where the runs measured them,
            truncation.png, dimension_importance.png and by_round.png) go; None writes none of them.
        show: called with each table or text to show.
        plot: where the plots alone go (the bar chart there, the figures beside it); None for none.
        reference: the label compared against; None for the first label.
        table: also write the Markdown tables there and the rows beside it as JSON (same stem);
            None for none.

    Raises:
        NestfedError: for a run given twice or an unknown ``reference``.
    """
    rows = report.comparison_rows(run_dirs)
    try:
        groups = seed_report.by_label(rows)
    except ValueError as exc:  # two runs of one label and seed: different experiments, or one run twice
        raise NestfedError(
            f"{exc}: these runs share a label, a seed and every config field (the same run twice?); "
            "give each run once, or set output.label on them"
        ) from None
    if reference is not None and reference not in groups:
        raise NestfedError(f"--reference: '{reference}' is not among the compared runs ({', '.join(groups)})")
    curves, importance = seed_report.truncation_stats(rows), seed_report.importance_stats(rows)
    shown, bars = comparison.table_and_plot(rows, reference)
    show(shown)
    if tier_report.has_tiers(rows):  # device tiers: each label's tiers against the reference
        ref = reference or next(iter(groups))
        show(tier_report.table(tier_report.tier_stats(rows, groups, ref), ref))
    markdown = comparison.markdown(rows, reference)
    answers = generation_report.markdown(rows, reference)
    if answers:  # the generated evaluation's scores (ROUGE-L, accuracy) with their intervals
        show(answers)
    figures = {
        "truncation.png": seed_report.truncation_plot(curves) if curves else None,
        "dimension_importance.png": seed_report.importance_plot(importance) if importance else None,
        "by_round.png": round_report.plot(rows),
    }
    figures = {name: data for name, data in figures.items() if data is not None}
    if parent is not None:
        files = {"comparison.md": markdown, "comparison.json": rows, "comparison.png": bars, **figures}
        for name, data in files.items():
            _write(parent / name, data)
        show(f"wrote {', '.join(files)} into {parent}")
    if plot is not None:
        written = [_write(plot, bars)] + [_write(plot.with_name(f"{plot.stem}_{n}"), d) for n, d in figures.items()]
        show(f"wrote {', '.join(map(str, written))}")
    if table is not None:
        _write(table, markdown)
        _write(table.with_suffix(".json"), rows)
        show(f"wrote {table} and {table.with_suffix('.json')}")
    if curves and parent is None:
        show(seed_report.truncation_markdown(curves))


def _write(path: Path, data: str | bytes | list[dict[str, Any]]) -> Path:
    """``data`` at ``path``, atomically: text, bytes (a figure) or rows (JSON)."""
    if isinstance(data, str):
        atomic.write_text(path, data)
    elif isinstance(data, bytes):
        atomic.write_bytes(path, data)
    else:
        atomic.write_json(path, data)
    return path


def compressed(cfg: ExperimentConfig, names: list[str], on_line: Line) -> Path:
    """Run the comparison in which some clients run compressed models.

    For a method declaring ``comparison = "compressed"``: client and server perplexity, client
    memory and bytes per round for every method (nestfed.experiments.compressed_comparison), one
    run directory per method under one parent.

    Args:
        cfg: the experiment's config.
        names: the methods compared.
        on_line: called with each round's line and each log line.

    Returns:
        The parent directory.
    """

    def on_event(kind: str, info: dict[str, Any]) -> None:
        if kind == "round_done" and "eval" in info["line"]:
            ev = info["line"]["eval"]
            on_line(
                f"  round {info['round']}: mean client held-out ppl "
                f"{sum(v['ppl'] for v in ev.values()) / len(ev):.2f}, {info['line']['time_s']:.0f} s"
            )
        elif kind == "log":
            on_line(info["text"])

    return compare_compressed(cfg, names, on_status=on_line, on_event=on_event)
