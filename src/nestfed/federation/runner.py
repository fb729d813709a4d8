"""The embedded runner: the one round loop, in process, clients one after another.

Per round: sample clients (fraction, seeded by round) -> ``strategy.configure`` -> payload out
(serialised, bytes counted) -> ``trainer.fit`` -> payload back (serialised, bytes counted,
validated; a bad update is rejected with its reason and never reaches the global model) ->
``strategy.aggregate`` -> checkpoint (atomic) -> evaluation -> one metrics line.

Every random choice derives from (seed, round, client), so a run resumed from the checkpoint of
round t reaches the same final state as an uninterrupted run (exactly, on the same CPU and
thread count).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from nestfed.errors import UpdateRejected
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply
from nestfed.federation.payload import decode, encode, payload_stats, validate_reply
from nestfed.federation.strategy import Strategy


class Trainer(Protocol):
    """What the runner needs from the client side."""

    def fit(self, cid: int, instruction: Instruction) -> Reply: ...

    def evaluate(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]: ...


def sample_clients(clients: list[ClientInfo], fraction: float, seed: int, rnd: int) -> list[ClientInfo]:
    """Seeded client sampling: max(1, round(fraction * K)) clients without replacement, sorted by id."""
    k = max(1, round(fraction * len(clients)))
    if k >= len(clients):
        return list(clients)
    rng = np.random.default_rng([seed, rnd])
    chosen = sorted(rng.choice(len(clients), size=k, replace=False).tolist())
    return [clients[i] for i in chosen]


def save_tensors_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` ({name: tensor}, any shapes) to the safetensors file ``path`` with string
    ``metadata`` via a temporary file in the same folder and a rename: ``path`` is never
    half-written. Raises what writing raises (OSError, safetensors' errors), after removing the
    temporary file; an existing ``path`` is then left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: Path, rnd: int, state: GlobalState) -> None:
    """Write the global state after round ``rnd`` to ``path`` (safetensors + JSON metadata), atomically."""
    save_tensors_atomic(state.arrays, path, {"round": str(rnd), "meta": json.dumps(state.meta)})


def load_checkpoint(path: Path) -> tuple[int, GlobalState]:
    """Read a checkpoint written by :func:`save_checkpoint`: (round, state)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        md = f.metadata()
    return int(md["round"]), GlobalState(load_file(str(path)), json.loads(md["meta"]))


def client_state_path(ckpt: Path) -> Path:
    """Where the clients' kept state of a checkpoint lives: ``clients_NNN.safetensors`` beside
    ``round_NNN.safetensors`` (written only when some client keeps state)."""
    return ckpt.with_name(ckpt.name.replace("round_", "clients_", 1))


def save_client_state(trainer: Any, ckpt: Path) -> None:
    """Save ``trainer.client_state`` (FedALA's weights and local model, FedNL's kept LoRA) beside
    the checkpoint ``ckpt``, atomically; nothing when the trainer keeps no state."""
    from nestfed.federation.client_state import flatten_state

    state = getattr(trainer, "client_state", None)
    if not state:
        return
    save_tensors_atomic(flatten_state(state), client_state_path(ckpt))


