"""FedNL's options: section ``[fednl]``, what travels and the delta-rule memory layer
(nestfed.nn.memory, docs/methods.md section 3). Torch-free: read at config load."""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.nn.gates import GATES

TRAVEL = ("all", "rules", "none")


@dataclass(frozen=True)
class FedNLOptions:
    """travel: what crosses the wire, ``all`` (LoRA on q, k, v plus the memory rules) or ``rules``
    (only the memory rules: beta's projection and the gate; each client keeps its LoRA) or ``none``
    (the local-only baseline: each client keeps its LoRA and its rules, nothing is aggregated, so
    the federated model and the client's own are the same and the aggregation drop is zero by
    construction).

    The memory layer: layers: decoder layers that get a memory (empty = the LoRA layers,
    ``lora.layers``). gate: constant | learned | dynamic. alpha_init: the gate's start (learned,
    dynamic). alpha_start / alpha_end / alpha_warmup_steps: the constant gate's schedule over local
    steps. window: the softmax path's sliding window in tokens (0 = none). beta_window: tokens in
    beta's causal average of k. dynamic_kernel: the dynamic gate's Conv1d width. chunk_size: tokens
    per chunk of the chunkwise delta rule. sink_tokens: attention sinks, the first tokens every
    windowed query keeps seeing (StreamingLLM; 0 = none).
    """

    travel: str = "all"
    layers: tuple[int, ...] = ()
    gate: str = "learned"
    alpha_init: float = 0.05
    alpha_start: float = 0.01
    alpha_end: float = 0.5
    alpha_warmup_steps: int = 10
    window: int = 0
    beta_window: int = 4
    dynamic_kernel: int = 16
    chunk_size: int = 32
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if self.travel not in TRAVEL:
            raise ValueError(f"travel must be 'all', 'rules' or 'none', got '{self.travel}'")
        if self.gate not in GATES:
            raise ValueError(f"gate: unknown gate '{self.gate}' (known: {', '.join(GATES)})")
        for key in ("alpha_init", "alpha_start", "alpha_end"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} must be in [0, 1]")
        for key in ("window", "sink_tokens", "alpha_warmup_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        for key in ("beta_window", "dynamic_kernel", "chunk_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
