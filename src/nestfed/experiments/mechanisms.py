"""The mechanism claims of nested LoRA, measured on a finished run's global adapter.

- Truncation curve (arXiv 2606.15963, section 4, "rank robustness"): the final global adapter
  truncated to its prefix of rank r (A[:r], B[:, :r]) and evaluated on every client's held-out data,
  for every r in ``output.truncations`` up to the adapter's rank. PreLort claims its global adapter
  stays good at every truncation, ZeroPad's and HetLoRA's degrade.
- Dimension importance (same section, "dimension-importance plots"): the Frobenius norm of each
  rank-1 component s B[:, i] A[i, :] of the global adapter, over all LoRA layers:
  imp_i = sqrt(sum_layers (s ||B[:, i]||_2 ||A[i, :]||_2)^2) (the Frobenius norm of a rank-1
  product is the product of its factors' norms). PreLort should concentrate mass in the leading
  indices.

Both read the strategy's ``export`` (the adapter the run directory writes) and are measured the
same way on every transport (the clients evaluate the prefixes as sent). A method that does not
declare ``EXPORT_AT_RANK`` (nestfed.config.capabilities: e.g. local-only, FLoRA's stack of every
client's factors) is skipped with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nestfed import methods
from nestfed.config import INLINE_CLIENTS, ExperimentConfig, r_max
from nestfed.config.capabilities import WHAT, Capability
from nestfed.federation.aggregation import truncate_rank
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState
from nestfed.federation.rank_groups import summarise_metrics
from nestfed.federation.strategy import Strategy
from nestfed.methods.implementation import lora_settings
from nestfed.nn.keys import module_of, peft_key, rank_dim


def adapter_rank(arrays: Arrays) -> int | None:
    """The common rank of every LoRA matrix of an adapter.

    Args:
        arrays: PEFT LoRA arrays (A: [r, in], B: [out, r]) and possibly others.

    Returns:
        The rank r; None when there is no LoRA matrix or the ranks differ.
    """
    ranks = {v.shape[rank_dim(k)] for k, v in arrays.items() if rank_dim(k) is not None}
    return ranks.pop() if len(ranks) == 1 else None


def dimension_importance(arrays: Arrays, scale: float) -> list[float]:
    """The importance of each rank-1 component of an adapter (see the module docstring).

    imp_i = sqrt(sum_layers (s ||B[:, i]|| ||A[i, :]||)^2) for i < r.

    Args:
        arrays: PEFT LoRA arrays of one rank r (A: [r, in], B: [out, r] per layer).
        scale: the adapter's scale s.

    Returns:
        r floats, imp_0 .. imp_{r-1}.

    Raises:
        ValueError: when the layers' ranks differ or a layer lacks B.
    """
    r = adapter_rank(arrays)
    if r is None:
        raise ValueError("dimension importance needs one LoRA adapter of a single rank")
    total = [0.0] * r
    for key in sorted(k for k in arrays if k.endswith("lora_A.weight")):
        module, _ = module_of(key)
        b_key = peft_key(module, "lora_B")
        if b_key not in arrays:
            raise ValueError(f"{module}: lora_A without lora_B")
        col = arrays[b_key].double().norm(dim=0)  # [r]
        row = arrays[key].double().norm(dim=1)  # [r]
        for i, v in enumerate((scale * col * row).tolist()):
            total[i] += v * v
    return [math.sqrt(v) for v in total]


def skip_reason(cfg: ExperimentConfig, arrays: Arrays, files: dict[str, Arrays]) -> str:
    """Why the mechanism reports (and ``nestfed export --rank``) do not apply to a run's export.

    A method that does not declare ``EXPORT_AT_RANK`` (nestfed.config.capabilities) is refused with
    its reason; so is an export that is not one LoRA adapter of rank r_max.

    Args:
        cfg: the run's config.
        arrays: the run's exported adapter (``strategy.export``).
        files: the method's further exported files (``strategy.export_files``).

    Returns:
        The reason; "" when they apply.
    """
    m = methods.get(cfg.strategy.name)
    if not m.can(Capability.EXPORT_AT_RANK):
        return f"{m.name} cannot {WHAT[Capability.EXPORT_AT_RANK][0]}: " + (
            m.refusals.get(Capability.EXPORT_AT_RANK) or WHAT[Capability.EXPORT_AT_RANK][1]
        )
    if files:
        return f"the adapter is not the whole model change (the run also exports {', '.join(sorted(files))})"
    r = adapter_rank(arrays)
    if r is None:
        return "the export is not one LoRA adapter of a single rank"
    if r != r_max(cfg):
        return f"the export's rank {r} is not r_max = {r_max(cfg)} (a stack of factors, not a nested adapter)"
    return ""


#: the fields of `mechanisms` that hold one entry per client (they go where the run keeps its
#: per-client numbers: summary.json with few clients, clients.json with many)
PER_CLIENT = ("truncation", "global_by_client")

#: evaluate(deployments) -> {cid: held-out metrics}: each client's data under the (arrays, scale s)
#: given for it, exactly as given (Transport.evaluate with ``as_sent``); None when nothing evaluates
Evaluate = Callable[[Mapping[int, tuple[Arrays, float]]], "dict[str, dict[str, float]] | None"]


def mechanisms(
    cfg: ExperimentConfig,
    strategy: Strategy,
    clients: Sequence[ClientInfo],
    state: GlobalState,
    evaluate: Evaluate,
    panel: Sequence[int] | None = None,
    on_global: Callable[[Arrays, float], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The mechanism reports' summary fields of a finished run.

    The adapter truncated to r runs at scale s(r): lora_alpha / r_max at every r under ``fixed``
    scaling, lora_alpha / r under ``rank`` scaling (LoraSettings.scale), evaluated as it is (no
    client's kept state mixed in: this is the global adapter, not a client's personalised model)
    on each panel client's held-out data through ``evaluate``, the same for every transport. Ranks
    above the adapter's are left out.

    Args:
        cfg: the run's config (``output.truncations``).
        strategy: the run's server strategy (its ``export``).
        clients: the federation's clients (their ranks).
        state: the final global state.
        evaluate: evaluates deployments on the clients' held-out data, as sent (`Evaluate`).
        panel: the clients evaluated (the evaluation panel,
            nestfed.federation.evaluation_plan.EvalPlan); None: every client.
        on_global: ``on_global(arrays, s)``: metrics on the global held-out set; None without one.

    Returns:
        ``truncation`` ({r: {cid: held-out metrics}}) and ``dimension_importance`` (r_max floats),
        or ``mechanisms_skipped`` with the reason; with many clients ``truncation_by_rank`` ({r: the
        curve's metrics by rank group}); with ``on_global``, ``truncation_global`` ({r: its metrics}).
    """
    if not methods.get(cfg.strategy.name).can(Capability.EXPORT_AT_RANK):
        return {"mechanisms_skipped": skip_reason(cfg, {}, {})}
    arrays, scale = strategy.export(state)
    reason = skip_reason(cfg, arrays, strategy.export_files(state))
    if reason:
        return {"mechanisms_skipped": reason}
    cids = [c.cid for c in clients] if panel is None else list(panel)
    settings = lora_settings(cfg)
    ranks = {str(c.cid): c.rank for c in clients}
    rs = [r for r in sorted(set(cfg.output.truncations)) if r <= settings.r_max]
    curve: dict[str, dict[str, dict[str, float]]] = {}
    for r in rs:
        prefix, s_r = truncate_rank(arrays, r), settings.scale(r)
        got = evaluate({c: (prefix, s_r) for c in cids})
        if got is None:
            return {"mechanisms_skipped": "this run's transport does not evaluate (the Flower run config's evaluate)"}
        curve[str(r)] = got
    out: dict[str, Any] = {"truncation": curve, "dimension_importance": dimension_importance(arrays, scale)}
    if len(clients) > INLINE_CLIENTS:
        out["truncation_by_rank"] = {r: summarise_metrics(c, ranks) for r, c in curve.items()}
    if on_global is not None:
        out["truncation_global"] = {str(r): on_global(truncate_rank(arrays, r), settings.scale(r)) for r in rs}
    return out
