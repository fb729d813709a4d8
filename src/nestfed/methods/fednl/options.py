"""FedNL's options: section ``[fednl]``, what travels, the delta-rule memory layer (nestfed.nn.memory,
docs/methods.md section 3), how its rules train, and the server's memory warm-up. Torch-free: read
at config load."""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.nn.gates import BETA_SOURCES, GATE_SCOPES, GATES

TRAVEL = ("all", "rules", "none")
DROPOUT_SCOPES = ("steps", "heads")
WARMUP_CORPORA = ("wikipedia", "austen", "all")


@dataclass(frozen=True)
class FedNLOptions:
    """Options of ``[fednl]``: what travels, the memory layer, how its rules train, the server's warm-up.

    The memory layer's settings are nestfed.nn.memory.MemorySettings', whose docstring gives each
    choice's source. The rules train on a client in their own AdamW group (``rule_lr``, no weight
    decay) beside LoRA's ``train.lr``: Adam moves a parameter by about its lr per step, so a gate at
    the LoRA's 1e-3 would move its logit by at most 0.024 in 24 steps. The server's memory warm-up
    (attention transfer, LoLCATs' first stage; nestfed.methods.fednl.warmup), before round 1, fits
    every memory layer's rules so that the layer, with its memory and its window, outputs what the
    full-attention layer outputs (MSE) on public rows.

    Attributes:
        travel: what crosses the wire: ``all`` (LoRA on q, k, v plus the memory rules), ``rules``
            (only the memory rules; each client keeps its LoRA) or ``none`` (the local-only
            baseline: each client keeps its LoRA and its rules, nothing is aggregated, so the
            federated model and the client's own are the same and the aggregation drop is zero by
            construction).
        layers: decoder layers that get a memory (empty = the LoRA layers, ``lora.layers``).
        gate: ``constant``, ``learned`` or ``dynamic``.
        gate_scope: ``head`` or ``layer``.
        alpha_init: the gate's start, in [0, 1] (learned, dynamic; 0.5, where the references start
            theirs).
        alpha_start: the constant gate's alpha at the run's first local step, in [0, 1].
        alpha_end: the constant gate's alpha from ``alpha_warmup_steps`` local steps on, in [0, 1].
        alpha_warmup_steps: local steps of the run over which the constant gate goes linearly from
            ``alpha_start`` to ``alpha_end`` (>= 0; 0 = ``alpha_end`` from the start).
        window: the softmax path's sliding window in tokens (0 = none).
        sink_tokens: attention sinks (StreamingLLM; 0 = none).
        beta_source: ``hidden`` or ``keys``.
        beta_window: tokens in the keys source's causal average (>= 1).
        conv_size: taps of the short causal convolution on q, k, v (0 = none).
        norm_weight: a learned per-head weight on the read.
        output_gate: a per-head output gate.
        dynamic_kernel: the dynamic gate's Conv1d width (>= 1).
        chunk_size: tokens per chunk of the chunkwise delta rule (>= 1).
        rule_lr: AdamW learning rate of every memory parameter (the gate, beta, the convolution, the
            norm and output gate) on the clients (> 0).
        window_dropout: the fraction of local steps (``window_dropout_scope = "steps"``: every
            memory head at once) or of heads per step (``"heads"``) whose softmax output is
            suppressed, so that the memory has to carry (Scheduled Sliding-window Dropout, arXiv
            2510.05901), in [0, 1); 0 = none. Never at evaluation.
        window_dropout_scope: ``steps`` or ``heads`` (``window_dropout``).
        warmup_steps: AdamW steps of the server's memory warm-up before round 1 (0 = none).
        warmup_lr: the warm-up's learning rate (> 0).
        warmup_rows: public rows the warm-up fits on (>= 1).
        warmup_length: tokens per warm-up row (>= 16).
        warmup_batch: warm-up rows per step (>= 1).
        warmup_corpus: where the warm-up's rows come from: ``wikipedia``, ``austen`` or ``all``.

    Raises:
        ValueError: naming the field for an unknown choice or a value out of range.
    """

    travel: str = "all"
    layers: tuple[int, ...] = ()
    gate: str = "learned"
    gate_scope: str = "head"
    alpha_init: float = 0.5
    alpha_start: float = 0.01
    alpha_end: float = 0.5
    alpha_warmup_steps: int = 10
    window: int = 0
    sink_tokens: int = 0
    beta_source: str = "hidden"
    beta_window: int = 4
    conv_size: int = 4
    norm_weight: bool = True
    output_gate: bool = False
    dynamic_kernel: int = 16
    chunk_size: int = 32
    rule_lr: float = 1e-2
    window_dropout: float = 0.0
    window_dropout_scope: str = "steps"
    warmup_steps: int = 0
    warmup_lr: float = 1e-2
    warmup_rows: int = 32
    warmup_length: int = 256
    warmup_batch: int = 4
    warmup_corpus: str = "all"

    def __post_init__(self) -> None:
        for key, known in (
            ("travel", TRAVEL),
            ("gate", GATES),
            ("gate_scope", GATE_SCOPES),
            ("beta_source", BETA_SOURCES),
            ("window_dropout_scope", DROPOUT_SCOPES),
            ("warmup_corpus", WARMUP_CORPORA),
        ):
            if getattr(self, key) not in known:
                raise ValueError(f"{key}: unknown value '{getattr(self, key)}' (known: {', '.join(known)})")
        for key in ("alpha_init", "alpha_start", "alpha_end"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} must be in [0, 1]")
        if not 0 <= self.window_dropout < 1:
            raise ValueError(f"window_dropout must be in [0, 1), got {self.window_dropout}")
        for key in ("window", "sink_tokens", "alpha_warmup_steps", "conv_size", "warmup_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        for key in ("beta_window", "dynamic_kernel", "chunk_size", "warmup_rows", "warmup_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup_length < 16:
            raise ValueError(f"warmup_length must be >= 16 tokens, got {self.warmup_length}")
        for key in ("rule_lr", "warmup_lr"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
