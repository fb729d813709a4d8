"""The federated methods, one module each, and :func:`make_strategy` to build one from a config."""

from __future__ import annotations

from nestfed.config import ExperimentConfig, r_max
from nestfed.federation.strategy import LoraSettings, LoraStrategy
from nestfed.strategies.fedavg import FedAvg
from nestfed.strategies.ffa_lora import FFALoRA
from nestfed.strategies.flora import FLoRA
from nestfed.strategies.hetlora import HetLoRA
from nestfed.strategies.prelort import PreLort
from nestfed.strategies.zeropad import ZeroPad

REGISTRY: dict[str, type[LoraStrategy]] = {
    cls.name: cls for cls in (FedAvg, ZeroPad, HetLoRA, FLoRA, FFALoRA, PreLort)
}


def make_strategy(cfg: ExperimentConfig) -> LoraStrategy:
    """Build the strategy named by ``cfg.strategy.name`` with the run's LoRA settings.

    Raises KeyError for an unknown name (config validation catches it first).
    """
    st = cfg.strategy
    settings = LoraSettings(r_max=r_max(cfg), lora_alpha=cfg.lora.lora_alpha, scaling=cfg.lora.scaling,
                            init_seed=cfg.lora.init_seed, seed=cfg.federation.seed)
    options = {}
    if st.name == "hetlora":
        options = {"reg": st.hetlora_reg, "tail": st.hetlora_tail, "prune_ratio": st.hetlora_prune_ratio,
                   "weighting": st.hetlora_weighting, "pruning": st.hetlora_pruning}
    return REGISTRY[st.name](settings, options)
