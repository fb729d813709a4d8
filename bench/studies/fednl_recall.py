"""FedNL where only a memory can help: associative recall beyond the attention window (issues 24
and 32; configs/fednl/recall.toml, nestfed.data.recall).

Every layer's softmax attention sees the last 64 tokens plus 4 sinks (``model.attention_window``)
for every method; a row states four facts of one kind and asks about one of them 60 (inside the
window) to 320 tokens later. Four clients (one kind each) and a held-out kind (metal) every
client is tested on. The memory trains as the references train theirs (the config's header: the
server's warm-up, the rules' own learning rate, a loss past the window, window dropout);
``--config configs/fednl/recall_old_recipe.toml`` reproduces issue 24's run.

``run`` trains, over ``--seeds`` seeds, FedNL with both travel modes (``all``: LoRA and the memory
rules; ``rules``: the rules only), FedAvg and FedNL's local-only baseline (``travel = "none"``),
all with the same window, through ``nestfed run``; ``summarise`` reads their final evaluations,
evaluates every FedNL model again with its memory knocked out (alpha = 0), the backbone with the
window (the floor) and with full attention (the ceiling), probes the memory of a trained FedNL
model, and writes the results JSON::

    .venv/bin/python bench/studies/fednl_recall.py run --out /tmp/recall --seeds 3
    .venv/bin/python bench/studies/fednl_recall.py summarise /tmp/recall --json bench/results/fednl_recall/recall.json

Reported: accuracy (the argmax over the five kinds' 40 value tokens; a model that knows the kind
but not the fact scores 1/8) per group own@<distance> / held_out@<distance>, mean over clients,
mean ± 95% t half width over seeds; each method against FedAvg over the (seed, client) pairs in
percentage points; the learned gates per layer and head; bytes per client per round; the tokens
each client trained on and the wall time; and the probe (:func:`probe`): is the memory written
(beta at the facts' values and elsewhere, how much of a stored value S still returns for its
key), is it read (per head: which fact's value the read-out at the question is closest to), and
what does it add to the answer's logit (the gold value's logit with the memory against knocked out).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from nestfed.io.markdown import markdown_row, markdown_table

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "fednl" / "recall.toml"
VARIANTS = {  # label: (nestfed run --methods, extra --set)
    "fednl": ("fednl", []),
    "fednl rules": ("fednl", ["fednl.travel=rules"]),
    "fednl local-only": ("fednl", ["fednl.travel=none"]),
    "fedavg": ("fedavg", []),
}


def run(out: Path, seeds: int, only: list[str], config: Path) -> None:
    """Train every variant (``nestfed run ... --seeds``) under ``out/<label>``."""
    for label, (method, sets) in VARIANTS.items():
        if only and label not in only:
            continue
        d = out / label.replace(" ", "_")
        cmd = [str(Path(sys.executable).parent / "nestfed"), "run", str(config), "--methods", method]
        cmd += ["--seeds", str(seeds)]
        cmd += [x for s in [*sets, f"output.dir={d}"] for x in ("--set", s)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(json.dumps({"variant": label, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


def runs_of(out: Path, label: str) -> list[Path]:
    """The seed run directories of one variant (``<out>/<label>/<parent>/seed<i>/<method>``)."""
    return sorted(p.parent for p in (out / label.replace(" ", "_")).glob("*/seed*/*/summary.json"))


def gates(run_dir: Path) -> dict[str, list[float]]:
    """{memory layer: alpha per head} of a run's final rules: the global ones, or the mean over
    clients of the rules each kept (local-only); empty without a learned gate."""
    from nestfed.federation.run_dir import RunDir

    ck = RunDir(run_dir).latest_checkpoint(True)
    kept = [a for s in (ck.client_state or {}).values() for a in s.values()]
    sets = [a for a in kept if any(k.endswith("memory.gate_logit") for k in a)] or [ck.state.arrays]
    out: dict[str, list[torch.Tensor]] = {}
    for arrays in sets:
        for k, v in sorted(arrays.items()):
            if k.endswith("memory.gate_logit"):
                out.setdefault(k.split(".layers.")[1].split(".")[0], []).append(torch.sigmoid(v.double()))
    return {layer: torch.stack(v).mean(0).tolist() for layer, v in out.items()}


def backbone_rows(cfg, windows: dict[str, int]) -> dict[str, dict[str, dict[str, float]]]:
    """{label: {client: {group: accuracy}}} of the backbone under each ``model.attention_window``."""
    from dataclasses import replace

    from nestfed.data.recall import recall_client_data
    from nestfed.evaluation.lm import evaluate_lm
    from nestfed.nn.backbone import load_backbone

    out = {}
    for label, w in windows.items():
        model_cfg = replace(cfg.model, attention_window=w, attention_sinks=cfg.model.attention_sinks if w else 0)
        bb = load_backbone(model_cfg)
        clients, _ = recall_client_data(cfg, bb.tokenizer)
        out[label] = {}
        for cid, d in clients.items():
            out[label][str(cid)] = {
                g: evaluate_lm(bb.model, d.test_labels[idx], d.test_ids[idx], batch_size=8, letter_ids=d.letter_ids)[
                    "accuracy"
                ]
                for g, idx in d.test_groups.items()
            }
    return out


def group_order(g: str) -> tuple[int, int]:
    tag, d = g.split("@")
    return (0 if tag == "own" else 1, int(d))


# ----------------------------------------------------------------------------- the memory probe


def _probe_model(run_dir: Path | None, cfg):
    """The model a probe reads: a finished FedNL run's (its final adapter and rules, its memory
    layers) or, for None, the backbone with a fresh memory (the config's settings) on every layer."""
    from nestfed.config import r_max
    from nestfed.federation.run_dir import RunDir
    from nestfed.methods.fednl.setup import memory_settings
    from nestfed.nn.arrays import apply_arrays
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.lora import inject_lora
    from nestfed.nn.memory import fresh_rule_arrays, install_memory

    bb = load_backbone(cfg.model)
    model = bb.model
    if run_dir is not None:
        inject_lora(model, cfg.lora.target_modules, r_max(cfg), cfg.lora.lora_alpha / r_max(cfg), cfg.lora.layers)
        install_memory(model, memory_settings(cfg), cfg.section("fednl").layers or cfg.lora.layers)
        arrays = RunDir(run_dir).latest_checkpoint().state.arrays
        apply_arrays(model, arrays, cfg.lora.lora_alpha / r_max(cfg))
    else:
        layers = install_memory(model, memory_settings(cfg))
        apply_arrays(model, fresh_rule_arrays(model, layers), 1.0)
    return bb


@torch.no_grad()
def probe(run_dir: Path | None, cfg, rows: int = 16, distance: int = 160) -> dict:
    """Is the memory written, is it read, and what does it add? For ``rows`` test rows of the
    clients' kinds at ``distance``, per memory layer, from the layer's own input and projections
    as the memory sees them (nestfed.nn.memory.MemoryRule.inputs and beta) and the delta rule run
    over the row up to the question: ``beta`` at the facts' value tokens and elsewhere;
    ``retention``: cos(S^T k, v) at the question for the asked value's own key, per head (1 = the
    write intact); ``read_top1``: per head, how often the read-out S^T q at the question is
    closest (cosine) to the asked fact's value among the row's facts (chance 1 / facts);
    ``alpha``: the gate per head. And for the whole model: ``logit_gain``, the gold value's logit
    with the memory minus with it knocked out (mean over rows), and ``accuracy`` / ``accuracy_
    knocked_out`` on these rows. ``run_dir``: a finished FedNL run; None: the backbone with a fresh
    memory on every layer."""
    from nestfed.data.corpora import long_texts
    from nestfed.data.niah import Haystack
    from nestfed.data.recall import candidate_ids, make_row
    from nestfed.nn.bounded_attention import attention_modules, projections
    from nestfed.nn.memory import memory_knocked_out, memory_rules
    from nestfed.ops.delta_rule import delta_rule

    bb = _probe_model(run_dir, cfg)
    model = bb.model
    rules = memory_rules(model)
    attns = attention_modules(model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        attns[i].register_forward_pre_hook(
            lambda m, args, kwargs, _i=i: seen.__setitem__(_i, kwargs["hidden_states"].detach()), with_kwargs=True
        )
        for i in rules
    ]
    o = cfg.section("recall")
    cand = torch.tensor(candidate_ids(bb.tokenizer, [*o.kinds, o.held_out]))
    hay = Haystack([x.text for x in long_texts(o.haystack)], bb.tokenizer, "test")
    H = {i: r.num_heads for i, r in rules.items()}
    stats = {i: {"beta_values": [], "beta_other": [], "retention": [], "read_top1": []} for i in rules}
    whole = {"logit_gain": [], "correct": [], "correct_knocked_out": []}
    rng = random.Random(f"probe/{distance}")
    for n in range(rows):
        row = make_row(o.kinds[n % len(o.kinds)], bb.tokenizer, hay, rng, distance, o.facts, o.lead)
        ids = torch.tensor([row.ids[:-1]])
        gold = row.ids[-1]
        logits = model(input_ids=ids).logits[0, -1].float()
        with memory_knocked_out(model):
            knocked = model(input_ids=ids).logits[0, -1].float()
        whole["logit_gain"].append(float(logits[gold] - knocked[gold]))
        whole["correct"].append(float(int(cand[logits[cand].argmax()]) == gold))
        whole["correct_knocked_out"].append(float(int(cand[knocked[cand].argmax()]) == gold))
        p = ids.shape[1] - 1  # the predicting position
        at = list(row.values_at)
        for i, rule in rules.items():
            q, k, v = projections(attns[i], seen[i])
            q_lin, k_lin, v_lin = rule.inputs(q, k, v)
            beta = rule.beta(k, hidden_states=seen[i])  # [1, T, H]
            _, S = delta_rule(q_lin, k_lin, v_lin, beta, output_final_state=True)  # [1, H, D, D]
            other = torch.ones(beta.shape[1], dtype=torch.bool)
            other[at] = False
            stats[i]["beta_values"].append(float(beta[0, at].mean()))
            stats[i]["beta_other"].append(float(beta[0, other].mean()))
            t = at[row.asked]
            back = torch.einsum("hde,hd->he", S[0].double(), k_lin[0, t].double())  # S^T k, per head
            stats[i]["retention"].append(F.cosine_similarity(back, v_lin[0, t].double(), dim=-1).tolist())
            read = torch.einsum("hde,hd->he", S[0].double(), q_lin[0, p].double())
            cos = torch.stack([F.cosine_similarity(read, v_lin[0, a].double(), dim=-1) for a in at])  # [facts, H]
            stats[i]["read_top1"].append((cos.argmax(0) == row.asked).double().tolist())
    for h in hooks:
        h.remove()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    heads = lambda xs, n: [mean([x[j] for x in xs]) for j in range(n)]  # noqa: E731
    layers = {
        str(i): {
            "alpha": rules[i].alphas(),
            "beta_values": mean(s["beta_values"]),
            "beta_other": mean(s["beta_other"]),
            "retention": heads(s["retention"], H[i]),
            "read_top1": heads(s["read_top1"], H[i]),
        }
        for i, s in stats.items()
    }
    return {
        "layers": layers,
        "rows": rows,
        "distance": distance,
        "logit_gain": mean(whole["logit_gain"]),
        "accuracy": mean(whole["correct"]),
        "accuracy_knocked_out": mean(whole["correct_knocked_out"]),
    }


def extras(out: Path, cfg) -> tuple[dict, dict, float]:
    """The backbone's rows (window, full attention), the probes and their time (s), computed once
    per results directory and kept in ``<out>/extras.json`` (the FedNL runs' seed 0 must exist)."""
    cached = out / "extras.json"
    if cached.is_file():
        e = json.loads(cached.read_text())
        return e["backbone"], e["probe"], e["seconds"]
    t0 = time.perf_counter()
    bb = backbone_rows(cfg, {"backbone window": cfg.model.attention_window, "backbone full attention": 0})
    fednl = runs_of(out, "fednl")
    pr = {"fednl (seed 0), its memory layers": probe(fednl[0], cfg)} if fednl else {}
    pr["backbone, fresh memory on every layer"] = probe(None, cfg)
    seconds = round(time.perf_counter() - t0, 1)
    cached.write_text(json.dumps({"backbone": bb, "probe": pr, "seconds": seconds}) + "\n")
    return bb, pr, seconds


def knocked_out(out: Path, label: str, dirs: list[Path]) -> list[dict[str, dict[str, float]]]:
    """Per seed, {client: held-out metrics} of a FedNL variant's clients with every memory knocked
    out (nestfed.experiments.run_models), kept in ``<out>/knocked_out_<label>.json``."""
    from nestfed.experiments.run_models import client_evaluations

    cached = out / f"knocked_out_{label.replace(' ', '_')}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    got = [client_evaluations(d, knocked_out=True) for d in dirs]
    cached.write_text(json.dumps(got) + "\n")
    return got


def client_tokens(run_dir: Path) -> float:
    """Labelled tokens one client trained on over the run (the mean over clients)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per: dict[str, float] = {}
    for line in lines:
        for c, v in line.get("clients", {}).items():
            per[c] = per.get(c, 0.0) + float(v.get("metrics", {}).get("train_tokens", 0.0))
    return sum(per.values()) / max(len(per), 1)


def summarise(out: Path, path: Path | None, config: Path) -> dict:
    from nestfed.experiments.accuracy_report import by_group, final_groups, of_groups, paired_points
    from nestfed.methods import load_config

    cfg = load_config(config)
    o = cfg.section("fednl")
    res: dict = {
        "bench": "fednl_recall",
        "command": f"bench/studies/fednl_recall.py run --seeds 3 --config {config.relative_to(ROOT)} && summarise",
        "config": str(config.relative_to(ROOT)),
        "window": cfg.model.attention_window,
        "sinks": cfg.model.attention_sinks,
        "chance_within_kind": 1 / 8,
        "chance_within_row": 1 / cfg.section("recall").facts,
        "recipe": {
            "alpha_init": o.alpha_init,
            "rule_lr": o.rule_lr,
            "window_dropout": o.window_dropout,
            "warmup_steps": o.warmup_steps,
            "loss": cfg.section("recall").loss,
            "steps": cfg.federation.rounds * cfg.train.local_steps,
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "methods": {},
    }
    per: dict[str, list] = {}
    losses: dict[str, list] = {}
    for label in VARIANTS:
        dirs = runs_of(out, label)
        if not dirs:
            continue
        per[label] = [final_groups(d) for d in dirs]
        losses[label] = [final_groups(d, "loss") for d in dirs]
        s = [json.loads((d / "summary.json").read_text()) for d in dirs]
        res["methods"][label] = {
            "runs": [str(d) for d in dirs],
            "groups": by_group(per[label], group_order),
            "clients": per[label],
            "loss_groups": by_group(losses[label], group_order),
            "gates": [gates(d) for d in dirs] if label != "fedavg" else [],
            "bytes_up_per_client_round": s[0]["bytes_up_per_client_round"],
            "bytes_down_per_client_round": s[0]["bytes_down_per_client_round"],
            "wall_time_s": [x.get("wall_time_s") for x in s],
            "train_tokens_per_client": client_tokens(dirs[0]),
            "warmup": s[0].get("fednl_warmup"),
        }
        if label != "fedavg":
            ko = knocked_out(out, label, dirs)
            acc = [of_groups(e) for e in ko]
            losses[f"{label}, memory knocked out"] = [of_groups(e, "loss") for e in ko]
            res["methods"][f"{label}, memory knocked out"] = {
                "groups": by_group(acc, group_order),
                "clients": acc,
                "loss_groups": by_group(losses[f"{label}, memory knocked out"], group_order),
            }
    bb, res["probe"], res["backbone_eval_s"] = extras(out, cfg)
    for label, clients in bb.items():
        res["methods"][label] = {"groups": by_group([clients], group_order), "clients": [clients]}
    if "fedavg" in per:
        res["versus_fedavg"] = {
            label: paired_points(per[label], per["fedavg"], group_order) for label in per if label != "fedavg"
        }
        res["loss_versus_fedavg"] = {
            label: paired_points(v, losses["fedavg"], group_order, scale=1.0)
            for label, v in losses.items()
            if label != "fedavg"
        }
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1) + "\n")
    return res


def table(res: dict) -> str:
    """Markdown: accuracy (%) per group for every method (mean ± 95% over seeds), bytes up, the
    range of the learned gates over layers, heads and seeds, the labelled tokens a client trained
    on and each seed's wall time; then each method against FedAvg
    (points, paired over seeds and clients; bold = significant)."""
    from nestfed.experiments.accuracy_report import cell, points

    methods = res["methods"]
    groups = list(next(iter(methods.values()))["groups"])
    heads = [heading(g, res["window"]) for g in groups]
    lines = markdown_table(
        ["method", *heads, "KB up/client/round", "gate alpha", "train tokens / client", "wall s / seed"]
    )
    for label, m in methods.items():
        kb = m.get("bytes_up_per_client_round")
        alphas = [a for g in m.get("gates", []) for heads in g.values() for a in _as_list(heads)]
        alpha = f"{min(alphas):.4f}-{max(alphas):.4f}" if alphas else "-"
        cells = [cell(m["groups"][g]) for g in groups]
        tokens = f"{m['train_tokens_per_client']:,.0f}" if m.get("train_tokens_per_client") else "-"
        walls = [w for w in m.get("wall_time_s") or [] if w]
        wall = " / ".join(f"{w:.0f}" for w in walls) if walls else "-"
        lines.append(markdown_row([label, *cells, "-" if kb is None else f"{kb / 1000:.1f}", alpha, tokens, wall]))
    out = "\n".join(lines) + "\n"
    if res.get("versus_fedavg"):
        rows = [[label, *(points(v[g]) for g in groups)] for label, v in res["versus_fedavg"].items()]
        out += "\n" + "\n".join(markdown_table(["vs fedavg (points)", *heads], rows)) + "\n"
    return out


def loss_table(res: dict) -> str:
    """Markdown: the answer's NLL (nats; lower is better) per group for every method with it (mean
    ± 95% over seeds), then each against FedAvg (nats, paired over seeds and clients; bold =
    significant). Finer than accuracy: it moves before the argmax does."""
    from nestfed.experiments.accuracy_report import points

    methods = {k: m for k, m in res["methods"].items() if m.get("loss_groups")}
    groups = list(next(iter(methods.values()))["loss_groups"])
    heads = [heading(g, res["window"]) for g in groups]
    lines = markdown_table(["answer NLL (nats)", *heads])
    for label, m in methods.items():
        cells = []
        for g in groups:
            x = m["loss_groups"][g]
            cells.append(f"{x['mean']:.2f}" + (f" ± {x['half']:.2f}" if len(x["seeds"]) > 1 else ""))
        lines.append(markdown_row([label, *cells]))
    out = "\n".join(lines) + "\n"
    if res.get("loss_versus_fedavg"):
        rows = [[label, *(points(v[g], 2) for g in groups)] for label, v in res["loss_versus_fedavg"].items()]
        out += "\n" + "\n".join(markdown_table(["vs fedavg (nats)", *heads], rows)) + "\n"
    return out


def _as_list(x) -> list[float]:
    return x if isinstance(x, list) else [x]


def heading(group: str, window: int) -> str:
    """``own@160`` -> ``own, 160 (+96)``: the kind, the distance and how far past the window."""
    tag, d = group.split("@")
    past = int(d) - window
    return f"{tag.replace('_', '-')}, {d} ({'inside' if past <= 0 else f'+{past}'})"


def probe_table(res: dict) -> str:
    """Markdown: the memory probe per layer (trained and fresh rules): per-head values as
    ``mean (best head)``."""
    head = ["model", "layer", "alpha per head", "beta at values / elsewhere", "retention cos(S^T k, v)"]
    lines = markdown_table([*head, "read top-1 (chance 25%)"])
    for label, p in res["probe"].items():
        layers = p.get("layers", p)  # issue 24's results hold the layers at the top
        for i, x in layers.items():
            a = "-" if x["alpha"] is None else " / ".join(f"{v:.2f}" for v in _as_list(x["alpha"]))
            ret, read = _as_list(x["retention"]), _as_list(x["read_top1"])
            beta = f"{x['beta_values']:.3f} / {x['beta_other']:.3f}"
            retention = f"{sum(ret) / len(ret):.3f} ({max(ret):.3f})"
            top1 = f"{100 * sum(read) / len(read):.0f}% ({100 * max(read):.0f}%)"
            lines.append(markdown_row([label, i, a, beta, retention, top1]))
    return "\n".join(lines) + "\n"


def contribution_table(res: dict) -> str:
    """Markdown: per probed model, the gold value's logit gain from the memory (with minus knocked
    out) and the accuracy on the probe's rows with and without it."""
    head = ["model", "rows at distance", "gold logit gain from the memory", "accuracy", "knocked out"]
    rows = [
        [label, f"{p['rows']} at {p['distance']}", f"{p['logit_gain']:+.3f}", f"{100 * p['accuracy']:.0f}%"]
        + [f"{100 * p['accuracy_knocked_out']:.0f}%"]
        for label, p in res["probe"].items()
        if "logit_gain" in p
    ]
    return "\n".join(markdown_table(head, rows)) + "\n"


