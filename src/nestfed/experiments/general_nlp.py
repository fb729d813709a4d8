"""``nestfed eval``: the backbone and runs' adapters on FlowerTune's General-NLP protocol
(nestfed.evaluation.harness, through lm-eval), with intervals and paired differences.

Each model's per-question correctness is kept in ``<out>/<label>.json`` beside the protocol and a
key (the protocol with its MMLU files' contents, the backbone's files and the adapter's weights,
hashed), so a second ``nestfed eval`` over the same runs scores nothing again. A category's accuracy carries its 95%
Wilson interval (scipy.stats.binomtest); an adapter is set against the backbone on the same
questions: the paired difference of correctness over every question of the three categories,
with its t interval (nestfed.experiments.intervals), significant when it excludes zero.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tomllib
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from scipy import stats

from nestfed.errors import NestfedError
from nestfed.evaluation import harness
from nestfed.experiments.intervals import paired_difference
from nestfed.experiments.report import run_label
from nestfed.io import atomic
from nestfed.io.markdown import BLANK, markdown_row, markdown_table
from nestfed.nn.backbone import BUILTINS, TINY, convert_builtin, default_cache_dir, tiny_dir

BACKBONE = "backbone"
#: FlowerTune LLM leaderboard, General NLP (flower.ai/benchmarks/llm-leaderboard/nlp, read 2026-12-01):
#: rank, team, base model, STEM, social sciences, humanities, average (%), date. Both rows are
#: federated fine-tunes of the base model with a 4-bit quantised base, scored by generation.
LEADERBOARD = (
    ("#14 T-IoI@UNR, SmolLM2-135M-Instruct (FL fine-tuned, 2025-04-14)", 18.68, 21.90, 22.74, 21.10),
    ("#19 T-IoI@UNR, SmolLM2-135M base (FL fine-tuned)", 2.94, 3.31, 2.29, 2.84),
)


def _runs(paths: list[Path]) -> list[Path]:
    """Run directories named directly or found under a multi-method parent (``*/`` or ``seed*/*/``)."""
    found = []
    for p in paths:
        if (p / "config.toml").is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted({c.parent for c in [*p.glob("*/config.toml"), *p.glob("*/*/config.toml")]}))
        else:
            raise NestfedError(f"{p}: no such run directory")
    if not found and paths:
        raise NestfedError(f"{paths[0]}: holds no nestfed run (no config.toml)")
    return found


def models(paths: list[Path], include_backbone: bool = True) -> tuple[Path, list[tuple[str, Path | None]]]:
    """The backbone directory and the models to score.

    A built-in tiny random model is written out as a Hugging Face directory
    (nestfed.nn.backbone.tiny_dir).

    Args:
        paths: run directories, or multi-method parents (``*/`` or ``seed*/*/``).
        include_backbone: score the bare backbone first.

    Returns:
        (the backbone directory, the (label, adapter directory) pairs): the backbone itself
        (adapter None) first when ``include_backbone``, then each run's final ``adapter/``.

    Raises:
        NestfedError: naming the run: no PEFT adapter (an unfinished run, or a method whose
            clients do not run LoRA on the backbone), runs on different backbones, or a backbone
            that is not a Hugging Face directory.
    """
    backbone: Path | None = None
    out: list[tuple[str, Path | None]] = []
    for run in _runs(paths):
        try:
            cfg = tomllib.loads((run / "config.toml").read_text())
        except tomllib.TOMLDecodeError as exc:
            raise NestfedError(f"{run / 'config.toml'}: invalid TOML: {exc}") from None
        adapter = run / "adapter"
        config = adapter / "adapter_config.json"
        if not config.is_file():
            raise NestfedError(
                f"{run}: no PEFT adapter (adapter/adapter_config.json): the run is unfinished or its "
                f"method ({cfg.get('strategy', {}).get('name')}) exports no LoRA adapter"
            )
        try:
            base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
        except (json.JSONDecodeError, AttributeError) as exc:
            raise NestfedError(f"{config}: not a PEFT adapter config ({exc})") from None
        if not base:
            model = cfg.get("model", {})
            name = model.get("name", "")
            cache = Path(model["cache_dir"]) if model.get("cache_dir") else default_cache_dir()
            if name in BUILTINS:
                base = str(convert_builtin(name, cache))
            elif name in TINY:  # the tiny random model, written out as the directory lm-eval loads
                base = str(tiny_dir(name, int(model.get("seed", 0)), cache))
            else:
                base = name
        if not (Path(base) / "config.json").is_file():
            raise NestfedError(f"{run}: its backbone '{base}' is not a Hugging Face directory; lm-eval cannot load it")
        if backbone is not None and Path(base) != backbone:
            raise NestfedError(f"{run}: backbone {base} differs from {backbone}; evaluate one backbone at a time")
        backbone = Path(base)
        label = run_label(cfg, cfg.get("strategy", {}).get("name", run.name))
        taken = {lab for lab, _ in out}
        out.append((label if label not in taken else f"{label} ({run.name})", adapter))
    if backbone is None:
        raise NestfedError("nestfed eval: give at least one run directory")
    return backbone, ([(BACKBONE, None)] if include_backbone else []) + out


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes (cached per path, size and modification time within a process)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: Path, recursive: bool = True) -> str:
    """Hash what a score read, whatever path it was reached by.

    Args:
        root: a directory.
        recursive: every file below it; False: only those directly in it.

    Returns:
        The sha256 (hex) over the files' relative names and contents, sorted.
    """
    h = hashlib.sha256()
    root = Path(root)
    for f in sorted(p for p in (root.rglob("*") if recursive else root.iterdir()) if p.is_file()):
        st = f.stat()
        h.update(f.relative_to(root).as_posix().encode())
        h.update(_file_digest(str(f.resolve()), st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()


def _key(backbone: Path, adapter: Path | None, protocol: harness.Protocol) -> str:
    """sha256 of the protocol (its MMLU folder by the contents of its files, not its path, and its
    resolved dtype where that is not float32), the backbone's files (config and weights) and the
    adapter's files: an edited answer key, another copy of MMLU behind the same relative path or
    other weights give another key."""
    spec = {k: v for k, v in asdict(protocol).items() if k not in ("device", "dtype", "mmlu_root")}
    if spec.get("quantization") == "none":  # the keys of results scored before quantisation existed
        del spec["quantization"]
    dtype = protocol.placement()[1]
    if dtype != "float32":
        spec["dtype"] = dtype
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    h.update(tree_digest(Path(protocol.mmlu_root)).encode())
    h.update(tree_digest(backbone, recursive=False).encode())  # its files, not caches kept in subfolders
    if adapter is not None:
        for f in sorted(adapter.iterdir()):
            if f.is_file():
                h.update(f.name.encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def score(
    backbone: Path, entries: list[tuple[str, Path | None]], protocol: harness.Protocol, out_dir: Path, progress=None
) -> dict[str, dict]:
    """Score every (label, adapter) on a protocol, reusing what was scored before.

    Each model's file is written atomically once it is scored, so an interrupted evaluation keeps
    every model finished before it.

    Args:
        backbone: the backbone directory.
        entries: the (label, adapter directory or None) pairs.
        protocol: the evaluation protocol.
        out_dir: where ``<label>.json`` is kept, and reused when its key matches.
        progress: called as ``progress(label, cached)`` before each model; None for none.

    Returns:
        {label: {"correct": {scoring: {category: [0/1, ...]}}, ...}}.

    Raises:
        ConfigError: as ``nestfed.evaluation.harness.evaluate`` and ``harness.questions``.
        DataError: as ``nestfed.evaluation.harness.evaluate`` and ``harness.questions``.
    """
    items = harness.questions(protocol)
    results = {}
    for label, adapter in entries:
        path = out_dir / f"{label.replace(' ', '_').replace('/', '_')}.json"
        key = _key(backbone, adapter, protocol)
        cached = json.loads(path.read_text()) if path.is_file() else None
        if cached is None or cached.get("key") != key:
            if progress:
                progress(label, False)
            correct = harness.evaluate(backbone, adapter, protocol, items)
            cached = {
                "key": key,
                "label": label,
                "backbone": str(backbone),
                "adapter": str(adapter) if adapter else None,
                "protocol": asdict(protocol),
                "correct": correct,
                "questions": {c: len(v) for c, v in items.items()},
            }
            atomic.write_json(path, cached)
        elif progress:
            progress(label, True)
        results[label] = cached
    return results


def evaluate(
    paths: list[Path],
    protocol: harness.Protocol,
    include_backbone: bool = True,
    out_dir: Path | None = None,
    on_line: Callable[[str], None] | None = None,
) -> tuple[str, Path]:
    """``nestfed eval``: score the runs' final adapters and write the tables.

    flowertune_general_nlp.md / .json (``rows``, ``markdown``) are written into the output folder.

    Args:
        paths: run directories or multi-method parents (``models``).
        protocol: the evaluation protocol; its ``quantization`` may be any of ``--quantization``'s
            values (harness.quantization_name).
        include_backbone: score the bare backbone too.
        out_dir: the output folder; None for ``<first run's parent>/eval``.
        on_line: called with a line as each model is scored or found scored before; None for none.

    Returns:
        (the Markdown, the output folder).

    Raises:
        NestfedError: for a path without runs, or as ``models``.
        ConfigError: for a bad quantization, device or dtype before anything runs, and as ``score``.
        DataError: as ``score``.
    """
    base, entries = models(paths, include_backbone)
    protocol = replace(protocol, quantization=harness.quantization_name(protocol.quantization))
    protocol.placement()  # a bad --device or --dtype is one line before anything runs
    target = out_dir or (paths[0].resolve().parent if (paths[0] / "config.toml").is_file() else paths[0]) / "eval"
    target.mkdir(parents=True, exist_ok=True)

    def progress(label: str, cached: bool) -> None:
        if on_line is not None:
            on_line(f"{label}: {'scored before (same protocol and adapter)' if cached else 'scoring through lm-eval'}")

    results = score(base, entries, protocol, target, progress)
    table = rows(results)
    text = markdown(table, leaderboard=base.name == "smollm2-135m-instruct")
    atomic.write_text(target / "flowertune_general_nlp.md", text)
    atomic.write_json(target / "flowertune_general_nlp.json", table)
    return text, target


def _wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of k successes in n, in percent."""
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    return 100 * ci.low, 100 * ci.high


def rows(results: dict[str, dict]) -> list[dict]:
    """Tabulate the scores.

    Args:
        results: ``score``'s {label: result}.

    Returns:
        One row per (model, scoring): accuracy per category (% with its Wilson interval), their
        mean (FlowerTune's "Average"), and against the backbone (when scored) the paired
        difference in accuracy over all questions (percentage points, 95% interval, significant).
    """
    out = []
    base = results.get(BACKBONE)
    for label, res in results.items():
        for scoring in harness.SCORINGS:
            correct = res["correct"][scoring]
            cats = {
                c: {"accuracy": 100 * sum(v) / len(v), "interval": _wilson(sum(v), len(v)), "n": len(v)}
                for c, v in correct.items()
            }
            row = {
                "model": label,
                "scoring": scoring,
                "categories": cats,
                "average": sum(c["accuracy"] for c in cats.values()) / len(cats),
            }
            if base is not None and label != BACKBONE:
                diffs = [100 * (a - b) for c in correct for a, b in zip(correct[c], base["correct"][scoring][c])]
                d = paired_difference(diffs)
                row["vs_backbone"] = {
                    "mean": d.interval.mean,
                    "low": d.interval.low,
                    "high": d.interval.high,
                    "p": d.p_value,
                    "significant": d.significant,
                }
            out.append(row)
    return out


def markdown(table: list[dict], leaderboard: bool) -> str:
    """The rows as Markdown, one table per scoring.

    Args:
        table: ``rows``.
        leaderboard: add FlowerTune's leaderboard rows under the generation table (the backbone
            is SmolLM2-135M-Instruct).

    Returns:
        The Markdown.
    """
    text = []
    for scoring in harness.SCORINGS:
        sub = [r for r in table if r["scoring"] == scoring]
        if not sub:
            continue
        cats = list(sub[0]["categories"])
        how = "FlowerTune: greedy, one token" if scoring == "generation" else "log-likelihood of A-D"
        text.append(f"**{scoring}** ({how})\n")
        head = ["model", *(f"{c} (n={sub[0]['categories'][c]['n']})" for c in cats), "average", "vs backbone (pp, 95%)"]
        text += markdown_table(head)
        for r in sub:
            cells = [
                f"{r['categories'][c]['accuracy']:.2f} [{r['categories'][c]['interval'][0]:.1f}, "
                f"{r['categories'][c]['interval'][1]:.1f}]"
                for c in cats
            ]
            vs = r.get("vs_backbone")
            vs_text = (
                ""
                if vs is None
                else (
                    f"{vs['mean']:+.2f} [{vs['low']:+.2f}, {vs['high']:+.2f}]"
                    + (" significant" if vs["significant"] else "")
                )
            )
            text.append(markdown_row([r["model"], *cells, f"{r['average']:.2f}", vs_text]))
        if scoring == "generation" and leaderboard and cats == list(harness.CATEGORIES):
            for name, *acc in LEADERBOARD:
                text.append(markdown_row([f"leaderboard {name}", *(f"{a:.2f}" for a in acc[:4]), BLANK]))
        text.append("")
    return "\n".join(text)
