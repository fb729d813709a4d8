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
from nestfed.strategies.fedala import FedALA
from nestfed.strategies.fednl import FedNL
from nestfed.strategies.fedprox import FedProx
from nestfed.strategies.fedssi import FedSSI

REGISTRY: dict[str, type[LoraStrategy]] = {
    cls.name: cls for cls in (FedAvg, ZeroPad, HetLoRA, FLoRA, FFALoRA, PreLort)
}
REGISTRY.update({cls.name: cls for cls in (FedNL, FedProx, FedALA, FedSSI)})


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
    options.update(_fednl_and_baseline_options(cfg))
    return REGISTRY[st.name](settings, options)


def _fednl_and_baseline_options(cfg: ExperimentConfig) -> dict:
    """Options of FedNL (its memory-rule initial arrays are added by the experiment, which owns
    the model: ``options["memory_init"]``), FedProx, FedALA and FedSSI from the config."""
    st, m = cfg.strategy, cfg.memory
    if st.name == "fednl":
        return {"travel": st.fednl_travel, "gate": m.gate, "alpha_start": m.alpha_start, "alpha_end": m.alpha_end,
                "alpha_warmup_steps": m.alpha_warmup_steps, "local_steps": cfg.train.local_steps}
    if st.name == "fedprox":
        return {"mu": st.fedprox_mu}
    if st.name == "fedala":
        return {"layers": st.fedala_layers, "steps": st.fedala_steps, "eta": st.fedala_eta}
    if st.name == "fedssi":
        return {"c": st.fedssi_c, "lambda": st.fedssi_lambda, "psm_steps": st.fedssi_psm_steps, "xi": st.fedssi_xi}
    return {}
