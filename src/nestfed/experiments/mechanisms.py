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

Both read the strategy's ``export`` (the adapter the run directory writes). A method without one
global adapter (:attr:`Method.global_adapter` False, e.g. local-only), or whose export is not one
LoRA adapter of rank r_max (FLoRA's stack of every client's factors), is skipped with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nestfed import methods
from nestfed.config import INLINE_CLIENTS, ExperimentConfig, r_max
from nestfed.data.clients import ClientData
from nestfed.evaluation.client import evaluate_client
from nestfed.federation.aggregation import truncate_rank
from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.federation.rank_groups import summarise_metrics
from nestfed.methods.implementation import MethodRun, lora_settings
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.keys import module_of, peft_key, rank_dim


def adapter_rank(arrays: Arrays) -> int | None:
    """The common rank of every LoRA matrix in ``arrays`` (A: [r, in], B: [out, r]); None when
    there is none or the ranks differ."""
    ranks = {v.shape[rank_dim(k)] for k, v in arrays.items() if rank_dim(k) is not None}
    return ranks.pop() if len(ranks) == 1 else None


def dimension_importance(arrays: Arrays, scale: float) -> list[float]:
    """imp_i = sqrt(sum_layers (s ||B[:, i]|| ||A[i, :]||)^2) for i < r (see the module docstring).

    arrays: PEFT LoRA arrays of one rank r (A: [r, in], B: [out, r] per layer); scale: s.
    Returns r floats. Raises ValueError when the layers' ranks differ or a layer lacks A or B.
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
    """Why the mechanism reports do not apply to this run's export ``arrays`` (with the method's
    further exported ``files``); "" when they do."""
    if not methods.get(cfg.strategy.name).global_adapter:
        return f"{cfg.strategy.name} has no global LoRA adapter that clients run a prefix of"
    if files:
        return f"the adapter is not the whole model change (the run also exports {', '.join(sorted(files))})"
    r = adapter_rank(arrays)
    if r is None:
        return "the export is not one LoRA adapter of a single rank"
    if r != r_max(cfg):
        return f"the export's rank {r} is not r_max = {r_max(cfg)} (a stack of factors, not a nested adapter)"
    return ""


#: the fields of :func:`mechanisms` that hold one entry per client (they go where the run keeps its
#: per-client numbers: summary.json with few clients, clients.json with many)
PER_CLIENT = ("truncation", "global_by_client")


def mechanisms(
    cfg: ExperimentConfig,
    mr: MethodRun,
    state: GlobalState,
    panel: Sequence[int] | None = None,
    global_data: ClientData | None = None,
) -> dict[str, Any]:
    """The summary fields of a finished run: ``truncation`` {r: {cid: held-out metrics}},
    ``dimension_importance`` [r_max floats], or ``mechanisms_skipped`` with the reason; with many
    clients ``truncation_by_rank`` ({r: the curve's metrics by rank group}); with the global held-out
    set ``truncation_global`` ({r: its metrics}) and ``global_by_client`` ({cid: what that client
    runs, on the global set}: every method, local-only included).

    The adapter truncated to r runs at scale s(r): lora_alpha / r_max at every r under ``fixed``
    scaling, lora_alpha / r under ``rank`` scaling (LoraSettings.scale), loaded into the run's model
    as it is (no client's kept state mixed in: this is the global adapter, not a client's
    personalised model) and evaluated on each client's held-out data: the clients of ``panel``
    (the evaluation panel, nestfed.federation.evaluation_plan.EvalPlan; None = every client). Ranks above the
    adapter's are left out. A method whose clients are not nestfed.federation.client.ClientTrainer
    is skipped.
    """
    trainer = mr.trainer
    cids = [c.cid for c in mr.clients] if panel is None else list(panel)
    out: dict[str, Any] = {}
    if global_data is not None and isinstance(trainer, ClientTrainer):  # what each client runs, on the global set
        out["global_by_client"] = {}
        for cid in cids:
            arrays, scale = mr.strategy.deploy(state, cid)
            out["global_by_client"][str(cid)] = trainer.evaluate_on(cid, arrays, scale, global_data)
    if not methods.get(cfg.strategy.name).global_adapter:
        return {**out, "mechanisms_skipped": skip_reason(cfg, {}, {})}
    if not isinstance(trainer, ClientTrainer):
        return {"mechanisms_skipped": "its clients do not run the LoRA client trainer"}
    arrays, scale = mr.strategy.export(state)
    reason = skip_reason(cfg, arrays, mr.strategy.export_files(state))
    if reason:
        return {**out, "mechanisms_skipped": reason}
    settings = lora_settings(cfg)
    ranks = {str(c.cid): c.rank for c in mr.clients}
    on_global: dict[str, dict[str, float]] = {}
    rs = [r for r in sorted(set(cfg.output.truncations)) if r <= settings.r_max]
    curve: dict[str, dict[str, dict[str, float]]] = {str(r): {} for r in rs}
    for c in cids:  # client by client: its data are built (or read) once for every rank of the curve
        data = trainer.data[c]
        for r in rs:
            apply_arrays(trainer.model, truncate_rank(arrays, r), settings.scale(r))
            curve[str(r)][str(c)] = evaluate_client(trainer.model, data, trainer.train)
    for r in rs if global_data is not None else []:
        apply_arrays(trainer.model, truncate_rank(arrays, r), settings.scale(r))
        on_global[str(r)] = evaluate_client(trainer.model, global_data, trainer.train)
    out.update({"truncation": curve, "dimension_importance": dimension_importance(arrays, scale)})
    if len(mr.clients) > INLINE_CLIENTS:
        out["truncation_by_rank"] = {r: summarise_metrics(c, ranks) for r, c in curve.items()}
    if on_global:
        out["truncation_global"] = on_global
    return out
