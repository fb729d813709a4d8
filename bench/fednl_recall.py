"""FedNL where only a memory can help: associative recall beyond the attention window (issue 24,
item 2; configs/fednl/recall.toml, nestfed.data.recall).

Every layer's softmax attention sees the last 64 tokens plus 4 sinks (``model.attention_window``)
for every method; a row states four facts of one kind and asks about one of them 60 (inside the
window) to 320 tokens later. Four clients (one kind each) and a held-out kind (metal) every client is tested on.

``run`` trains, over ``--seeds`` seeds, FedNL with both travel modes (``all``: LoRA and the memory
rules; ``rules``: the rules only), FedAvg and FedNL's local-only baseline (``travel = "none"``),
all with the same window, through ``nestfed run``; ``summarise`` reads their final evaluations,
evaluates the backbone with the window (the floor) and with full attention (the ceiling), probes
the memory of a trained FedNL model, and writes the results JSON::

    .venv/bin/python bench/fednl_recall.py run --out /tmp/recall --seeds 3      # about 80 minutes on 2 cores
    .venv/bin/python bench/fednl_recall.py summarise /tmp/recall --json bench/results/fednl_recall/recall.json

Reported: accuracy (the argmax over the five kinds' 40 value tokens; a model that knows the kind
but not the fact scores 1/8) per group own@<distance> / held_out@<distance>, mean over clients,
mean ± 95% t half width over seeds; each method against FedAvg over the (seed, client) pairs in
percentage points; the learned gate alpha of every memory layer; bytes per client per round;
and the probe (:func:`probe`): is the memory written (beta at the facts' values, and how much of
a stored value S still returns for its key at the question) and is it read (which fact's value
the memory's read-out at the question is closest to).
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

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "fednl" / "recall.toml"
VARIANTS = {  # label: (nestfed run --methods, extra --set)
    "fednl": ("fednl", []),
    "fednl rules": ("fednl", ["fednl.travel=rules"]),
    "fednl local-only": ("fednl", ["fednl.travel=none"]),
    "fedavg": ("fedavg", []),
}


def run(out: Path, seeds: int, only: list[str]) -> None:
    """Train every variant (``nestfed run ... --seeds``) under ``out/<label>``."""
    for label, (method, sets) in VARIANTS.items():
        if only and label not in only:
            continue
        d = out / label.replace(" ", "_")
        cmd = [
            str(Path(sys.executable).parent / "nestfed"),
            "run",
            str(CONFIG),
            "--methods",
            method,
            "--seeds",
            str(seeds),
        ]
        cmd += [x for s in [*sets, f"output.dir={d}"] for x in ("--set", s)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(json.dumps({"variant": label, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


def runs_of(out: Path, label: str) -> list[Path]:
    """The seed run directories of one variant (``<out>/<label>/<parent>/seed<i>/<method>``)."""
    return sorted(p.parent for p in (out / label.replace(" ", "_")).glob("*/seed*/*/summary.json"))


def final_groups(run_dir: Path) -> dict[str, dict[str, float]]:
    """{client: {group: accuracy}} of a run's last evaluation (``accuracy@<group>`` metrics)."""
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        c: {k.split("@", 1)[1]: v for k, v in m.items() if k.startswith("accuracy@")} for c, m in s["final"].items()
    }


def gates(run_dir: Path) -> dict[str, float]:
    """{memory layer: alpha = sigmoid(gate_logit)} of a run's final rules: the global ones, or the
    mean over clients of the rules each kept (local-only); empty without a learned gate."""
    from nestfed.federation.run_dir import RunDir

    ck = RunDir(run_dir).latest_checkpoint(True)
    kept = [a for s in (ck.client_state or {}).values() for a in s.values()]
    sets = [a for a in kept if any(k.endswith("memory.gate_logit") for k in a)] or [ck.state.arrays]
    out: dict[str, list[float]] = {}
    for arrays in sets:
        for k, v in sorted(arrays.items()):
            if k.endswith("memory.gate_logit"):
                out.setdefault(k.split(".layers.")[1].split(".")[0], []).append(float(torch.sigmoid(v.double())))
    return {layer: sum(v) / len(v) for layer, v in out.items()}


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


def summary_rows(per_seed: list[dict[str, dict[str, float]]]) -> dict:
    """Mean over clients per group for each seed, then mean ± 95% over seeds."""
    from nestfed.experiments.intervals import mean_interval

    groups = sorted({g for s in per_seed for c in s.values() for g in c}, key=group_order)
    out = {}
    for g in groups:
        means = [sum(c[g] for c in s.values()) / len(s) for s in per_seed]
        i = mean_interval(means)
        out[g] = {"mean": i.mean, "half": i.half_width, "seeds": means}
    return out


def group_order(g: str) -> tuple[int, int]:
    tag, d = g.split("@")
    return (0 if tag == "own" else 1, int(d))


