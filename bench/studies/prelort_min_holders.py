"""PreLort's ``[prelort] min_holders``, measured from stored runs: a segment of the global adapter
held by fewer than ``min_holders`` clients of the federation is left out of every deployed and
exported adapter (nestfed.methods.prelort.strategy.deploy_cap). Training and aggregation are the
paper's, unchanged, so a run with the option ends at the same global adapter as the stored PreLort
run, and each client's deployed adapter is that adapter truncated to min(r_k, cap): its held-out
perplexity is the stored run's truncation curve at that rank for that client (exact under
``fixed`` scaling, where s does not depend on r; tests/methods/test_prelort_variants.py checks a
real run against it). The rows written are comparison rows (nestfed.experiments.report), so
``nestfed compare``'s Markdown gives the paired intervals against PreLort and ZeroPad.

    .venv/bin/python bench/studies/prelort_min_holders.py bench/results/main_job_seeds/comparison.json 2 \
        --out bench/results/main_job_seeds/min_holders.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from nestfed.experiments.comparison import markdown
from nestfed.methods.prelort.strategy import deploy_cap


def with_min_holders(row: dict, min_holders: int) -> dict:
    """A stored PreLort comparison row as the same run with ``min_holders``: each client's
    perplexity and the truncation curve at ranks above the cap read at the cap."""
    ranks = [int(r) for r in str(row["ranks"]).split(",")]
    cap = deploy_cap({str(c): r for c, r in enumerate(ranks)}, min_holders)
    curve = row["truncation"]
    out = copy.deepcopy(row)
    out["label"] = f"prelort min_holders={min_holders}"
    out["run"] = f"{row['run']} (min_holders={min_holders}: deployed at min(r_k, {cap}))"
    for cid, r in enumerate(ranks):
        out["ppl"][str(cid)] = curve[str(min(r, cap))][str(cid)]["ppl"]
    out["mean_ppl"] = sum(out["ppl"].values()) / len(out["ppl"])
    out["truncation"] = {r: curve[str(min(int(r), cap))] for r in curve}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("comparison", type=Path, help="a stored comparison.json with PreLort and ZeroPad rows")
    ap.add_argument("min_holders", type=int, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = json.loads(args.comparison.read_text())
    keep = [r for r in rows if r["label"] in ("prelort", "zeropad")]
    for m in args.min_holders:
        keep += [with_min_holders(r, m) for r in rows if r["label"] == "prelort"]
    for r in keep:  # the stored rows are exactly reproduced where the cap is r_max
        if r["label"] == "prelort":
            for cid, rk in enumerate(str(r["ranks"]).split(",")):
                assert r["truncation"][str(rk)][str(cid)]["ppl"] == r["ppl"][str(cid)], (r["run"], cid)
    args.out.write_text(json.dumps(keep, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(keep, "prelort"))
    print(json.dumps({"bench": "prelort_min_holders", "rows": len(keep), "wall_s": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
