"""What a client keeps between rounds, on its SuperNode's disk, so a Flower run resumes exactly.

FedALA's weights and local model, FedSA-LoRA's own B, local-only's adapter and FedNL's own LoRA
(rules-only travel) are a client's kept state (``ClientTrainer.client_state``). A node keeps it as
one safetensors file per client and round, written atomically (nestfed.io.atomic)::

    <root>/<run key>/client-<cid>/round-<t>.safetensors

``run key``: the first 16 hex digits of the SHA-256 of the server's run directory (its resolved
path, sent with every message), so two runs never share a state and a resumed run finds its own
(resume with the same ``run-dir``: a relative one resolves against the ServerApp's working
directory, and a resume from another one finds no state, which ``client_state_round = -1`` shows);
``<root>/<run key>/run.txt`` names that directory. ``root`` is the node config's ``client-state``
(default ``~/.cache/nestfed/client-state``, ``$XDG_CACHE_HOME`` respected).

A TRAIN of round t restores the newest file of a round before t and, once trained, writes round
t; an EVALUATE after round t restores the newest of a round up to t. Writing round t removes every
file older than the newest one before t: checkpoints are written every round, so a resumed server
redoes at most round t, which starts from that file (and overwrites round t's file with the same
state). A method whose clients keep nothing writes nothing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from nestfed.errors import DataError
from nestfed.federation.run_files import ClientState, flatten_client_state, unflatten_client_state
from nestfed.io import atomic

_ROUND_FILE = re.compile(r"round-(\d+)\.safetensors")


def run_key(run_dir: str) -> str:
    """The 16-hex-digit key of a run directory.

    Args:
        run_dir: the run directory's path as the server resolved it.

    Returns:
        The first 16 hex digits of the path's SHA-256.
    """
    return hashlib.sha256(run_dir.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NodeStateStore:
    """The kept client state of the runs a node serves (see the module docstring).

    Attributes:
        root: the folder holding one ``<run key>`` folder per run (node config ``client-state``).
    """

    root: Path

    def folder(self, run_dir: str, cid: int) -> Path:
        """The folder of one client's state files in one run.

        Args:
            run_dir: the server's run directory (resolved path).
            cid: the client id.

        Returns:
            ``<root>/<run key>/client-<cid>``.
        """
        return self.root / run_key(run_dir) / f"client-{cid}"

    def rounds(self, run_dir: str, cid: int) -> list[tuple[int, Path]]:
        """The files of this client's kept state.

        Args:
            run_dir: the server's run directory (resolved path).
            cid: the client id.

        Returns:
            ``[(round, file)]``, oldest first; empty when the client keeps nothing.
        """
        folder = self.folder(run_dir, cid)
        found = (
            [(int(m.group(1)), p) for p in folder.glob("round-*.safetensors") if (m := _ROUND_FILE.fullmatch(p.name))]
            if folder.is_dir()
            else []
        )
        return sorted(found)

    def load(self, run_dir: str, cid: int, up_to: int) -> tuple[int | None, ClientState]:
        """The newest kept state of a round <= ``up_to``.

        Args:
            run_dir: the server's run directory (resolved path).
            cid: the client id.
            up_to: the last round whose state may be restored.

        Returns:
            The round it was written in and the state ``{cid: {group: {key: tensor}}}``; (None, {})
            when there is none (a client's first round).

        Raises:
            DataError: when the file is unreadable or holds another client's state (it names the file).
        """
        older = [(r, p) for r, p in self.rounds(run_dir, cid) if r <= up_to]
        if not older:
            return None, {}
        rnd, path = older[-1]
        try:
            state = unflatten_client_state(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise DataError(f"{path}: not a readable client-state file ({type(exc).__name__}: {exc})") from None
        if set(state) - {cid}:
            raise DataError(f"{path}: holds the state of clients {sorted(state)}, not of client {cid}")
        return rnd, state

    def save(self, run_dir: str, cid: int, rnd: int, state: ClientState) -> Path | None:
        """Write client ``cid``'s state after round ``rnd``, then prune (see the module docstring).

        Args:
            run_dir: the server's run directory (resolved path); the first save names it in ``run.txt``.
            cid: the client id.
            rnd: the round just trained.
            state: the trainer's kept state ``{cid: {group: {key: tensor}}}``; only ``cid``'s is written.

        Returns:
            The file written, or None when the client keeps nothing.
        """
        flat = flatten_client_state({cid: state.get(cid, {})})
        if not flat:
            return None
        marker = self.root / run_key(run_dir) / "run.txt"
        if not marker.is_file():
            atomic.write_text(marker, run_dir + "\n")
        path = atomic.write_tensors(
            self.folder(run_dir, cid) / f"round-{rnd:06d}.safetensors", flat, {"round": str(rnd), "client": str(cid)}
        )
        before = [p for r, p in self.rounds(run_dir, cid) if r < rnd]
        for p in before[:-1]:
            p.unlink(missing_ok=True)
        return path


__all__ = ["NodeStateStore", "run_key"]
