"""State a client keeps between rounds, and the local steps of methods that need it.

Kept in ``ClientTrainer.client_state[cid]``: {group: {payload key: tensor}}, saved with every
checkpoint by the runner so that a resumed run stays exact. Groups:

- ``kept``: arrays the client keeps instead of receiving them. FedNL with ``fednl_travel =
  "rules"`` (arXiv 2605.16350, section 4.4's communication account): only the memory rules
  travel, each client's LoRA on q, k, v stays on the client (initialised once from the run's
  LoRA seed, exactly like the global adapter would be).
- ``ala_weights``, ``ala_local``: FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for
  Personalized Federated Learning", AAAI 2023, section 4, eq. 5-7): the element-wise weights
  W in [0, 1] and the client's own model of its previous round; the model trained from is
  theta_local + (theta_global - theta_local) * W on the top ``fedala_layers`` decoder layers (the
  global on the others), W learned by ``fedala_steps`` gradient steps of size eta on local
  batches and clipped to [0, 1] (W starts at 1: the global model).

And, without state: FedProx's anchor (the received global theta), FedSSI's surrogate and its
parameter importance (Li et al., "Rehearsal-Free Continual Federated Learning with Synergistic
Synaptic Intelligence", ICML 2025, eq. 5-7), the constant memory gate's schedule per step.

Instruction config keys read here: ``keep_local`` ("lora"), ``lora_init_seed``, ``fedala_layers``,
``fedala_steps``, ``fedala_eta``, ``fedprox_mu``, ``fedssi_c``, ``fedssi_lambda``,
``fedssi_psm_steps``, ``fedssi_xi``, ``alpha_schedule`` ([start, end, warmup_steps, step offset]).
Keys starting with ``_`` are added on the client for its objective and never travel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nestfed.adapters.lora import init_adapter_state, lora_modules, module_of, module_shapes
from nestfed.adapters.memory import alpha_schedule, layer_of, set_constant_alpha
from nestfed.federation.aggregation import rank_dim
from nestfed.federation.messages import Arrays

if TYPE_CHECKING:  # pragma: no cover
    from nestfed.federation.client import ClientTrainer

KEPT, ALA_W, ALA_LOCAL = "kept", "ala_weights", "ala_local"
GROUPS = (KEPT, ALA_W, ALA_LOCAL)


# ----------------------------------------------------------------------------- kept arrays


def with_kept_arrays(trainer: ClientTrainer, cid: int, cfg: dict[str, Any], arrays: Arrays) -> Arrays:
    """The payload to load: the received arrays plus what the client keeps (``keep_local``).

    ``keep_local = "lora"``: the client's own LoRA (from its last round, or freshly initialised
    at rank ``cfg["rank"]`` with seed ``cfg["lora_init_seed"]``: A Kaiming-uniform, B = 0).
    Raises KeyError for an unknown ``keep_local`` value.
    """
    keep = cfg.get("keep_local")
    if not keep:
        return arrays
    if keep != "lora":
        raise KeyError(f"client {cid}: unknown keep_local '{keep}' (known: lora)")
    st = trainer.client_state.setdefault(cid, {})
    if KEPT not in st:
        st[KEPT] = init_adapter_state(module_shapes(trainer.model), int(cfg["rank"]), int(cfg.get("lora_init_seed", 0)))
    return {**arrays, **{k: v.clone() for k, v in st[KEPT].items()}}


def store_kept_arrays(trainer: ClientTrainer, cid: int, cfg: dict[str, Any], out: Arrays) -> Arrays:
    """Keep the trained LoRA on the client (``keep_local = "lora"``) and return the rest to send."""
    if cfg.get("keep_local") != "lora":
        return out
    kept = {k: v for k, v in out.items() if rank_dim(k) is not None}
    trainer.client_state.setdefault(cid, {})[KEPT] = kept
    return {k: v for k, v in out.items() if k not in kept}


# ----------------------------------------------------------------------------- FedALA


def ala_keys(arrays: Arrays, layers: int) -> list[str]:
    """LoRA keys of the top ``layers`` decoder layers that hold LoRA (FedALA's mixed part), sorted."""
    lora = [k for k in arrays if rank_dim(k) is not None and layer_of(k) is not None]
    top = sorted({layer_of(k) for k in lora}, reverse=True)[:max(layers, 0)]
    return sorted(k for k in lora if layer_of(k) in top)


def ala_mix(global_arrays: Arrays, local: Arrays, weights: Arrays) -> Arrays:
    """theta_hat = theta_local + (theta_global - theta_local) * W on the keys of ``weights``,
    theta_global elsewhere (FedALA eq. 5). Shapes of W equal those of the arrays."""
    out = dict(global_arrays)
    for k, w in weights.items():
        out[k] = torch.lerp(local[k], global_arrays[k], w)  # exact at W = 0 and W = 1
    return out


def _lora_param(model: torch.nn.Module, key: str) -> torch.nn.Parameter:
    name, kind = module_of(key)
    m = lora_modules(model)[name]
    return getattr(m, kind).weight


def adapt_local_aggregation(trainer: ClientTrainer, cid: int, cfg: dict[str, Any], arrays: Arrays) -> dict[str, float]:
    """FedALA's adaptive local aggregation, run after the global arrays are loaded.

    Learns W on ``fedala_steps`` local batches (W <- clip(W - eta * dL/dtheta_hat *
    (theta_global - theta_local), 0, 1), FedALA eq. 6) and loads theta_hat into the model. The
    first round a client takes part it has no local model yet and starts from the global one.
    Returns metrics ``ala_loss`` (mean loss over the ALA steps, nats/token; absent when skipped).
    """
    if "fedala_layers" not in cfg:
        return {}
    st = trainer.client_state.setdefault(cid, {})
    local = st.get(ALA_LOCAL)
    keys = ala_keys(arrays, int(cfg["fedala_layers"]))
    if local is None or not keys:
        return {}
    weights = st.get(ALA_W) or {k: torch.ones_like(arrays[k]) for k in keys}
    params = {k: _lora_param(trainer.model, k) for k in keys}
    eta = float(cfg.get("fedala_eta", 1.0))
    d = trainer.data[cid]
    seed = (int(cfg.get("seed", 0)) * 1_000_003 + int(cfg.get("round", 0)) * 7_919 + cid * 31 + 17) % (2**63 - 1)
    losses = []
    for p in params.values():
        p.requires_grad_(True)
    for batch in trainer._batches(d, int(cfg.get("fedala_steps", 1)), trainer.train.batch_size, seed):
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(torch.lerp(local[k], arrays[k], weights[k]))
                p.grad = None
        loss = batch.loss(trainer.model)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for k, p in params.items():
                weights[k] = (weights[k] - eta * p.grad * (arrays[k] - local[k])).clamp(0.0, 1.0)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(torch.lerp(local[k], arrays[k], weights[k]))
            p.grad = None
            p.requires_grad_(False)
    st[ALA_W] = weights
    return {"ala_loss": sum(losses) / len(losses)} if losses else {}


def store_local_model(trainer: ClientTrainer, cid: int, cfg: dict[str, Any], out: Arrays) -> None:
    """FedALA: remember the client's trained LoRA as its local model for the next round."""
    if "fedala_layers" in cfg:
        trainer.client_state.setdefault(cid, {})[ALA_LOCAL] = {k: v.clone() for k, v in out.items()
                                                              if rank_dim(k) is not None}


# ----------------------------------------------------------------------------- evaluation


def evaluation_arrays(trainer: ClientTrainer, cid: int, arrays: Arrays) -> Arrays:
    """The arrays client ``cid`` runs after a round: the deployed global arrays plus its kept
    LoRA, or mixed with its local model by its last FedALA weights. Unchanged for a client
    without state (and for round 0's empty payload)."""
    st = trainer.client_state.get(cid)
    if not st or not arrays:
        return arrays
    if KEPT in st:
        arrays = {**arrays, **st[KEPT]}
    if ALA_W in st and ALA_LOCAL in st:
        arrays = ala_mix(arrays, st[ALA_LOCAL], st[ALA_W])
    return arrays


# ----------------------------------------------------------------------------- FedProx, FedSSI


def regulariser_inputs(trainer: ClientTrainer, cid: int, cfg: dict[str, Any],
                       params: list[torch.nn.Parameter]) -> dict[str, float]:
    """Add the objective's client-side inputs to ``cfg``: ``_anchor`` = [(param, its received
    value)] for the ``prox`` and ``ssi`` objectives, and ``_importance`` = [Omega per param]
    for ``ssi`` (:func:`surrogate_importance`). Returns metrics (``psm_loss`` for FedSSI)."""
    if cfg.get("objective") not in ("prox", "ssi"):
        return {}
    anchors = [p.detach().clone() for p in params]
    cfg["_anchor"] = list(zip(params, anchors))
    if cfg["objective"] != "ssi":
        return {}
    omega, metrics = surrogate_importance(trainer, cid, cfg, params, anchors)
    cfg["_importance"] = omega
    return metrics


def surrogate_importance(trainer: ClientTrainer, cid: int, cfg: dict[str, Any], params: list[torch.nn.Parameter],
                         anchors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, float]]:
    """FedSSI's parameter importance from a personalised surrogate model (PSM).

    The surrogate starts at the global theta and takes ``fedssi_psm_steps`` AdamW steps on
    CE + q(lambda)/2 ||v - theta_global||^2 with q(lambda) = (1 - lambda) / (2 lambda) (eq. 5,
    lambda -> 1: purely local, small lambda: close to the global model). Along its path the
    synaptic-intelligence contribution s_i = sum_steps -g_i * dv_i (g the CE gradient, eq. 6)
    gives Omega_i = max(s_i, 0) / ((v_i - theta_global,i)^2 + xi) (eq. 7; Zenke et al. 2017).
    Decision: Omega is rescaled to mean 1 over all parameters (AdamW's step sizes make the raw
    magnitudes depend on the learning rate), so ``fedssi_c`` weighs a mean-one importance; with
    zero steps Omega = 1 (a plain proximal term). The parameters are restored to the anchors.
    Returns (Omega per parameter, {"psm_loss": mean CE over the surrogate steps}).
    """
    steps = int(cfg.get("fedssi_psm_steps", 0))
    if steps <= 0:
        return [torch.ones_like(a) for a in anchors], {}
    lam = float(cfg.get("fedssi_lambda", 0.5))
    q = (1.0 - lam) / (2.0 * lam)
    xi = float(cfg.get("fedssi_xi", 1e-3))
    opt = torch.optim.AdamW(params, lr=trainer.train.lr, weight_decay=0.0)
    s = [torch.zeros_like(a) for a in anchors]
    d = trainer.data[cid]
    seed = (int(cfg.get("seed", 0)) * 1_000_003 + int(cfg.get("round", 0)) * 7_919 + cid * 31 + 29) % (2**63 - 1)
    losses = []
    for batch in trainer._batches(d, steps, trainer.train.batch_size, seed):
        opt.zero_grad(set_to_none=True)
        loss = batch.loss(trainer.model)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.detach().clone() for p in params]
        before = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, a in zip(params, anchors):
                p.grad.add_(q * (p - a))
        opt.step()
        with torch.no_grad():
            for i, p in enumerate(params):
                s[i] -= grads[i] * (p - before[i])
    with torch.no_grad():
        omega = [si.clamp(min=0) / ((p - a) ** 2 + xi) for si, p, a in zip(s, params, anchors)]
        total = sum(float(o.sum()) for o in omega)
        count = sum(o.numel() for o in omega)
        mean = total / max(count, 1)
        omega = [o / mean if mean > 0 else torch.ones_like(o) for o in omega]
        for p, a in zip(params, anchors):
            p.copy_(a)
            p.grad = None
    return omega, {"psm_loss": sum(losses) / len(losses)}


