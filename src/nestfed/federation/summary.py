"""One run's summary from its metrics lines, and summary.json's whole content.

The summary (``summarise``): final and initial held-out metrics per client, their means, bytes per
client per round, rejected updates, the aggregation drop, NIAH's accuracy by length and depth.
summary.json completes it for a completed run (``completed_summary``: the rank groups, the entry
point's and the method's fields, the outcome) or a failed one (``failed_summary``). Pure functions
of the lines (dicts); nestfed.federation.run_dir writes what they return.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nestfed.config import ExperimentConfig
from nestfed.federation.rank_groups import HIGHER_IS_WORSE, by_rank, by_tier, summarise_metrics, tier_key, tier_name


def summarise(lines: list[dict[str, Any]], cfg: ExperimentConfig) -> dict[str, Any]:
    """Summary fields of a run from its metrics lines.

    ``mean_ppl`` is the mean over clients of exp(loss); bytes are serialised payload bytes. Lines
    without held-out metrics (a Flower run without evaluation) give the bytes and counts only.

    Args:
        lines: the metrics lines, round 0 first, per-client numbers included (RunDir.read_rounds).
        cfg: the run's config (the method's name, the ranks).

    Returns:
        {field: value}: method, rounds, ranks, aggregated_rounds, the bytes, rejected and dropped
        updates, train_time_s, aggregates_refused, rounds_mostly_dropped, privacy and global_eval
        where recorded; with evaluations from round 0 to the last round, also final, initial,
        mean_ppl, mean_loss, initial_mean_ppl, mean_accuracy, the aggregation drop and NIAH's
        accuracy by length and depth.
    """
    rounds = [ln for ln in lines if ln["round"] > 0]
    # the clients an instruction went to (a client that dropped out after sampling was sent nothing)
    fits = [c for ln in rounds for c in ln["clients"].values() if c.get("status") != "dropped" or c.get("bytes_down")]
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
    out["rounds_mostly_dropped"] = [
        ln["round"] for ln in rounds if ln.get("sampled") and 2 * len(ln.get("dropped", {})) > len(ln["sampled"])
    ]
    if rounds and "privacy" in rounds[-1]:  # the privacy spent by the whole run
        out["privacy"] = rounds[-1]["privacy"]
    if any("eval_global" in ln for ln in lines):
        out["global_eval"] = {"initial": lines[0].get("eval_global"), "final": lines[-1].get("eval_global")}
    evaluated = [ln for ln in lines if ln.get("eval")]
    if not lines or not evaluated or evaluated[0]["round"] != 0 or evaluated[-1]["round"] != lines[-1]["round"]:
        return out
    first, last = evaluated[0]["eval"], evaluated[-1]["eval"]
    out.update(
        {
            "final": last,
            "initial": first,
            "mean_ppl": sum(v["ppl"] for v in last.values()) / len(last),
            "mean_loss": sum(v["loss"] for v in last.values()) / len(last),
            "initial_mean_ppl": sum(v["ppl"] for v in first.values()) / len(first),
        }
    )
    if all("accuracy" in v for v in last.values()):
        out["mean_accuracy"] = sum(v["accuracy"] for v in last.values()) / len(last)
    out.update(aggregation_drop(lines))
    out.update(group_accuracy(last))
    return out


def failed_summary(
    lines: list[dict[str, Any]],
    cfg: ExperimentConfig,
    failure: str,
    failed_round: int,
    extra: Mapping[str, Any],
    run_dir: str,
) -> dict[str, Any]:
    """summary.json of a run that stopped (nestfed.errors.RunFailed).

    Args:
        lines: the committed rounds' metrics lines.
        cfg: the run's config.
        failure: the one line saying why it stopped.
        failed_round: the round it stopped in.
        extra: the entry point's fields.
        run_dir: the run directory, as recorded.

    Returns:
        The committed rounds' summary (``summarise``), then ``extra``, then ``adapter`` None,
        ``outcome = "failed"``, ``failure``, ``failed_round`` and ``run_dir``.
    """
    summary = summarise(lines, cfg)
    summary.update(extra)
    summary.update(
        {
            "adapter": None,
            "outcome": "failed",
            "failure": failure,
            "failed_round": failed_round,
            "run_dir": run_dir,
        }
    )
    return summary


# the per-client fields a summary drops when the per-client numbers are in clients.json
PER_CLIENT_FIELDS = ("final", "initial", "local_accuracy", "federated_accuracy", "aggregation_drop")


def completed_summary(
    summary: dict[str, Any],
    cfg: ExperimentConfig,
    *,
    adapter: str | None,
    extra: Mapping[str, Any],
    roster: Mapping[str, Mapping[str, Any]],
    per_client: Mapping[str, Any],
    inline: bool,
    method_fields: Mapping[str, Any],
    run_dir: str,
) -> dict[str, Any]:
    """summary.json of a run whose rounds are all committed, completed in place.

    Args:
        summary: the run's ``summarise``, completed in place.
        cfg: the run's config.
        adapter: the exported adapter's directory; None when none was exported.
        extra: the entry point's fields.
        roster: {cid: {rank, ...}} of every client; the rank groups (``rank_fields``) when known.
        per_client: further per-client maps, {name: {cid: ...}}.
        inline: the per-client numbers stay in the metrics lines: ``per_client`` joins the
            summary; False puts ``per_client = "clients.json"`` in place of the summary's
            per-client fields (``PER_CLIENT_FIELDS``).
        method_fields: the method's own fields.
        run_dir: the run directory, as recorded.

    Returns:
        ``summary``: adapter, the rank groups, the device tiers (`tier_fields`), ``extra``, the
        per-client maps, ``method_fields``, ``outcome = "completed"`` and ``run_dir``, in that order.
    """
    summary["adapter"] = adapter
    if roster:
        summary.update(rank_fields(summary, roster_ranks(roster), cfg.population.draws_ranks))
        summary.update(tier_fields(summary, roster))
    summary.update(extra)
    if inline:
        summary.update(per_client)
    else:
        for key in PER_CLIENT_FIELDS:
            summary.pop(key, None)
        summary["per_client"] = "clients.json"
    summary.update(method_fields)
    summary["outcome"] = "completed"
    summary["run_dir"] = run_dir
    return summary


def roster_ranks(roster: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The ranks of a roster.

    Args:
        roster: {cid: {rank, label, num_examples[, memory_mib]}}.

    Returns:
        {cid: r_k}.
    """
    return {c: int(r["rank"]) for c, r in roster.items()}


