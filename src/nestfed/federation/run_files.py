"""A run directory's files one by one: their names, the metrics lines, the checkpoints.

``RunFiles`` reads and writes them; nestfed.federation.run_dir.RunDir, built on it, creates,
commits, resumes and finishes a run (its module docstring shows the layout).

A checkpoint, ``checkpoints/round_NNN.safetensors``, is one safetensors file holding, as one unit:

- ``global/<key>``: the global state's arrays after the round;
- ``optimizer/<key>``: the server optimiser's state (GlobalState.optimizer; none under the default
  optimiser, so those checkpoints are unchanged);
- ``client/<cid>/<group>/<key>``: every client's kept state (FedALA's weights, FedNL's own LoRA),
  when the checkpoint keeps it (``KEPT``); Flower's nodes keep their own (``ON_NODES``).

Its metadata: the format, the round, the state's meta (JSON), where the clients' state lives, the
arrays' order (safetensors sorts its keys; a resume gets the run's order back, so sums over them
are the same) and the resolved config with its SHA-256 (what a resume checks config.toml against).
The earlier format kept the clients' state in ``clients_NNN.safetensors`` beside it; it still reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from nestfed.errors import DataError
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.io import atomic

log = logging.getLogger("nestfed")

FORMAT = "nestfed-checkpoint/2"
KEPT, ON_NODES = "kept", "on-nodes"
_ROUND_FILE = re.compile(r"round_(\d+)\.safetensors")

ClientState = dict[int, dict[str, Arrays]]


def flatten_client_state(state: ClientState) -> dict[str, torch.Tensor]:
    """Flatten the clients' kept state for one safetensors file or record.

    Args:
        state: {cid: {group: {key: tensor}}}.

    Returns:
        {"<cid>/<group>/<key>": tensor}, each tensor contiguous.
    """
    return {
        f"{cid}/{g}/{k}": t.contiguous()
        for cid, groups in state.items()
        for g, arrays in groups.items()
        for k, t in arrays.items()
    }


def unflatten_client_state(flat: dict[str, torch.Tensor]) -> ClientState:
    """Inverse of ``flatten_client_state``.

    Args:
        flat: {"<cid>/<group>/<key>": tensor}.

    Returns:
        {cid: {group: {key: tensor}}}.

    Raises:
        ValueError: for a malformed key.
    """
    out: ClientState = {}
    for name, t in flat.items():
        parts = name.split("/", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1]:
            raise ValueError(f"client state key '{name}' is not <cid>/<group>/<payload key>")
        out.setdefault(int(parts[0]), {}).setdefault(parts[1], {})[parts[2]] = t
    return out


@dataclass
class Checkpoint:
    """A round's committed state.

    Attributes:
        round: the round (0 = before training).
        state: the global state after it.
        client_state: the clients' kept state; None when the clients keep it themselves, as Flower
            nodes do.
        path: the checkpoint's file.
        client_state_home: where the clients' kept state lives: ``KEPT`` (in this checkpoint, the
            default) or ``ON_NODES`` (on the nodes).
    """

    round: int
    state: GlobalState
    client_state: ClientState | None
    path: Path
    client_state_home: str = KEPT


class RunFiles:
    """A run directory's files, read and written one by one (the module docstring).

    Args:
        path: the directory.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_text: str | None = None  # the resolved config its checkpoints record

    def recorded_config(self) -> tuple[dict[str, Any], Path] | None:
        """The resolved config the latest checkpoint recorded.

        Returns:
            (the parsed TOML, the checkpoint's path); None without a checkpoint, or for one
            written before checkpoints recorded it.

        Raises:
            DataError: for an unreadable checkpoint.
        """
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
        """Read the metrics lines.

        A torn last line (no newline, not JSON: a crash mid-append) is skipped with a warning.

        Returns:
            The lines in file order.

        Raises:
            DataError: for a missing file or a malformed line elsewhere.
        """
        lines, torn = self._read_lines()
        if torn:
            log.warning("%s: skipped a torn last line: an append was interrupted", self.metrics_path)
        return lines

    def read_rounds(self) -> list[dict[str, Any]]:
        """Read the metrics lines as the round loop made them, whatever the layout.

        Returns:
            The lines, each round's per-client numbers put back from clients.jsonl.

        Raises:
            DataError: as ``read_metrics``, and for a committed round whose per-client line is missing.
        """
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
        """Append one metrics line, durably (fsync).

        Args:
            line: the line, JSON-serialisable.
        """
        atomic.append_line(self.metrics_path, json.dumps(line))

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_path(self, rnd: int) -> Path:
        """Name a round's checkpoint.

        Args:
            rnd: the round.

        Returns:
            ``checkpoints/round_NNN.safetensors`` (at least three digits).
        """
        return self.path / "checkpoints" / f"round_{rnd:03d}.safetensors"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """List the checkpoints.

        Returns:
            Every checkpoint as (round, path), sorted by round number (not by name).
        """
        folder = self.path / "checkpoints"
        found = (
            [(int(m.group(1)), p) for p in folder.glob("round_*.safetensors") if (m := _ROUND_FILE.fullmatch(p.name))]
            if folder.is_dir()
            else []
        )
        return sorted(found)

    def save_checkpoint(self, rnd: int, state: GlobalState, client_state: ClientState | None) -> Path:
        """Write a round's global state and the clients' kept state as one safetensors file, atomically.

        Its keys and metadata: the module docstring; the config recorded is ``config_text``.

        Args:
            rnd: the round.
            state: the global state after it.
            client_state: the clients' kept state; None when kept on the clients.

        Returns:
            The checkpoint's path.
        """
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

        Args:
            path: the checkpoint's file.

        Returns:
            The checkpoint.

        Raises:
            DataError: naming the file, when it is unreadable or corrupted.
        """
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
