"""The run directory: the one object that writes what a run leaves, crash-consistent at every step.

::

    config.toml        the resolved config (written first, after the whole config was validated)
    metrics.jsonl      one JSON line per round, round 0 = before any training
    clients.jsonl      with many clients (output.client_detail): each round's per-client numbers
                       (``sampled``, ``clients``, ``eval``), one line per round, the metrics line
                       keeping summaries by rank group; its presence marks the layout
    clients.json/.csv  the final per-client table (rank, label, n_k, rounds trained, first and
                       last held-out metrics), written with the summary
    checkpoints/       round_NNN.safetensors: the global state after round NNN (its arrays and the
                       server optimiser's state) and, as one unit in the same file, every client's
                       kept state (FedALA's weights, FedNL's own LoRA)
    adapter/           the final global adapter in PEFT's format (only when some round aggregated)
    <name>.safetensors further arrays a method keeps (memory rules, fused cores)
    plots/             PNGs
    summary.json       written last: its presence marks a finished run

Commit order of a round: its per-client line (when they have their own file), then its metrics
line are appended (fsynced), then its checkpoint is written atomically. A crash between them leaves
lines without a checkpoint; :meth:`RunDir.resume` drops lines after the latest checkpoint (the round
is redone and writes its lines again), and a torn last line (a crash mid-append) is dropped with a
warning. So every finished round keeps exactly one
line, and a resumed run reaches the same state as an uninterrupted one (the seed rule,
nestfed.seeds). Every file is written atomically with the user's umask (nestfed.io.atomic).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from nestfed.config import ExperimentConfig, differences
from nestfed.errors import DataError, NestfedError
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.federation.plots import run_plots
from nestfed.federation.summary import (
    completed_summary,
    failed_summary,
    roster_ranks,
    roster_table,
    summarise,
)
from nestfed.io import atomic
from nestfed.nn.peft_export import export_peft_adapter
from nestfed.nn.quantization import bnb_config

log = logging.getLogger("nestfed")

FORMAT = "nestfed-checkpoint/2"
KEPT, ON_NODES = "kept", "on-nodes"
_ROUND_FILE = re.compile(r"round_(\d+)\.safetensors")
#: the keys of a metrics line that hold one entry per client, moved to clients.jsonl with many clients
DETAIL_KEYS = ("sampled", "clients", "eval")

ClientState = dict[int, dict[str, Arrays]]


def _stray(p: Path) -> bool:
    """A temporary file an interrupted atomic write left behind (nestfed.io.atomic names them
    ``.<name>-<random>.tmp``)."""
    return p.name.startswith(".") and p.name.endswith(".tmp")


def _leftover(p: Path) -> bool:
    """What a run that died before its config.toml leaves: a stray temporary file, or the empty
    ``clients.jsonl`` written first (:meth:`RunDir.create`)."""
    return _stray(p) or (p.name == "clients.jsonl" and p.is_file() and p.stat().st_size == 0)


def flatten_client_state(state: ClientState) -> dict[str, torch.Tensor]:
    """{cid: {group: {key: t}}} -> {"<cid>/<group>/<key>": t} (for one safetensors file or record)."""
    return {
        f"{cid}/{g}/{k}": t.contiguous()
        for cid, groups in state.items()
        for g, arrays in groups.items()
        for k, t in arrays.items()
    }


def unflatten_client_state(flat: dict[str, torch.Tensor]) -> ClientState:
    """Inverse of :func:`flatten_client_state`. Raises ValueError for a malformed key."""
    out: ClientState = {}
    for name, t in flat.items():
        parts = name.split("/", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1]:
            raise ValueError(f"client state key '{name}' is not <cid>/<group>/<payload key>")
        out.setdefault(int(parts[0]), {}).setdefault(parts[1], {})[parts[2]] = t
    return out


@dataclass
class Checkpoint:
    """A round's committed state: round (0 = before training), the global state, the clients'
    kept state (None when the clients keep it themselves, as Flower nodes do) and where that state
    lives (:data:`KEPT`: in this checkpoint; :data:`ON_NODES`: on the nodes)."""

    round: int
    state: GlobalState
    client_state: ClientState | None
    path: Path
    client_state_home: str = KEPT


@dataclass
class Exports:
    """What a finished run exports besides its metrics: ``adapter`` (PEFT arrays and their scale s;
    None or empty for none), ``base_model`` (the adapter's base_model_name_or_path), ``files``
    ({file name: arrays} written as safetensors) and ``summary`` (the method's extra summary fields)."""

    adapter: tuple[Arrays, float] | None = None
    base_model: str = ""
    files: dict[str, Arrays] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


class RunDir:
    """A run directory (see the module docstring). Create it with :meth:`create` (refuses a
    non-empty folder) or reopen one with :meth:`open`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_text: str | None = None  # the resolved config its checkpoints record

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, config_text: str, inline: bool = True) -> RunDir:
        """A new run directory holding ``config.toml`` (and, with ``inline`` False, an empty
        ``clients.jsonl``: the per-client numbers get their own file). Raises NestfedError when
        ``path`` exists and is not empty (a run is never overwritten)."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(not _leftover(p) for p in path.iterdir())):
            raise NestfedError(f"{path}: the run directory exists and is not empty; resume it or choose another")
        path.mkdir(parents=True, exist_ok=True)
        rd = cls(path)
        if not inline:  # first: a directory is a run once config.toml is there, and by then its layout is set
            atomic.write_text(rd.clients_path, "")
        atomic.write_text(rd.config_path, config_text)
        rd.config_text = config_text
        return rd

    @classmethod
    def open(cls, path: str | Path, config_text: str | None = None) -> RunDir:
        """An existing run directory; ``config_text``: the resolved config the run continues with
        (recorded in its later checkpoints). Raises NestfedError when it holds no config.toml."""
        rd = cls(path)
        if not rd.config_path.is_file():
            raise NestfedError(f"{rd.path}: not a nestfed run directory (no config.toml)")
        rd.config_text = config_text
        return rd

    def recorded_config(self) -> tuple[dict[str, Any], Path] | None:
        """The resolved config the latest checkpoint recorded (parsed TOML) and that checkpoint, or
        None (no checkpoint, or one written before checkpoints recorded it). Raises DataError for an
        unreadable checkpoint."""
        found = self.checkpoints()
        if not found:
            return None
        path = found[-1][1]
        try:
            with safe_open(str(path), framework="pt") as f:
                text = (f.metadata() or {}).get("config")
            return (tomllib.loads(text), path) if text is not None else None
        except (SafetensorError, OSError, tomllib.TOMLDecodeError) as exc:
            raise DataError(f"{path}: not a readable nestfed checkpoint ({type(exc).__name__}: {exc})") from None

    @property
    def config_path(self) -> Path:
        """The resolved config: ``config.toml``."""
        return self.path / "config.toml"

    @property
    def metrics_path(self) -> Path:
        """One JSON line per committed round: ``metrics.jsonl``."""
        return self.path / "metrics.jsonl"

    @property
    def clients_path(self) -> Path:
        """Each round's per-client numbers, with many clients: ``clients.jsonl``."""
        return self.path / "clients.jsonl"

    @property
    def inline(self) -> bool:
        """Whether the per-client numbers stay in the metrics lines (no ``clients.jsonl``)."""
        return not self.clients_path.is_file()

    @property
    def finished(self) -> bool:
        """Whether the run finished (summary.json exists)."""
        return (self.path / "summary.json").is_file()

    # -- metrics -------------------------------------------------------------------------------
    def read_metrics(self) -> list[dict[str, Any]]:
        """The metrics lines in file order. A torn last line (no newline, not JSON: a crash
        mid-append) is skipped with a warning. Raises DataError for a missing file or a malformed
        line elsewhere."""
        lines, torn = self._read_lines()
        if torn:
            log.warning("%s: skipped a torn last line: an append was interrupted", self.metrics_path)
        return lines

    def read_rounds(self) -> list[dict[str, Any]]:
        """The metrics lines with each round's per-client numbers put back from clients.jsonl (the
        lines as the round loop made them, whatever the layout). Raises DataError as
        :meth:`read_metrics`, and for a committed round whose per-client line is missing."""
        lines = self.read_metrics()
        if self.inline:
            return lines
        detail, _ = self._read_lines(self.clients_path)
        by_round = {int(d["round"]): d for d in detail}
        out = []
        for ln in lines:
            d = by_round.get(int(ln["round"]))
            if d is None:
                raise DataError(f"{self.clients_path}: no line for round {ln['round']} of {self.metrics_path}")
            out.append({**ln, **{k: v for k, v in d.items() if k != "round"}})
        return out

    def _read_lines(self, path: Path | None = None) -> tuple[list[dict[str, Any]], bool]:
        path = path or self.metrics_path
        if not path.is_file():
            raise DataError(f"{path}: not found (is {self.path} a nestfed run directory?)")
        text = path.read_text(encoding="utf-8")
        raw = text.split("\n")
        out, torn = [], False
        for i, line in enumerate(raw, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(raw) and not text.endswith("\n"):
                    torn = True  # an append was interrupted
                    continue
                raise DataError(f"{path}:{i}: malformed JSON line: {exc}") from None
        return out, torn

    def append_metrics(self, line: dict[str, Any]) -> None:
        """Append one metrics line, durably (fsync)."""
        atomic.append_line(self.metrics_path, json.dumps(line))

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_path(self, rnd: int) -> Path:
        """``checkpoints/round_NNN.safetensors`` of round ``rnd`` (at least three digits)."""
        return self.path / "checkpoints" / f"round_{rnd:03d}.safetensors"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Every checkpoint as (round, path), sorted by round number (not by name)."""
        folder = self.path / "checkpoints"
        found = (
            [(int(m.group(1)), p) for p in folder.glob("round_*.safetensors") if (m := _ROUND_FILE.fullmatch(p.name))]
            if folder.is_dir()
            else []
        )
        return sorted(found)

    def save_checkpoint(self, rnd: int, state: GlobalState, client_state: ClientState | None) -> Path:
        """Write round ``rnd``'s global state and the clients' kept state (None: kept on the
        clients) as one safetensors file, atomically: ``global/<key>`` (the arrays),
        ``optimizer/<key>`` (the server optimiser's state, GlobalState.optimizer; none under the
        default optimiser, so those checkpoints are unchanged) and ``client/<cid>/<group>/<key>``."""
        tensors = {f"global/{k}": v for k, v in state.arrays.items()}
        tensors.update({f"optimizer/{k}": v.contiguous() for k, v in state.optimizer.items()})
        if client_state:
            tensors.update({f"client/{k}": v for k, v in flatten_client_state(client_state).items()})
        meta = {
            "format": FORMAT,
            "round": str(rnd),
            "meta": json.dumps(state.meta),
            "client_state": KEPT if client_state is not None else ON_NODES,
            "order": json.dumps(list(tensors)),  # safetensors sorts its keys; a resume gets the run's order back
        }
        if self.config_text is not None:  # what a resume checks config.toml against (tamper-evident)
            meta["config"] = self.config_text
            meta["config_sha256"] = hashlib.sha256(self.config_text.encode()).hexdigest()
        return atomic.write_tensors(self.checkpoint_path(rnd), tensors, meta)

    def load_checkpoint(self, path: Path) -> Checkpoint:
        """Read a checkpoint (this format or the earlier one: round_NNN plus clients_NNN files).
        Raises DataError naming the file when it is unreadable or corrupted."""
        try:
            with safe_open(str(path), framework="pt") as f:
                md = dict(f.metadata() or {})
            raw = load_file(str(path))
            rnd, meta = int(md["round"]), json.loads(md["meta"])
            if "order" in md:  # the arrays in the order the run held them (sums over them are then the same)
                raw = {k: raw[k] for k in json.loads(md["order"])}
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise DataError(f"{path}: not a readable nestfed checkpoint ({type(exc).__name__}: {exc})") from None
        if md.get("format") != FORMAT:  # before nestfed-checkpoint/2: client state in a file beside it
            side = path.with_name(path.name.replace("round_", "clients_", 1))
            try:
                clients = unflatten_client_state(load_file(str(side))) if side.is_file() else None
            except (SafetensorError, OSError, ValueError) as exc:
                raise DataError(f"{side}: not a readable client-state file ({exc})") from None
            return Checkpoint(rnd, GlobalState(raw, meta), clients, path, KEPT if clients is not None else ON_NODES)
        arrays = {k[len("global/") :]: v for k, v in raw.items() if k.startswith("global/")}
        optimizer = {k[len("optimizer/") :]: v for k, v in raw.items() if k.startswith("optimizer/")}
        clients = None
        if md.get("client_state") == KEPT:
            try:
                clients = unflatten_client_state(
                    {k[len("client/") :]: v for k, v in raw.items() if k.startswith("client/")}
                )
            except ValueError as exc:
                raise DataError(f"{path}: {exc}") from None
        return Checkpoint(rnd, GlobalState(arrays, meta, optimizer), clients, path, md.get("client_state", KEPT))

    def commit(
        self,
        rnd: int,
        state: GlobalState,
        client_state: ClientState | None,
        line: dict[str, Any],
        keep_checkpoints: bool = True,
    ) -> dict[str, Any]:
        """Commit round ``rnd``: its per-client line (the :data:`DETAIL_KEYS` of ``line``, when they
        have their own file), its metrics line, then its checkpoint (see the module docstring).
        Without ``keep_checkpoints`` the earlier checkpoints are removed afterwards. Returns the
        metrics line as written."""
        written = dict(line)
        if not self.inline:
            detail = {"round": rnd, **{k: written.pop(k) for k in DETAIL_KEYS if k in written}}
            atomic.append_line(self.clients_path, json.dumps(detail))
        self.append_metrics(written)
        self.save_checkpoint(rnd, state, client_state)
        if not keep_checkpoints:
            for r, p in self.checkpoints():
                if r != rnd:
                    p.unlink(missing_ok=True)
        return written

    def latest_checkpoint(self, keeps_client_state: bool = False, home: str = KEPT) -> Checkpoint:
        """The checkpoint of the highest round, read and checked for a resume by a transport whose
        clients' kept state lives at ``home`` (:data:`KEPT`: in the checkpoint, the embedded runner;
        :data:`ON_NODES`: on the nodes, Flower).

        Raises NestfedError (no checkpoint; the method keeps per-client state and the checkpoint
        keeps it elsewhere: one written on Flower resumed embedded, or the reverse) or DataError (a
        corrupted checkpoint), each one line naming the file.
        """
        found = self.checkpoints()
        if not found:
            raise NestfedError(f"{self.path}: no checkpoint to resume from (checkpoints/round_NNN.safetensors)")
        ck = self.load_checkpoint(found[-1][1])
        if ck.round != found[-1][0]:
            raise DataError(
                f"{ck.path}: holds the state of round {ck.round}, not of round {found[-1][0]} "
                "(a renamed or copied checkpoint)"
            )
        if keeps_client_state and ck.round > 0 and home == KEPT and ck.client_state is None:
            raise NestfedError(
                f"{ck.path}: this method keeps per-client state, which this checkpoint does not hold "
                "(written on Flower, whose nodes keep it, or its clients_NNN file is gone); it cannot be "
                "resumed exactly here (resume it on Flower)"
            )
        if keeps_client_state and ck.round > 0 and home == ON_NODES and ck.client_state_home != ON_NODES:
            raise NestfedError(
                f"{ck.path}: this method keeps per-client state, which this checkpoint holds itself "
                "(an embedded run): Flower's nodes do not have it; resume it with nestfed run --resume"
            )
        return ck

    def _kept_lines(self, path: Path, last: int | None) -> tuple[list[dict[str, Any]], list[str], bool]:
        """(the lines of ``path`` for rounds 0..last, notes, whether the file must be rewritten); a
        torn last line and the lines of later rounds are dropped (``last`` None: a run that committed
        nothing, every line goes)."""
        lines, torn = self._read_lines(path) if path.is_file() else ([], False)
        notes = [f"{path}: dropped a torn last line (an append was interrupted)"] if torn else []
        keep = [] if last is None else [ln for ln in lines if int(ln.get("round", -1)) <= last]
        if last is not None and len(keep) != len(lines):
            later = sorted({int(ln["round"]) for ln in lines if int(ln.get("round", -1)) > last})
            notes.append(
                f"{path}: dropped the lines of rounds {later}, after the checkpoint of round {last} (they are redone)"
            )
        return keep, notes, torn or len(keep) != len(lines)

    def _resume_plan(
        self, keeps_client_state: bool, home: str = KEPT
    ) -> tuple[Checkpoint | None, dict[Path, tuple[list[dict[str, Any]], bool]], list[str]]:
        """(checkpoint or None, {file: (the lines to keep, whether to rewrite it)} for metrics.jsonl
        and clients.jsonl, notes): what :meth:`resume` does, computed without writing. Raises as
        :meth:`resume`."""
        files = [self.metrics_path] + ([] if self.inline else [self.clients_path])
        lines, _ = self._read_lines() if self.metrics_path.is_file() else ([], False)
        ck = None
        if self.checkpoints() or any(int(ln.get("round", -1)) > 0 for ln in lines):
            ck = self.latest_checkpoint(keeps_client_state, home)
        plan, notes = {}, []
        for path in files:
            keep, why, rewrite = self._kept_lines(path, None if ck is None else ck.round)
            plan[path] = (keep, rewrite)
            notes += why
            if ck is None and rewrite:
                notes.append(f"{path}: no round was committed yet; starting from round 0")
            rounds = [int(ln["round"]) for ln in keep]
            if ck is not None and rounds != list(range(ck.round + 1)):
                raise DataError(
                    f"{path}: holds rounds {rounds}, expected 0..{ck.round} once each for the checkpoint {ck.path.name}"
                )
        return ck, plan, notes

    def check_resume(self, keeps_client_state: bool, home: str = KEPT) -> None:
        """What :meth:`resume` checks, without writing anything: call it before any work.
        Raises as :meth:`resume` does."""
        self._resume_plan(keeps_client_state, home)

    def resume(self, keeps_client_state: bool, home: str = KEPT) -> tuple[Checkpoint | None, list[str]]:
        """Where a resumed run continues: the latest checkpoint (:meth:`latest_checkpoint`), with
        metrics.jsonl (and clients.jsonl) made to hold exactly rounds 0..its round (a torn last line
        and the lines of later rounds dropped, rewritten atomically), and notes of what was repaired.

        A run that crashed before its round-0 checkpoint (only config.toml and at most the round-0
        line exist) has no checkpoint: (None, notes) with the metrics emptied, and it starts from
        round 0 again (the initial state is deterministic). Raises as :meth:`latest_checkpoint`
        otherwise, and DataError for a metrics file that lacks a committed round.
        """
        ck, plan, notes = self._resume_plan(keeps_client_state, home)
        for path, (keep, rewrite) in plan.items():
            if rewrite:
                atomic.write_text(path, "".join(json.dumps(ln) + "\n" for ln in keep))
        return ck, notes

    def accept_config(self, stored: ExperimentConfig, wanted: ExperimentConfig, config_text: str) -> list[str]:
        """Check a resume's config against the one the run directory holds. Only
        ``federation.rounds`` (to extend a run, never below its latest checkpoint) and the
        ``[tracking]`` sinks (a sink added later is caught up from metrics.jsonl) may change;
        config.toml is then rewritten so the directory describes what runs, and the changes are
        returned (``section.key: old -> new``) for the run's log. Raises NestfedError naming any
        other key that differs."""
        diff = differences(stored, wanted)
        other = [d for d in diff if not d.startswith(("federation.rounds:", "tracking."))]
        if wanted.federation.rounds != stored.federation.rounds and stored.train.schedule_spans_rounds():
            other.append(  # the rounds run would have trained at other rates
                f"federation.rounds: {stored.federation.rounds} -> {wanted.federation.rounds} under "
                f"train.lr_schedule = '{stored.train.lr_schedule}' across the federation"
            )
        if other:
            raise NestfedError(
                f"{self.config_path}: a resumed run keeps its config; these differ: {'; '.join(other)} "
                "(start a new run instead)"
            )
        found = self.checkpoints()
        if diff and found and wanted.federation.rounds < found[-1][0]:
            raise NestfedError(
                f"{self.config_path}: federation.rounds = {wanted.federation.rounds} is below the "
                f"{found[-1][0]} rounds already committed"
            )
        if diff:
            atomic.write_text(self.config_path, config_text)
        return diff

    # -- exports and the summary ---------------------------------------------------------------
    def write_adapter(
        self, arrays: Arrays, scaling: float, base_model: str = "", lora_dropout: float = 0.0, quantization=None
    ) -> Path:
        """The PEFT adapter directory ``adapter/`` (nestfed.nn.peft_export), atomically."""
        return export_peft_adapter(arrays, scaling, self.path / "adapter", base_model, lora_dropout, quantization)

    def write_tensors(self, name: str, arrays: Arrays) -> Path:
        """``<name>`` (a safetensors file in the run directory), atomically."""
        return atomic.write_tensors(self.path / name, arrays)

    def write_json(self, name: str, obj: Any) -> Path:
        """``<name>`` as indented JSON, atomically."""
        return atomic.write_json(self.path / name, obj)

    def write_plots(self, lines: list[dict[str, Any]], ranks: dict[str, int] | None = None) -> list[Path]:
        """plots/ (nestfed.federation.plots: per client, or by rank group with many clients),
        atomically."""
        return [
            atomic.write_bytes(self.path / "plots" / name, data)
            for name, data in run_plots(lines, self.path.name, ranks).items()
        ]

    def write_clients(self, rows: list[dict[str, Any]], per_client: dict[str, Any] | None = None) -> list[Path]:
        """``clients.csv`` (one row per client, :func:`nestfed.federation.summary.client_table`) and,
        when the per-client numbers have their own file, ``clients.json`` (the rows plus
        ``per_client``: further per-client maps such as the truncation curve), atomically."""
        buf = io.StringIO()
        cols = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        out = [atomic.write_text(self.path / "clients.csv", buf.getvalue())]
        if not self.inline:
            out.append(atomic.write_json(self.path / "clients.json", {"clients": rows, **(per_client or {})}))
        return out

    def fail(self, cfg: ExperimentConfig, failure: str, failed_round: int, extra: dict[str, Any]) -> dict[str, Any]:
        """Finalise a run that stopped (nestfed.errors.RunFailed): summary.json with the committed
        rounds' summary (nestfed.federation.summary.failed_summary); no adapter, plots or per-client
        table. Returns the summary."""
        summary = failed_summary(self.read_rounds(), cfg, failure, failed_round, extra, str(self.path))
        self.write_json("summary.json", summary)
        return summary

    def finish(
        self,
        cfg: ExperimentConfig,
        exports: Exports,
        extra: dict[str, Any],
        roster: dict[str, dict[str, Any]] | None = None,
        per_client: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Finalise a run whose rounds are all committed: the adapter (only when some round
        aggregated: a run that never aggregated has no adapter PEFT could load), the method's
        files, the plots (``output.plots``), the per-client table, then summary.json (last, built
        by nestfed.federation.summary.completed_summary). Returns the summary.

        roster: {cid: {rank, label, num_examples[, memory_mib]}} of every client (the per-client
        table and the rank groups); per_client: further per-client maps ({name: {cid: ...}}, e.g.
        the truncation curve), kept in summary.json while the per-client numbers stay in the metrics
        lines, else in clients.json.
        """
        lines = self.read_rounds()
        summary = summarise(lines, cfg)
        adapter = self._export(cfg, exports, summary["aggregated_rounds"] > 0)
        ranks = roster_ranks(roster or {})
        if cfg.output.plots:
            self.write_plots(lines, ranks or None)
        if roster:
            self.write_clients(roster_table(lines, roster), per_client)
        completed_summary(
            summary,
            cfg,
            adapter=adapter,
            extra=extra,
            roster=roster or {},
            per_client=per_client or {},
            inline=self.inline,
            method_fields=exports.summary,
            run_dir=str(self.path),
        )
        self.write_json("summary.json", summary)
        return summary

    def _export(self, cfg: ExperimentConfig, exports: Exports, aggregated: bool) -> str | None:
        """Write the final adapter (when some round ``aggregated``; a warning when one was given but
        none did) and the method's files; return the adapter's directory name, or None."""
        arrays, scale = exports.adapter or ({}, 1.0)
        adapter = None
        if arrays and aggregated:
            self.write_adapter(arrays, scale, exports.base_model, cfg.lora.lora_dropout, bnb_config(cfg.model))
            adapter = "adapter"
        elif arrays:
            log.warning("%s: no round aggregated, so no adapter is exported", self.path)
        for name, tensors in exports.files.items():
            self.write_tensors(name, tensors)
        return adapter
