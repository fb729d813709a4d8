"""FedNL's claim in miniature (issue 32, item 6): federated multi-query associative recall past the
window, with a key/value vocabulary of its own per client and a held-out vocabulary
(configs/fednl/mqar.toml, nestfed.data.mqar; the backbone tiny-llama-mqar, pretrained here once
with full attention, then frozen).

``run`` trains, over ``--seeds`` seeds (``federation.seed`` and ``lora.init_seed``; the clients'
rows are the same every seed), through ``nestfed run``: FedNL with everything travelling, with only
the rules travelling, local-only (``fednl.travel = "none"``), FedAvg on the window-only model, and
FedAvg with full attention (``model.attention_window = 0``, the ceiling). ``summarise`` reads their
final evaluations, evaluates the frozen backbone with the window and with full attention, every
FedNL model with its memory knocked out, and writes the results JSON::

    .venv/bin/python bench/studies/fednl_mqar.py run --out /tmp/mqar --seeds 3
    .venv/bin/python bench/studies/fednl_mqar.py summarise /tmp/mqar --json bench/results/fednl_mqar.json

Reported: accuracy (%) on the clients' own vocabularies and on the held-out one (argmax over every
vocabulary's values at each queried position; 1/10 for a guess of the right vocabulary), mean
over clients, mean ± 95% over seeds; each method against FedAvg under the window in points,
paired over (seed, client); the gates after training; bytes per client per round; wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from nestfed.io.markdown import markdown_row, markdown_table

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "fednl" / "mqar.toml"
VARIANTS = {  # label: (nestfed run --methods, extra --set)
    "fednl": ("fednl", []),
    "fednl rules": ("fednl", ["fednl.travel=rules"]),
    "fednl local-only": ("fednl", ["fednl.travel=none"]),
    "fedavg, window": ("fedavg", []),
    "fedavg, full attention": ("fedavg", ["model.attention_window=0"]),
}
REFERENCE = "fedavg, window"
LOCAL = "fednl local-only"
GROUPS = ("own", "held_out")


def run(out: Path, seeds: int, only: list[str]) -> None:
    """Train every variant (``nestfed run ... --seeds``) under ``out/<label>``."""
    for label, (method, sets) in VARIANTS.items():
        if only and label not in only:
            continue
        cmd = [str(Path(sys.executable).parent / "nestfed"), "run", str(CONFIG), "--methods", method]
        cmd += ["--seeds", str(seeds)]
        cmd += [x for s in [*sets, f"output.dir={out / slug(label)}"] for x in ("--set", s)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(json.dumps({"variant": label, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


def slug(label: str) -> str:
    return label.replace(", ", "_").replace(" ", "_")


def runs_of(out: Path, label: str) -> list[Path]:
    """The seed run directories of one variant."""
    return sorted(p.parent for p in (out / slug(label)).glob("*/seed*/*/summary.json"))


def gates(run_dir: Path) -> list[float]:
    """Every gate alpha of a run's final rules (the global ones, or each client's kept ones)."""
    import torch

    from nestfed.federation.run_dir import RunDir

    ck = RunDir(run_dir).latest_checkpoint(True)
    kept = [a for s in (ck.client_state or {}).values() for a in s.values()]
    sets = [a for a in kept if any(k.endswith("memory.gate_logit") for k in a)] or [ck.state.arrays]
    return [
        float(x)
        for arrays in sets
        for k, v in sorted(arrays.items())
        if k.endswith("memory.gate_logit")
        for x in torch.sigmoid(v.double())
    ]


def backbone_rows(cfg) -> dict[str, dict[str, dict[str, float]]]:
    """{label: {client: {group: accuracy}}} of the frozen backbone with the window and with full
    attention (no training)."""
    from dataclasses import replace

    from nestfed.data.mqar import mqar_client_data
    from nestfed.evaluation.lm import evaluate_lm
    from nestfed.experiments.pretrained_tiny import ensure_pretrained
    from nestfed.nn.backbone import load_backbone

    ensure_pretrained(cfg.model)
    out = {}
    for label, w in (("backbone, window", cfg.model.attention_window), ("backbone, full attention", 0)):
        bb = load_backbone(replace(cfg.model, attention_window=w))
        clients, _ = mqar_client_data(cfg, bb.tokenizer)
        out[label] = {
            str(cid): {
                g: evaluate_lm(bb.model, d.test_labels[idx], d.test_ids[idx], batch_size=64, letter_ids=d.letter_ids)[
                    "accuracy"
                ]
                for g, idx in d.test_groups.items()
            }
            for cid, d in clients.items()
        }
    return out


def knocked_out(run_dir: Path) -> dict[str, dict[str, float]]:
    """{client: {group: accuracy}} of a FedNL run's clients with every memory knocked out."""
    from nestfed.experiments.run_models import client_evaluations

    ev = client_evaluations(run_dir, knocked_out=True)
    return {c: {k.split("@", 1)[1]: v for k, v in m.items() if k.startswith("accuracy@")} for c, m in ev.items()}