LAYER_SETS = {  # label: the decoder layers given full attention (every other layer keeps the window)
    "none (the window everywhere)": [],
    "top 4 (26-29), FedNL's memory layers": [26, 27, 28, 29],
    "top 8 (22-29)": list(range(22, 30)),
    "top 15 (15-29)": list(range(15, 30)),
    "bottom 15 (0-14)": list(range(15)),
    "every layer": list(range(30)),
}


def layers(config: Path, path: Path | None) -> dict:
    """Where must a memory sit to help? The backbone with full attention in some layers only and
    the window (with its sinks) in the others, on the recall test rows: a memory in layers L can at
    best give what full attention in L gives. Writes the results JSON (``bench: fednl_recall``,
    ``layer_sets``)."""
    from nestfed.data.recall import recall_client_data
    from nestfed.evaluation.lm import evaluate_lm
    from nestfed.experiments.accuracy_report import by_group
    from nestfed.methods import load_config
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.bounded_attention import bounded_layers

    cfg = load_config(config)
    bb = load_backbone(cfg.model)
    clients, _ = recall_client_data(cfg, bb.tokenizer)
    bounds = bounded_layers(bb.model)
    t0 = time.perf_counter()
    res = {
        "bench": "fednl_recall",
        "command": f"bench/studies/fednl_recall.py layers --config {config.relative_to(ROOT)}",
        "window": cfg.model.attention_window,
        "sinks": cfg.model.attention_sinks,
        "methods": {},
    }
    for label, full in LAYER_SETS.items():
        for i, b in bounds.items():
            b.window, b.sink = (0, 0) if i in full else (cfg.model.attention_window, cfg.model.attention_sinks)
        clients_acc = {
            str(cid): {
                g: evaluate_lm(bb.model, d.test_labels[idx], d.test_ids[idx], batch_size=8, letter_ids=d.letter_ids)[
                    "accuracy"
                ]
                for g, idx in d.test_groups.items()
            }
            for cid, d in clients.items()
        }
        res["methods"][f"full attention in: {label}"] = {
            "groups": by_group([clients_acc], group_order),
            "clients": [clients_acc],
        }
        print(
            label,
            json.dumps(
                {
                    g: round(100 * x["mean"], 1)
                    for g, x in res["methods"][f"full attention in: {label}"]["groups"].items()
                }
            ),
            flush=True,
        )
    res["seconds"] = round(time.perf_counter() - t0, 1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--only", nargs="*", default=[], help="variant labels (default: all)")
    r.add_argument("--config", type=Path, default=CONFIG)
    s = sub.add_parser("summarise")
    s.add_argument("out", type=Path)
    s.add_argument("--json", type=Path, default=None)
    s.add_argument("--config", type=Path, default=CONFIG)
    la = sub.add_parser("layers", help="full attention in some layers only: where a memory could help")
    la.add_argument("--json", type=Path, default=None)
    la.add_argument("--config", type=Path, default=CONFIG)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.out, a.seeds, a.only, a.config.resolve())
    elif a.cmd == "layers":
        print(table(layers(a.config.resolve(), a.json)))
    else:
        res = summarise(a.out, a.json, a.config.resolve())
        print(table(res))
        print(probe_table(res))
        print(contribution_table(res))


if __name__ == "__main__":
    main()
