"""FedNL (Federated Nested Learning, arXiv 2605.16350): the home of the method.

options.py (``[fednl]``: what travels and the memory layer), setup.py (the memory layers), hooks.py
(the client side), strategy.py (the server: FedAvg of the rules that write each client's memory).
The memory layer itself is model surgery (nestfed.nn.memory, beside the attention it is the linear
path of: nestfed.nn.bounded_attention) and the delta rule an operator (nestfed.ops.delta_rule).
"""

from __future__ import annotations

from nestfed.config import ExperimentConfig
from nestfed.config.capabilities import MEAN_AGGREGATOR
from nestfed.config.capabilities import Capability as C
from nestfed.methods.fednl.options import FedNLOptions
from nestfed.methods.method import lora_method


def _check(cfg: ExperimentConfig) -> None:
    if cfg.section("fednl").travel == "none" and (cfg.robust.rule != "mean" or cfg.privacy.mode == "central"):
        raise ValueError(
            "fednl.travel: 'none' (local-only) aggregates nothing: robust.rule and central DP do not apply"
        )
    if "o_proj" in cfg.lora.target_modules:
        raise ValueError("lora.target_modules: FedNL keeps o_proj frozen (LoRA on q_proj, k_proj, v_proj)")
    if cfg.section("fednl").gate == "constant" and not cfg.server_optimizer.identity:
        raise ValueError(
            f"server_optimizer.name: fednl cannot take a server optimiser ('{cfg.server_optimizer.name}') "
            "with fednl.gate = 'constant': the global state carries the gate's alpha, which its "
            "schedule sets each round rather than any client update; use the learned or dynamic gate"
        )


def _train_lr(stored: dict) -> float:
    """The LoRA's lr of a stored config: the rules' lr before they had their own group."""
    return float((stored.get("train") or {}).get("lr", 1e-3))


#: issue 24's memory layer and training, which a run directory written before issue 32 ran with
FORMER = {
    "fednl": {
        "gate_scope": "layer",
        "beta_source": "keys",
        "conv_size": 0,
        "norm_weight": False,
        "output_gate": False,
        "alpha_init": 0.05,
        "rule_lr": _train_lr,
        "window_dropout": 0.0,
        "window_dropout_scope": "steps",
        "warmup_steps": 0,
    }
}

METHOD = lora_method(
    "fednl",
    "a delta-rule memory beside attention; clients learn the rules that write it, the "
    "server averages the rules (arXiv 2605.16350)",
    "nestfed.methods.fednl.strategy",
    sections={"fednl": FedNLOptions},
    moved={"memory": "fednl"},
    former=FORMER,
    check_config=_check,
    capabilities=MEAN_AGGREGATOR | {C.RESUME, C.GLOBAL_MODEL},
    refusals={
        C.SECURE_AGGREGATION: "it averages memory rules beside the LoRA matrices, and secure sums hold "
        "LoRA matrices only",
        C.EXPORT_AT_RANK: "its global model includes the memory rules (memory_rules.safetensors), "
        "which a PEFT LoRA adapter cannot hold",
    },
)

__all__ = ["METHOD", "FedNLOptions"]
