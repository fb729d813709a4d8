"""One run's summary from its metrics lines: final and initial held-out metrics per client, their
means, bytes per client per round, rejected updates, the aggregation drop, NIAH's accuracy by
length and depth. Pure functions of the lines (dicts), written by nestfed.federation.run_dir."""

from __future__ import annotations

from typing import Any

from nestfed.config import ExperimentConfig


def summarise(lines: list[dict[str, Any]], cfg: ExperimentConfig) -> dict[str, Any]:
    """Summary fields of a run from its metrics lines (round 0 first).

    ``mean_ppl`` is the mean over clients of exp(loss); bytes are serialised payload bytes. Lines
    without held-out metrics (a Flower run without evaluation) give the bytes and counts only.
    """
    rounds = [ln for ln in lines if ln["round"] > 0]
    fits = [c for ln in rounds for c in ln["clients"].values()]
    out: dict[str, Any] = {
        "method": cfg.strategy.name,
        "rounds": len(rounds),
        "ranks": list(cfg.lora.ranks),
        "aggregated_rounds": sum(1 for ln in rounds if ln.get("aggregated")),
        "bytes_down_total": sum(ln["bytes_down"] for ln in rounds),
        "bytes_up_total": sum(ln["bytes_up"] for ln in rounds),
        "bytes_down_per_client_round": sum(c.get("bytes_down", 0) for c in fits) / max(len(fits), 1),
        "bytes_up_per_client_round": sum(c.get("bytes_up", 0) for c in fits) / max(len(fits), 1),
        "rejected_updates": sum(len(ln["rejected"]) for ln in rounds),
        "dropped_updates": sum(len(ln.get("dropped", {})) for ln in rounds),
        "train_time_s": sum(c.get("metrics", {}).get("train_time_s", 0.0) for c in fits),
    }
    out["aggregates_refused"] = sum(1 for ln in rounds if "aggregate_rejected" in ln)
    if rounds and "privacy" in rounds[-1]:  # the privacy spent by the whole run
        out["privacy"] = rounds[-1]["privacy"]
    if not lines or not all(ln.get("eval") for ln in lines):
        return out
    first, last = lines[0]["eval"], lines[-1]["eval"]
    out.update({
        "final": last,
        "initial": first,
        "mean_ppl": sum(v["ppl"] for v in last.values()) / len(last),
        "mean_loss": sum(v["loss"] for v in last.values()) / len(last),
        "initial_mean_ppl": sum(v["ppl"] for v in first.values()) / len(first),
    })
    if all("accuracy" in v for v in last.values()):
        out["mean_accuracy"] = sum(v["accuracy"] for v in last.values()) / len(last)
    out.update(aggregation_drop(lines))
    out.update(group_accuracy(last))
    return out


def aggregation_drop(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """FedNL's "aggregation drop" (arXiv 2605.16350, section 5.1): per client, the accuracy of
    its own model right after local training in the last round (``local_accuracy``, from
    ``train.eval_local``) minus the accuracy of the model it runs after aggregation (the final
    evaluation). Empty when the run did not evaluate locally or has no accuracy."""
    rounds = [ln for ln in lines if ln["round"] > 0]
    if not rounds:
        return {}
    last = rounds[-1]
    local = {c: v["metrics"]["local_accuracy"] for c, v in last["clients"].items()
             if "local_accuracy" in v.get("metrics", {})}
    fed = {c: last["eval"][c]["accuracy"] for c in local if "accuracy" in last["eval"].get(c, {})}
    if not fed:
        return {}
    drop = {c: local[c] - fed[c] for c in fed}
    return {"local_accuracy": local, "federated_accuracy": fed, "aggregation_drop": drop,
            "mean_aggregation_drop": sum(drop.values()) / len(drop)}


def group_accuracy(evaluation: dict[str, dict[str, float]]) -> dict[str, Any]:
    """NIAH's accuracy per context length and per needle depth, from evaluation metrics named
    ``accuracy@<length>@<depth>`` (ClientData.test_groups): for each client and over all
    clients, the unweighted mean over the groups sharing a length or a depth (the generator
    gives every group the same number of rows). Empty when there are no such metrics."""
    by_len: dict[str, dict[str, list[float]]] = {}
    by_depth: dict[str, dict[str, list[float]]] = {}
    for cid, metrics in evaluation.items():
        for key, v in metrics.items():
            parts = key.split("@")
            if parts[0] != "accuracy" or len(parts) != 3:
                continue
            by_len.setdefault(parts[1], {}).setdefault(cid, []).append(v)
            by_depth.setdefault(parts[2], {}).setdefault(cid, []).append(v)
    if not by_len:
        return {}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def table(d: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
        return {g: {"clients": {c: mean(v) for c, v in sorted(per.items(), key=lambda kv: int(kv[0]))},
                    "mean": mean([x for v in per.values() for x in v])} for g, per in d.items()}

    return {"accuracy_by_length": table(by_len), "accuracy_by_depth": table(by_depth)}