def summarise(out: Path, path: Path | None) -> dict:
    from nestfed.experiments.accuracy_report import by_group, final_groups, paired_points
    from nestfed.methods import load_config

    cfg = load_config(CONFIG)
    t0 = time.perf_counter()
    o = cfg.section("mqar")
    res: dict = {
        "bench": "fednl_mqar",
        "command": "bench/studies/fednl_mqar.py run --seeds 3 && bench/studies/fednl_mqar.py summarise",
        "config": str(CONFIG.relative_to(ROOT)),
        "window": cfg.model.attention_window,
        "task": {
            "pairs": o.pairs,
            "queries": o.queries,
            "gap": o.gap,
            "vocab": o.vocab,
            "clients": cfg.data.num_clients,
        },
        "chance_within_vocabulary": 1 / o.vocab,
        "machine": {"cpu": platform.processor() or platform.machine()},
        "methods": {},
    }
    per: dict[str, list] = {}
    order = GROUPS.index
    for label in VARIANTS:
        dirs = runs_of(out, label)
        if not dirs:
            continue
        per[label] = [final_groups(d) for d in dirs]
        s = [json.loads((d / "summary.json").read_text()) for d in dirs]
        row = {
            "runs": [str(d) for d in dirs],
            "groups": by_group(per[label], order),
            "clients": per[label],
            "bytes_up_per_client_round": s[0]["bytes_up_per_client_round"],
            "wall_time_s": [x.get("wall_time_s") for x in s],
            "train_tokens": sum(
                float(m.get("train_tokens", 0)) for line in _lines(dirs[0]) for m in _client_metrics(line)
            ),
        }
        if label.startswith("fednl"):
            row["gates"] = [gates(d) for d in dirs]
            ko = [knocked_out(d) for d in dirs]
            res["methods"][f"{label}, memory knocked out"] = {"groups": by_group(ko, order), "clients": ko}
            per[f"{label}, memory knocked out"] = ko
        res["methods"][label] = row
    for label, clients in backbone_rows(cfg).items():
        res["methods"][label] = {"groups": by_group([clients], order), "clients": [clients]}
    if REFERENCE in per:
        res["versus_fedavg_window"] = {
            label: paired_points(per[label], per[REFERENCE], order)
            for label in per
            if label != REFERENCE and len(per[label]) == len(per[REFERENCE])
        }
    if LOCAL in per:  # what sharing adds over each client's own memory rule
        res["versus_local_only"] = {
            label: paired_points(per[label], per[LOCAL], order) for label in ("fednl", "fednl rules") if label in per
        }
    res["summarise_s"] = round(time.perf_counter() - t0, 1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1) + "\n")
    return res


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _client_metrics(line: dict) -> list[dict]:
    return [c.get("metrics", {}) for c in line.get("clients", {}).values()]


def table(res: dict) -> str:
    """Markdown: accuracy (%) on the own and the held-out vocabulary per method (mean ± 95% over
    seeds), bytes up, the gates and the training tokens per seed; then each method against FedAvg
    under the window (points, paired over seeds and clients; bold = significant)."""
    from nestfed.experiments.accuracy_report import cell, points

    head = ["method", "own vocabulary", "held-out vocabulary", "KB up/client/round", "gate alpha"]
    lines = markdown_table([*head, "train tokens / seed"])
    ko = ", memory knocked out"
    labels = [x for lab in res["methods"] if not lab.endswith(ko) for x in (lab, lab + ko) if x in res["methods"]]
    for label in labels:
        m = res["methods"][label]
        g = m["groups"]
        kb = m.get("bytes_up_per_client_round")
        alphas = [a for seed in m.get("gates", []) for a in seed]
        alpha = f"{min(alphas):.2f}-{max(alphas):.2f}" if alphas else "-"
        tokens = f"{m['train_tokens']:,.0f}" if m.get("train_tokens") else "-"
        kb_text = "-" if kb is None else f"{kb / 1000:.1f}"
        lines.append(markdown_row([label, cell(g["own"]), cell(g["held_out"]), kb_text, alpha, tokens]))
    out = "\n".join(lines) + "\n"
    if res.get("versus_fedavg_window"):
        rows = [[label, points(v["own"]), points(v["held_out"])] for label, v in res["versus_fedavg_window"].items()]
        head = ["vs fedavg, window (points)", "own vocabulary", "held-out vocabulary"]
        out += "\n" + "\n".join(markdown_table(head, rows)) + "\n"
    if res.get("versus_local_only"):
        rows = [[label, points(v["own"]), points(v["held_out"])] for label, v in res["versus_local_only"].items()]
        head = ["vs fednl local-only (points)", "own vocabulary", "held-out vocabulary"]
        out += "\n" + "\n".join(markdown_table(head, rows)) + "\n"
    return out


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
        print(table(summarise(a.out, a.json)))


if __name__ == "__main__":
    main()