def versus(method: list[dict], reference: list[dict]) -> dict:
    """Paired differences in accuracy points over the (seed, client) pairs, per group."""
    from nestfed.experiments.intervals import paired_difference

    out = {}
    for g in sorted(method[0]["0"], key=group_order):
        diffs = [100 * (m[c][g] - r[c][g]) for m, r in zip(method, reference) for c in m]
        d = paired_difference(diffs)
        out[g] = {"mean_pts": d.interval.mean, "low": d.interval.low, "high": d.interval.high, "p": d.p_value}
    return out


# ----------------------------------------------------------------------------- the memory probe


@torch.no_grad()
def probe(run_dir: Path | None, cfg, rows: int = 16, distance: int = 160) -> dict:
    """Is the memory written, and is it read? For ``rows`` test rows of the clients' kinds at
    ``distance``, per layer, from the layer's own q, k, v projections (after LoRA) as the memory
    sees them (q_lin, k_lin, v_lin: nestfed.nn.memory) and the delta rule run over the row up to
    the question: ``beta`` at the facts' value tokens and elsewhere (the write strengths);
    ``retention``: cos(S^T k_v, v_v) at the question for the asked value's own key (1 = the write
    intact; later writes erode it); ``read_top1``: how often the read-out S^T q at the question is
    closest (cosine, mean over heads) to the asked fact's value among the row's facts (chance
    1 / facts); ``alpha``: the gate. ``run_dir``: a finished FedNL run (its final adapter and rules,
    its memory layers); None: the backbone with an untrained memory (beta = 0.5) on every layer,
    which says where in the network the projections could carry the recall at all."""
    from nestfed.config import r_max
    from nestfed.data.niah import Haystack
    from nestfed.data.recall import make_row
    from nestfed.data.sources import long_texts
    from nestfed.federation.run_dir import RunDir
    from nestfed.methods.fednl.setup import memory_settings
    from nestfed.nn.arrays import apply_arrays
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.bounded_attention import attention_modules
    from nestfed.nn.lora import inject_lora
    from nestfed.nn.memory import install_memory, memory_inputs, memory_rules, sync_memory
    from nestfed.ops.delta_rule import delta_rule

    bb = load_backbone(cfg.model)
    model = bb.model
    rules = {}
    if run_dir is not None:
        inject_lora(model, cfg.lora.target_modules, r_max(cfg), cfg.lora.lora_alpha / r_max(cfg), cfg.lora.layers)
        install_memory(model, memory_settings(cfg), cfg.section("fednl").layers or cfg.lora.layers)
        arrays = RunDir(run_dir).latest_checkpoint().state.arrays
        apply_arrays(model, arrays, cfg.lora.lora_alpha / r_max(cfg))
        sync_memory(model, arrays)
        rules = memory_rules(model)
    attns = attention_modules(model)
    layers = sorted(rules) if rules else sorted(attns)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    for i in layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attns[i], name).register_forward_hook(
                lambda m, args, out, _key=(i, name): seen.__setitem__(_key, out.detach())
            )
    o = cfg.section("recall")
    hay = Haystack([x.text for x in long_texts(o.haystack)], bb.tokenizer, "test")
    stats = {i: {"beta_values": [], "beta_other": [], "retention": [], "read_top1": []} for i in layers}
    rng = random.Random(f"probe/{distance}")
    for n in range(rows):
        row = make_row(o.kinds[n % len(o.kinds)], bb.tokenizer, hay, rng, distance, o.facts, o.lead)
        ids = torch.tensor([row.ids[:-1]])
        model(input_ids=ids)
        p = ids.shape[1] - 1  # the predicting position
        at = list(row.values_at)
        for i in layers:
            D = attns[i].head_dim
            q, k, v = (seen[(i, x)].view(1, ids.shape[1], -1, D) for x in ("q_proj", "k_proj", "v_proj"))
            q_lin, k_lin, v_lin = memory_inputs(q, k, v)
            beta = rules[i].beta(k) if i in rules else torch.full(q.shape[:3], 0.5)  # [1, T, H]
            _, S = delta_rule(q_lin, k_lin, v_lin, beta, output_final_state=True)  # [1, H, D, D]
            other = torch.ones(beta.shape[1], dtype=torch.bool)
            other[at] = False
            stats[i]["beta_values"].append(float(beta[0, at].mean()))
            stats[i]["beta_other"].append(float(beta[0, other].mean()))
            t = at[row.asked]
            back = torch.einsum("hde,hd->he", S[0].double(), k_lin[0, t].double())  # S^T k, per head
            stats[i]["retention"].append(float(F.cosine_similarity(back, v_lin[0, t].double(), dim=-1).mean()))
            read = torch.einsum("hde,hd->he", S[0].double(), q_lin[0, p].double())
            cos = torch.stack([F.cosine_similarity(read, v_lin[0, a].double(), dim=-1).mean() for a in at])
            stats[i]["read_top1"].append(float(int(cos.argmax()) == row.asked))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        str(i): {"alpha": rules[i].alpha_value() if i in rules else None, **{k: mean(v) for k, v in s.items()}}
        for i, s in stats.items()
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
    pr["backbone, untrained memory on every layer"] = probe(None, cfg)
    seconds = round(time.perf_counter() - t0, 1)
    cached.write_text(json.dumps({"backbone": bb, "probe": pr, "seconds": seconds}) + "\n")
    return bb, pr, seconds


