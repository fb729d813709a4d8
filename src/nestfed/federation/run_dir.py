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
lines without a checkpoint; ``RunDir.resume`` drops lines after the latest checkpoint (the round
is redone and writes its lines again), and a torn last line (a crash mid-append) is dropped with a
warning. So every finished round keeps exactly one line, and a resumed run reaches the same state
as an uninterrupted one (the seed rule, nestfed.seeds). Every file is written atomically with the
user's umask (nestfed.io.atomic).
"""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestfed.config import ExperimentConfig, differences
from nestfed.errors import DataError, NestfedError
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.federation.plots import run_plots
from nestfed.federation.run_files import KEPT, ON_NODES, Checkpoint, ClientState, RunFiles
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

#: the keys of a metrics line that hold one entry per client, moved to clients.jsonl with many clients
DETAIL_KEYS = ("sampled", "clients", "eval")


def _stray(p: Path) -> bool:
    """A temporary file an interrupted atomic write left behind (nestfed.io.atomic names them
    ``.<name>-<random>.tmp``)."""
    return p.name.startswith(".") and p.name.endswith(".tmp")


def _leftover(p: Path) -> bool:
    """What a run that died before its config.toml leaves: a stray temporary file, or the empty
    ``clients.jsonl`` written first (``RunDir.create``)."""
    return _stray(p) or (p.name == "clients.jsonl" and p.is_file() and p.stat().st_size == 0)


@dataclass
class Exports:
    """What a finished run exports besides its metrics.

    Attributes:
        adapter: the PEFT arrays and their scale s; None or empty for none.
        base_model: the adapter's base_model_name_or_path; default "".
        files: {file name: arrays} written as safetensors.
        summary: the method's extra summary fields.
    """

    adapter: tuple[Arrays, float] | None = None
    base_model: str = ""
    files: dict[str, Arrays] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


class RunDir(RunFiles):
    """A run directory (see the module docstring).

    Create it with ``create`` (refuses a non-empty folder) or reopen one with ``open``; its files,
    one by one (paths, metrics lines, checkpoints), are those of
    nestfed.federation.run_files.RunFiles.

    Args:
        path: the directory.
    """

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, config_text: str, inline: bool = True) -> RunDir:
        """Create a new run directory holding ``config.toml``.

        Args:
            path: the directory; created with its parents.
            config_text: the resolved config (TOML).
            inline: keep the per-client numbers in the metrics lines; False writes an empty
                ``clients.jsonl`` first (they get their own file).

        Returns:
            The run directory.

        Raises:
            NestfedError: when ``path`` exists and is not empty (a run is never overwritten).
        """
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
        """Reopen an existing run directory.

        Args:
            path: the directory.
            config_text: the resolved config the run continues with (recorded in its later
                checkpoints); None for none.

        Returns:
            The run directory.

        Raises:
            NestfedError: when it holds no config.toml.
        """
        rd = cls(path)
        if not rd.config_path.is_file():
            raise NestfedError(f"{rd.path}: not a nestfed run directory (no config.toml)")
        rd.config_text = config_text
        return rd

    def commit(
        self,
        rnd: int,
        state: GlobalState,
        client_state: ClientState | None,
        line: dict[str, Any],
        keep_checkpoints: bool = True,
    ) -> dict[str, Any]:
        """Commit a round: its per-client line, its metrics line, then its checkpoint (the module docstring).

        Args:
            rnd: the round.
            state: the global state after it.
            client_state: the clients' kept state; None when kept on the clients.
            line: the round's metrics line; its ``DETAIL_KEYS`` go to clients.jsonl when the
                per-client numbers have their own file.
            keep_checkpoints: False removes the earlier checkpoints afterwards.

        Returns:
            The metrics line as written.
        """
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
        """Read the checkpoint of the highest round and check it for a resume.

        Args:
            keeps_client_state: the method's clients keep state between rounds.
            home: where the resuming transport's clients' kept state lives: ``KEPT`` (in the
                checkpoint, the embedded runner) or ``ON_NODES`` (on the nodes, Flower).

        Returns:
            The checkpoint.

        Raises:
            NestfedError: no checkpoint, or the method keeps per-client state and the checkpoint
                keeps it elsewhere (one written on Flower resumed embedded, or the reverse); one
                line naming the file.
            DataError: a corrupted checkpoint, naming the file.
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
        and clients.jsonl, notes): what ``resume`` does, computed without writing. Raises as
        ``resume``."""
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
        """Check what ``resume`` checks, without writing anything: call it before any work.

        Args:
            keeps_client_state: as ``resume``.
            home: as ``resume``.

        Raises:
            NestfedError: as ``resume``.
            DataError: as ``resume``.
        """
        self._resume_plan(keeps_client_state, home)

    def resume(self, keeps_client_state: bool, home: str = KEPT) -> tuple[Checkpoint | None, list[str]]:
        """Find where a resumed run continues, and repair its metrics to match.

        metrics.jsonl (and clients.jsonl) are made to hold exactly rounds 0..the checkpoint's round
        (a torn last line and the lines of later rounds dropped, rewritten atomically). A run that
        crashed before its round-0 checkpoint (only config.toml and at most the round-0 line exist)
        has no checkpoint: its metrics are emptied and it starts from round 0 again (the initial
        state is deterministic).

        Args:
            keeps_client_state: the method's clients keep state between rounds.
            home: where the resuming transport's clients' kept state lives (``latest_checkpoint``).

        Returns:
            (the latest checkpoint, or None from round 0; notes of what was repaired).

        Raises:
            NestfedError: as ``latest_checkpoint``.
            DataError: as ``latest_checkpoint``, and for a metrics file that lacks a committed round.
        """
        ck, plan, notes = self._resume_plan(keeps_client_state, home)
        for path, (keep, rewrite) in plan.items():
            if rewrite:
                atomic.write_text(path, "".join(json.dumps(ln) + "\n" for ln in keep))
        return ck, notes

    def accept_config(self, stored: ExperimentConfig, wanted: ExperimentConfig, config_text: str) -> list[str]:
        """Check a resume's config against the one the run directory holds.

        Only ``federation.rounds`` (to extend a run, never below its latest checkpoint) and the
        ``[tracking]`` sinks (a sink added later is caught up from metrics.jsonl) may change;
        config.toml is then rewritten so the directory describes what runs.

        Args:
            stored: the config the run directory holds.
            wanted: the config of the resume.
            config_text: ``wanted`` as resolved TOML, written when they differ.

        Returns:
            The changes (``section.key: old -> new``), for the run's log.

        Raises:
            NestfedError: naming any other key that differs, or rounds below those committed.
        """
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
        """Write the PEFT adapter directory ``adapter/`` (nestfed.nn.peft_export), atomically.

        Args:
            arrays: the adapter's LoRA arrays.
            scaling: its scale s.
            base_model: its base_model_name_or_path.
            lora_dropout: the dropout its config records.
            quantization: the base model's bitsandbytes config (nestfed.nn.quantization); None for none.

        Returns:
            The adapter's directory.
        """
        return export_peft_adapter(arrays, scaling, self.path / "adapter", base_model, lora_dropout, quantization)

    def write_tensors(self, name: str, arrays: Arrays) -> Path:
        """Write arrays as a safetensors file in the run directory, atomically.

        Args:
            name: the file's name.
            arrays: {key: tensor}.

        Returns:
            The file's path.
        """
        return atomic.write_tensors(self.path / name, arrays)

    def write_json(self, name: str, obj: Any) -> Path:
        """Write an object as indented JSON in the run directory, atomically.

        Args:
            name: the file's name.
            obj: the object, JSON-serialisable.

        Returns:
            The file's path.
        """
        return atomic.write_json(self.path / name, obj)

    def write_plots(self, lines: list[dict[str, Any]], ranks: dict[str, int] | None = None) -> list[Path]:
        """Write plots/ (nestfed.federation.plots), atomically.

        Args:
            lines: the metrics lines, per-client numbers included (``read_rounds``).
            ranks: {cid: r_k}, to plot by rank group with many clients; None plots per client.

        Returns:
            The PNGs' paths.
        """
        return [
            atomic.write_bytes(self.path / "plots" / name, data)
            for name, data in run_plots(lines, self.path.name, ranks).items()
        ]

    def write_clients(self, rows: list[dict[str, Any]], per_client: dict[str, Any] | None = None) -> list[Path]:
        """Write the per-client table, atomically.

        Args:
            rows: one row per client (``nestfed.federation.summary.roster_table``), as clients.csv.
            per_client: further per-client maps such as the truncation curve, written with the rows
                to clients.json when the per-client numbers have their own file; None for none.

        Returns:
            The files' paths.
        """
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
        """Finalise a run that stopped (nestfed.errors.RunFailed): summary.json, no adapter, plots or table.

        Args:
            cfg: the run's config.
            failure: why it stopped.
            failed_round: the round it stopped in.
            extra: further summary fields.

        Returns:
            The committed rounds' summary (nestfed.federation.summary.failed_summary).
        """
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
        """Finalise a run whose rounds are all committed.

        Writes the adapter (only when some round aggregated: a run that never aggregated has no
        adapter PEFT could load), the method's files, the plots (``output.plots``), the per-client
        table, then summary.json (last, built by nestfed.federation.summary.completed_summary).

        Args:
            cfg: the run's config.
            exports: the adapter and files the method exports.
            extra: further summary fields.
            roster: {cid: {rank, label, num_examples[, memory_mib]}} of every client (the
                per-client table and the rank groups); None for none.
            per_client: further per-client maps ({name: {cid: ...}}, e.g. the truncation curve),
                kept in summary.json while the per-client numbers stay in the metrics lines, else in
                clients.json; None for none.

        Returns:
            The summary.
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