#: the roster's columns every run may have; a method's own columns (a compressed client's ratio) follow them
ROSTER_KEYS = ("rank", "label", "num_examples", "memory_mib", "precision")


def roster_table(lines: list[dict[str, Any]], roster: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``client_table`` of the clients of a roster.

    Args:
        lines: the metrics lines, per-client numbers included.
        roster: {cid: {rank, label, num_examples[, memory_mib][, precision][, the method's own
            columns]}}; memory_mib where budgets were drawn.

    Returns:
        One row per client (``client_table``).
    """
    budgets = {c: r["memory_mib"] for c, r in roster.items() if r.get("memory_mib") is not None} or None
    precisions = {c: r["precision"] for c, r in roster.items() if r.get("precision") is not None} or None
    own = [k for k in dict.fromkeys(k for r in roster.values() for k in r) if k not in ROSTER_KEYS]
    return client_table(
        lines,
        roster_ranks(roster),
        {c: r.get("label", "") for c, r in roster.items()},
        {c: r.get("num_examples", 0) for c, r in roster.items()},
        budgets,
        precisions,
        {k: {c: r.get(k) for c, r in roster.items()} for k in own} or None,
    )


def tier_fields(summary: Mapping[str, Any], roster: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The summary's device tiers: the clients grouped by (backbone precision, rank).

    Args:
        summary: the run's summary (its ``final`` and ``initial``).
        roster: {cid: {rank, precision, ...}}; a client's ``precision`` where budgets chose it
            (``population.precisions``).

    Returns:
        {} without precisions in the roster; else ``client_precisions`` ({cid: precision}),
        ``tiers`` ({`tier_name`: {precision, rank,
        clients}}, the most precise first, then by rank) and ``by_tier`` (``final`` and
        ``initial``: {metric: {tier: stats}}; ``change_pct``: each client's relative perplexity
        change, 100 (final / initial - 1), by tier), as ``by_rank`` is by rank group.
    """
    if not any("precision" in r for r in roster.values()):
        return {}
    names = {c: tier_name(r["precision"], int(r["rank"])) for c, r in roster.items()}
    tiers: dict[str, dict[str, Any]] = {}
    for c in sorted(names, key=int):
        t = tiers.setdefault(
            names[c], {"precision": roster[c]["precision"], "rank": int(roster[c]["rank"]), "clients": []}
        )
        t["clients"].append(int(c))
    out: dict[str, Any] = {
        "client_precisions": {c: roster[c]["precision"] for c in sorted(names, key=int)},
        "tiers": dict(sorted(tiers.items(), key=lambda kv: tier_key(kv[0]))),
    }
    if "final" in summary:
        final, initial = summary["final"], summary["initial"]
        grouped: dict[str, Any] = {}
        for when, ev in (("final", final), ("initial", initial)):
            grouped[when] = {}
            for metric in ("ppl", "loss", "accuracy"):
                vals = {c: m[metric] for c, m in ev.items() if metric in m}
                if vals and len(vals) == len(ev):
                    grouped[when][metric] = by_tier(vals, names, metric in HIGHER_IS_WORSE)
        change = {c: 100.0 * (final[c]["ppl"] / initial[c]["ppl"] - 1.0) for c in final if c in initial}
        grouped["change_pct"] = by_tier(change, names)
        out["by_tier"] = grouped
    return out


def rank_fields(summary: Mapping[str, Any], ranks: Mapping[str, int], draws_ranks: bool) -> dict[str, Any]:
    """The summary's rank groups.

    Args:
        summary: the run's summary.
        ranks: {cid: r_k}.
        draws_ranks: the population drew the ranks.

    Returns:
        ``rank_counts`` ({rank: clients}, ranks ascending), ``by_rank`` (``rank_summary``) and,
        with ``draws_ranks``, ``ranks``: the distinct ranks drawn, sorted.
    """
    counts: dict[str, int] = {}
    for r in ranks.values():
        counts[str(r)] = counts.get(str(r), 0) + 1
    out: dict[str, Any] = {
        "rank_counts": dict(sorted(counts.items(), key=lambda kv: int(kv[0]))),
        "by_rank": rank_summary(summary, ranks),
    }
    if draws_ranks:
        out["ranks"] = sorted({int(r) for r in ranks.values()})
    return out


def client_table(
    lines: list[dict[str, Any]],
    ranks: Mapping[str, int],
    labels: Mapping[str, str],
    num_examples: Mapping[str, int],
    budgets: Mapping[str, int] | None = None,
    precisions: Mapping[str, str] | None = None,
    columns: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The per-client table of a run (clients.csv), a pure function of its joined metrics lines.

    Args:
        lines: the metrics lines, per-client numbers included.
        ranks: {cid: r_k} of every client.
        labels: {cid: label}.
        num_examples: {cid: n_k}.
        budgets: {cid: memory budget in MiB} when budgets drew the ranks; None leaves the column out.
        precisions: {cid: backbone precision} when budgets chose it (device tiers); None leaves the
            column out.
        columns: {column: {cid: value}}, a method's own columns (a compressed client's ratio);
            None for none.

    Returns:
        One row per client (ids ascending): cid, rank, label, num_examples, memory_mib (with
        ``budgets``), precision (with ``precisions``), the ``columns``, rounds_sampled, rounds_accepted, and its
        first and last held-out metrics (``initial_<metric>``, ``final_<metric>``: of rounds 0 and
        R; absent for a client neither evaluated).
    """
    rounds = [ln for ln in lines if ln["round"] > 0]
    evaluated = [ln for ln in lines if ln.get("eval")]
    first = evaluated[0]["eval"] if evaluated and evaluated[0]["round"] == 0 else {}
    last = evaluated[-1]["eval"] if evaluated and evaluated[-1]["round"] == lines[-1]["round"] else {}
    sampled: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for ln in rounds:
        for cid, info in ln.get("clients", {}).items():
            sampled[cid] = sampled.get(cid, 0) + 1
            accepted[cid] = accepted.get(cid, 0) + (info.get("status") in ("accepted", "secure"))
    rows = []
    for cid in sorted(ranks, key=int):
        row: dict[str, Any] = {
            "cid": int(cid),
            "rank": int(ranks[cid]),
            "label": labels.get(cid, ""),
            "num_examples": int(num_examples.get(cid, 0)),
        }
        if budgets is not None:
            row["memory_mib"] = budgets.get(cid)
        if precisions is not None:
            row["precision"] = precisions.get(cid)
        for name, values in (columns or {}).items():
            row[name] = values.get(cid)
        row.update({"rounds_sampled": sampled.get(cid, 0), "rounds_accepted": accepted.get(cid, 0)})
        for prefix, ev in (("initial", first), ("final", last)):
            for k in ("loss", "ppl", "accuracy"):
                if k in ev.get(cid, {}):
                    row[f"{prefix}_{k}"] = ev[cid][k]
        rows.append(row)
    return rows


def rank_summary(summary: Mapping[str, Any], ranks: Mapping[str, int]) -> dict[str, Any]:
    """The summary's per-client evaluations by rank group (nestfed.federation.rank_groups).

    Args:
        summary: the run's summary (its ``final`` and ``initial``).
        ranks: {cid: r_k}.

    Returns:
        ``final`` and ``initial`` ({metric: {rank: stats}}) and ``change_pct`` (the relative change
        of each client's perplexity, 100 (final / initial - 1), by rank); {} without evaluations.
    """
    if "final" not in summary:
        return {}
    final, initial = summary["final"], summary["initial"]
    change = {c: 100.0 * (final[c]["ppl"] / initial[c]["ppl"] - 1.0) for c in final if c in initial}
    return {
        "final": summarise_metrics(final, ranks),
        "initial": summarise_metrics(initial, ranks),
        "change_pct": by_rank(change, ranks),
    }


def aggregation_drop(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """FedNL's "aggregation drop" (arXiv 2605.16350, section 5.1).

    Per client: the accuracy of its own model right after local training in the last round
    (``local_accuracy``, from ``train.eval_local``) minus the accuracy of the model it runs after
    aggregation (the final evaluation).

    Args:
        lines: the metrics lines, per-client numbers included.

    Returns:
        ``local_accuracy``, ``federated_accuracy``, ``aggregation_drop`` ({cid: value}) and
        ``mean_aggregation_drop``; {} when the run did not evaluate locally or has no accuracy.
    """
    rounds = [ln for ln in lines if ln["round"] > 0]
    if not rounds:
        return {}
    last = rounds[-1]
    local = {
        c: v["metrics"]["local_accuracy"]
        for c, v in last["clients"].items()
        if "local_accuracy" in v.get("metrics", {})
    }
    fed = {c: last["eval"][c]["accuracy"] for c in local if "accuracy" in last["eval"].get(c, {})}
    if not fed:
        return {}
    drop = {c: local[c] - fed[c] for c in fed}
    return {
        "local_accuracy": local,
        "federated_accuracy": fed,
        "aggregation_drop": drop,
        "mean_aggregation_drop": sum(drop.values()) / len(drop),
    }


def group_accuracy(evaluation: dict[str, dict[str, float]]) -> dict[str, Any]:
    """NIAH's accuracy per context length and per needle depth.

    For each client and over all clients: the unweighted mean over the groups sharing a length or
    a depth (the generator gives every group the same number of rows).

    Args:
        evaluation: {cid: metrics}, the metrics named ``accuracy@<length>@<depth>``
            (ClientData.test_groups).

    Returns:
        ``accuracy_by_length`` and ``accuracy_by_depth``, each {group: {clients: {cid: mean},
        mean}}; {} when there are no such metrics.
    """
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
        return {
            g: {
                "clients": {c: mean(v) for c, v in sorted(per.items(), key=lambda kv: int(kv[0]))},
                "mean": mean([x for v in per.values() for x in v]),
            }
            for g, per in d.items()
        }

    return {"accuracy_by_length": table(by_len), "accuracy_by_depth": table(by_depth)}