def summarise(out: Path, path: Path | None) -> dict:
    from nestfed.methods import load_config

    cfg = load_config(CONFIG)
    res: dict = {
        "bench": "fednl_recall",
        "command": "bench/fednl_recall.py run --seeds 3 && bench/fednl_recall.py summarise",
        "config": str(CONFIG.relative_to(ROOT)),
        "window": cfg.model.attention_window,
        "sinks": cfg.model.attention_sinks,
        "chance_within_kind": 1 / 8,
        "chance_within_row": 1 / cfg.section("recall").facts,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "methods": {},
    }
    per: dict[str, list] = {}
    for label in VARIANTS:
        dirs = runs_of(out, label)
        if not dirs:
            continue
        per[label] = [final_groups(d) for d in dirs]
        s = [json.loads((d / "summary.json").read_text()) for d in dirs]
        res["methods"][label] = {
            "runs": [str(d) for d in dirs],
            "groups": summary_rows(per[label]),
            "clients": per[label],
            "gates": [gates(d) for d in dirs] if label != "fedavg" else [],
            "bytes_up_per_client_round": s[0]["bytes_up_per_client_round"],
            "bytes_down_per_client_round": s[0]["bytes_down_per_client_round"],
            "wall_time_s": [x.get("wall_time_s") for x in s],
        }
    bb, res["probe"], res["backbone_eval_s"] = extras(out, cfg)
    for label, clients in bb.items():
        res["methods"][label] = {"groups": summary_rows([clients]), "clients": [clients]}
        per[label] = [clients]
    if "fedavg" in per:
        res["versus_fedavg"] = {
            label: versus(per[label], per["fedavg"]) for label in per if label in VARIANTS and label != "fedavg"
        }
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1) + "\n")
    return res


def table(res: dict) -> str:
    """Markdown: accuracy (%) per group for every method (mean ± 95% over seeds), bytes up and the
    range of the learned gates over layers and seeds; then each method against FedAvg (points,
    paired over seeds and clients; bold = significant)."""
    methods = res["methods"]
    groups = list(next(iter(methods.values()))["groups"])
    head = (
        "| method | " + " | ".join(heading(g, res["window"]) for g in groups) + " | KB up/client/round | gate alpha |"
    )
    lines = [head, "|---|" + "---|" * (len(groups) + 2)]
    for label, m in methods.items():
        cells = []
        for g in groups:
            x = m["groups"][g]
            cells.append(f"{100 * x['mean']:.1f}" + (f" ± {100 * x['half']:.1f}" if len(x["seeds"]) > 1 else ""))
        kb = m.get("bytes_up_per_client_round")
        alphas = [a for g in m.get("gates", []) for a in g.values()]
        alpha = f"{min(alphas):.4f}-{max(alphas):.4f}" if alphas else "-"
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {'-' if kb is None else f'{kb / 1000:.1f}'} | {alpha} |"
        )
    out = "\n".join(lines) + "\n"
    if res.get("versus_fedavg"):
        lines = [
            "| vs fedavg (points) | " + " | ".join(heading(g, res["window"]) for g in groups) + " |",
            "|---|" + "---|" * len(groups),
        ]
        for label, v in res["versus_fedavg"].items():
            cells = []
            for g in groups:
                d = v[g]
                s = f"{d['mean_pts']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"
                cells.append(f"**{s}**" if d["low"] > 0 or d["high"] < 0 else s)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        out += "\n" + "\n".join(lines) + "\n"
    return out


def heading(group: str, window: int) -> str:
    """``own@160`` -> ``own, 160 (+96)``: the kind, the distance and how far past the window."""
    tag, d = group.split("@")
    past = int(d) - window
    return f"{tag.replace('_', '-')}, {d} ({'inside' if past <= 0 else f'+{past}'})"


def probe_table(res: dict) -> str:
    """Markdown: the memory probe per layer (trained and fresh rules)."""
    lines = [
        "| model | layer | alpha | beta at values / elsewhere | retention cos(S^T k, v) | read top-1 (chance 25%) |",
        "|---|---|---|---|---|---|",
    ]
    for label, layers in res["probe"].items():
        for i, p in layers.items():
            a = "-" if p["alpha"] is None else f"{p['alpha']:.3f}"
            lines.append(
                f"| {label} | {i} | {a} | {p['beta_values']:.3f} / {p['beta_other']:.3f} | "
                f"{p['retention']:.3f} | {100 * p['read_top1']:.0f}% |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--only", nargs="*", default=[], help="variant labels (default: all)")
    s = sub.add_parser("summarise")
    s.add_argument("out", type=Path)
    s.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.out, a.seeds, a.only)
    else:
        res = summarise(a.out, a.json)
        print(table(res))
        print(probe_table(res))


if __name__ == "__main__":
    main()