# ----------------------------------------------------------------------------- per step


def on_step(model: torch.nn.Module, cfg: dict[str, Any], step: int) -> None:
    """Before local step ``step``: set the constant memory gate from ``alpha_schedule``
    ([start, end, warmup_steps, step offset]; methods.md section 3), when the config has one."""
    sched = cfg.get("alpha_schedule")
    if sched:
        a0, a1, warm, offset = sched
        set_constant_alpha(model, alpha_schedule(int(offset) + step, float(a0), float(a1), int(warm)))


# ----------------------------------------------------------------------------- checkpoints


def flatten_state(state: dict[int, dict[str, Arrays]]) -> dict[str, torch.Tensor]:
    """{cid: {group: {key: t}}} -> {"<cid>/<group>/<key>": t} (for one safetensors file)."""
    return {f"{cid}/{g}/{k}": t.contiguous() for cid, groups in state.items()
            for g, arrays in groups.items() for k, t in arrays.items()}


def unflatten_state(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, Arrays]]:
    """Inverse of :func:`flatten_state`. Raises ValueError for a malformed key."""
    out: dict[int, dict[str, Arrays]] = {}
    for name, t in flat.items():
        parts = name.split("/", 2)
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in GROUPS:
            raise ValueError(f"client state key '{name}' is not <cid>/<group>/<payload key>")
        out.setdefault(int(parts[0]), {}).setdefault(parts[1], {})[parts[2]] = t
    return out