def load_client_state(trainer: Any, ckpt: Path) -> None:
    """Restore ``trainer.client_state`` from beside ``ckpt`` (left empty when there is no file)."""
    from nestfed.federation.client_state import unflatten_state

    path = client_state_path(ckpt)
    if path.is_file() and hasattr(trainer, "client_state"):
        trainer.client_state = unflatten_state(load_file(str(path)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint of the highest round in ``run_dir/checkpoints`` (None when there is none)."""
    files = sorted((run_dir / "checkpoints").glob("round_*.safetensors"))
    return files[-1] if files else None


@dataclass
class RoundLoop:
    """Drive ``strategy`` and ``trainer`` for ``rounds`` rounds, writing into ``run_dir``.

    min_clients: the fewest accepted updates a round needs to aggregate (else the global state
    is kept). on_event(kind, info): progress hook (``client_done``, ``round_done``).
    """

    strategy: Strategy
    trainer: Trainer
    clients: list[ClientInfo]
    rounds: int
    run_dir: Path
    fraction: float = 1.0
    min_clients: int = 1
    seed: int = 0
    keep_checkpoints: bool = True
    on_event: Callable[[str, dict[str, Any]], None] | None = None
    log: list[str] = field(default_factory=list)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _emit(self, kind: str, **info: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, info)

    def _write_metrics(self, line: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _evaluate(self, state: GlobalState | None) -> dict[str, dict[str, float]]:
        out = {}
        for c in self.clients:
            if state is None:  # round 0: the backbone alone
                arrays, scale = {}, 1.0
            else:
                arrays, scale = self.strategy.deploy(state, c.cid)
            out[str(c.cid)] = self.trainer.evaluate(c.cid, arrays, scale)
        return out

    def run(self, shapes: dict[str, tuple[int, int]], resume: bool = False) -> GlobalState:
        """Run (or resume) the federation; return the final global state.

        With ``resume``, start after the latest checkpoint in run_dir and drop metrics lines of
        rounds after it. Raises RuntimeError when resuming without a checkpoint.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start = 1
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise RuntimeError(f"{self.run_dir}: no checkpoint to resume from")
            done, state = load_checkpoint(ckpt)
            load_client_state(self.trainer, ckpt)
            start = done + 1
            self._truncate_metrics(done)
        else:
            state = self.strategy.initialize(shapes, self.clients)
            if self.metrics_path.exists():
                self.metrics_path.unlink()
            self._write_metrics({"round": 0, "eval": self._evaluate(None)})
        for rnd in range(start, self.rounds + 1):
            state = self.run_round(rnd, state)
        return state

    def _truncate_metrics(self, last_round: int) -> None:
        if not self.metrics_path.exists():
            return
        keep = [ln for ln in self.metrics_path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["round"] <= last_round]
        self.metrics_path.write_text("".join(ln + "\n" for ln in keep))

    def run_round(self, rnd: int, state: GlobalState) -> GlobalState:
        """One round: configure, fit, validate, aggregate, checkpoint, evaluate, log."""
        t0 = time.perf_counter()
        sampled = sample_clients(self.clients, self.fraction, self.seed, rnd)
        instructions = self.strategy.configure(rnd, state, sampled)
        accepted: dict[int, Reply] = {}
        per_client: dict[str, dict[str, Any]] = {}
        rejected: dict[str, str] = {}
        for cid, ins in instructions.items():
            down = payload_stats(ins.arrays)
            sent = Instruction(decode(encode(ins.arrays)), dict(ins.config))  # what crosses the wire
            reply = self.trainer.fit(cid, sent)
            up = payload_stats(reply.arrays)
            reply = Reply(decode(encode(reply.arrays)), reply.num_examples, reply.metrics)
            info: dict[str, Any] = {"bytes_down": down["bytes"], "params_down": down["params"],
                                    "dtypes_down": down["dtypes"], "bytes_up": up["bytes"],
                                    "params_up": up["params"], "dtypes_up": up["dtypes"],
                                    "rank_sent": ins.config.get("rank"), "num_examples": reply.num_examples}
            try:
                validate_reply(ins, reply)
                accepted[cid] = reply
                info["status"] = "accepted"
            except UpdateRejected as exc:
                rejected[str(cid)] = str(exc)
                info["status"] = "rejected"
                self.log.append(f"round {rnd}: client {cid} update rejected: {exc}")
            info.update({k: v for k, v in reply.metrics.items() if isinstance(v, (int, float))})
            per_client[str(cid)] = info
            self._emit("client_done", round=rnd, cid=cid, status=info["status"])
        aggregated = len(accepted) >= self.min_clients
        if aggregated:
            state = self.strategy.aggregate(rnd, state, accepted)
        else:
            self.log.append(f"round {rnd}: {len(accepted)} accepted updates < min_clients "
                            f"{self.min_clients}; global state kept")
        ckpt = self.run_dir / "checkpoints" / f"round_{rnd:03d}.safetensors"
        save_checkpoint(ckpt, rnd, state)
        save_client_state(self.trainer, ckpt)
        if not self.keep_checkpoints:
            for old in (self.run_dir / "checkpoints").glob("round_*.safetensors"):
                if old != ckpt:
                    old.unlink()
                    client_state_path(old).unlink(missing_ok=True)
        evaluation = self._evaluate(state)
        line = {"round": rnd, "sampled": [c.cid for c in sampled], "aggregated": aggregated,
                "clients": per_client, "rejected": rejected, "eval": evaluation,
                "bytes_down": sum(c["bytes_down"] for c in per_client.values()),
                "bytes_up": sum(c["bytes_up"] for c in per_client.values()),
                "time_s": time.perf_counter() - t0}
        self._write_metrics(line)
        self._emit("round_done", round=rnd, line=line)
        return state
