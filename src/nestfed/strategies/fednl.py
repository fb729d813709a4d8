"""FedNL (Federated Nested Learning, arXiv 2605.16350, sections 3-4): the server averages the
rules that build each client's memory, never the memory itself.

theta = LoRA on q, k, v + every memory layer's beta projection and gate (adapters/memory.py).
Level 0 (this class): FedAvg of theta weighted by n_k. Level 1 (the client): theta trained by
backpropagation through the memory trajectory (the chunkwise delta rule) with the causal-LM
loss. Level 2 (inference): S_t updated online by the delta rule; it never leaves the client.

``travel`` chooses what crosses the wire, so that both of the paper's communication accounts
can be measured (section 4.4): ``all`` -- LoRA and the rules; ``rules`` -- only the memory
rules (beta projections and gates), each client keeping its own LoRA (initialised from the
run's LoRA seed, as the global adapter would be; federation/client_state.py).

The constant gate (methods.md section 3: "scheduled from 0.01 to 0.5 over the first steps")
is set per local step on the client from ``alpha_schedule``; the global state carries the
schedule's value at the end of the last round, which the deployed model runs with.
"""

from __future__ import annotations

from typing import Any

import torch

from nestfed.adapters.memory import alpha_schedule, is_constant_alpha_key, is_memory_key
from nestfed.federation.aggregation import rank_dim, weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples

TRAVEL = ("all", "rules")


class FedNL(LoraStrategy):
    """Options: ``travel`` (all | rules), ``memory_init`` (the memory rules' starting arrays,
    payload-keyed, from :func:`nestfed.adapters.memory.memory_arrays`), ``gate``, ``alpha_start``,
    ``alpha_end``, ``alpha_warmup_steps`` (the constant gate's schedule), ``local_steps``.

    Raises ValueError at :meth:`initialize` for an unknown travel mode or without memory rules.
    """

    name = "fednl"

    @property
    def travel(self) -> str:
        t = str(self.options.get("travel", "all"))
        if t not in TRAVEL:
            raise ValueError(f"fednl: unknown travel mode '{t}' (known: {', '.join(TRAVEL)})")
        return t

    def alpha_at(self, step: int) -> float:
        """The constant gate's scheduled alpha after ``step`` local steps of the run."""
        o = self.options
        return alpha_schedule(step, float(o.get("alpha_start", 0.01)), float(o.get("alpha_end", 0.5)),
                              int(o.get("alpha_warmup_steps", 10)))

    def _set_alpha(self, arrays: Arrays, step: int) -> None:
        for k in arrays:
            if is_constant_alpha_key(k):
                arrays[k] = torch.full_like(arrays[k], self.alpha_at(step))

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        travel = self.travel
        state = super().initialize(shapes, clients)
        rules = self.options.get("memory_init") or {}
        if not rules or not all(is_memory_key(k) for k in rules):
            raise ValueError("fednl: no memory rules to start from (the model needs memory layers: "
                             "adapters.memory.install_memory, configured by the [memory] section)")
        arrays = {} if travel == "rules" else dict(state.arrays)
        arrays.update({k: v.detach().clone() for k, v in sorted(rules.items())})
        self._set_alpha(arrays, 0)
        return GlobalState(arrays, {**state.meta, "travel": travel})

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.options.get("gate", "learned") == "constant":
            steps = int(self.options.get("local_steps", 1))
            o = self.options
            out["alpha_schedule"] = [float(o.get("alpha_start", 0.01)), float(o.get("alpha_end", 0.5)),
                                     int(o.get("alpha_warmup_steps", 10)), (rnd - 1) * steps]
        if self.travel == "rules":
            out.update({"keep_local": "lora", "lora_init_seed": self.s.init_seed})
        return out

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Everything sent trains and comes back (LoRA when it travels, and the rules)."""
        return sorted(sent)

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for key in sorted(state.arrays):
            new.arrays[key] = weighted_mean([replies[c].arrays[key] for c in cids], [n[c] for c in cids])
        self._set_alpha(new.arrays, rnd * int(self.options.get("local_steps", 1)))
        return new

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The LoRA part as a PEFT adapter (empty when only the rules travel: each client's LoRA
        is its own); the rules are exported by :meth:`export_rules`."""
        return ({k: v.clone() for k, v in state.arrays.items() if rank_dim(k) is not None},
                self.s.scale(self.s.r_max))

    def export_rules(self, state: GlobalState) -> Arrays:
        """The global memory rules (beta projections and gates), payload-keyed."""
        return {k: v.clone() for k, v in state.arrays.items() if is_memory_key(k)}
