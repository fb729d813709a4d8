"""Does a low-rank client gain a skill that only the high-rank clients' data hold?

A capability check for PreLort's claim that low-rank clients gain from high-rank ones
(docs/results.md, the claims table and "The long cross-device protocol"): a setting built so that
only the transfer can help. One linear layer W0 = 0 [D, D], D = 32, and one target map T = T_own +
T_skill that every client wants (two rank-1 shifts, unit Frobenius norm each):

- T_own reads the first 16 input coordinates, T_skill the last 16;
- the clients of rank < ``skill_rank`` see inputs x ~ N(0, I) on the first 16 coordinates only
  (zero elsewhere), so their data say nothing about T_skill; the clients of rank >= ``skill_rank``
  see half their batch there and half on the last 16 coordinates.

30 clients at ranks 2/4/8/16 (12/9/6/3, the cross-device protocol's 40/30/20/10%), all of them
every round; a global adapter of R = 16 (A uniform in +-1/sqrt(D), B = 0, lora_alpha = R, so
s = 1 at every rank); each client runs Adam on its payload's trainable part for ``steps`` steps of
batch 64 against T (its strategy's objective: PreLort's clients the mean over their ``subranks``
of the rank-p prefix's loss, every other the plain loss), and the round ends with the strategy's
own `aggregate`. Each payload is the strategy's own `configure` and what a client runs is its own
`deploy`, so the rules are nestfed's.

Reported per rule and round, for what a rank-2 client runs (``deploy(state, cid)``):
``skill`` = ||(s B A - T) P_skill||_F / ||T_skill||_F, its error on the skill inputs (1: the
skill is absent, 0: learned), and ``own`` the same on its own inputs; and ``skill_full`` for the
full global adapter (``deploy(state)``). A rank-2 client training alone never learns the skill:
its data never reach those inputs, so its error there stays at 1 or above (1.10 after 100 steps). Each seed draws the
shifts, the initial A and the clients' data afresh; the table gives the mean ± the 95% t half width
over seeds. Prints one JSON line per (steps, rule, seed) and the table; ``--json`` writes all::

    .venv/bin/python bench/studies/rank_transfer.py --steps 3 10 20 50 100 --seeds 3 \
        --json bench/results/cross_device_long/rank_transfer.json

About 4 minutes on one core (the 100-step settings most of it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from nestfed.experiments.intervals import mean_interval
from nestfed.federation.messages import ClientInfo, GlobalState
from nestfed.federation.strategy import LoraSettings, LoraStrategy
from nestfed.io.atomic import write_json
from nestfed.io.markdown import markdown_row, markdown_table
from nestfed.methods.fed_plora.strategy import FedPLoRA
from nestfed.methods.prelort.strategy import PreLort
from nestfed.methods.raflora.strategy import RaFLoRA
from nestfed.methods.zeropad.strategy import ZeroPad

#: bench/studies/shared_shift.py, loaded by its path (bench/ is not a package): the layer, the clients'
#: ranks, the initial adapter and the local training are its
_SPEC = importlib.util.spec_from_file_location("bench_shared_shift", Path(__file__).with_name("shared_shift.py"))
shared_shift = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(shared_shift)
D, R, RANKS, KEY_A, KEY_B = shared_shift.D, shared_shift.R, shared_shift.RANKS, shared_shift.KEY_A, shared_shift.KEY_B
HALF = 16
RULES = {"prelort": PreLort, "zeropad": ZeroPad, "raflora": RaFLoRA, "fed_plora": FedPLoRA}


def shifts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T_own and T_skill: [D, D] each, rank 1, unit Frobenius norm, reading disjoint input halves."""
    g = torch.Generator().manual_seed(2 * seed)
    out = []
    for cols in (slice(0, HALF), slice(HALF, D)):
        u, v = torch.randn(D, generator=g), torch.zeros(D)
        v[cols] = torch.randn(HALF, generator=g)
        out.append(torch.outer(u, v) / (u.norm() * v.norm()))
    return out[0], out[1]


def inputs(n: int, sees_skill: bool, g: torch.Generator) -> torch.Tensor:
    """x: [n, D], N(0, I) on the first half; with ``sees_skill`` the second half of the rows on the last half."""
    x = torch.zeros(n, D)
    x[:, :HALF] = torch.randn(n, HALF, generator=g)
    if sees_skill:
        x[n // 2 :] = 0.0
        x[n // 2 :, HALF:] = torch.randn(n - n // 2, HALF, generator=g)
    return x


def errors(strategy: LoraStrategy, state: GlobalState, cid: int | None, T: torch.Tensor) -> tuple[float, float]:
    """(own, skill): ||(s B A - T) P|| / ||T P|| of the adapter ``deploy(state, cid)`` on each input half."""
    arrays, s = strategy.deploy(state, cid)
    E = s * arrays[KEY_B] @ arrays[KEY_A] - T
    return tuple(float(E[:, c].norm() / T[:, c].norm()) for c in (slice(0, HALF), slice(HALF, D)))


def federate(rule: str, seed: int, rounds: int, steps: int, lr: float, skill_rank: int) -> list[dict]:
    """``rounds`` rounds of ``rule`` over the 30 clients; one record per round (round 0: before training)."""
    strategy = RULES[rule](LoraSettings(r_max=R, lora_alpha=float(R)))
    T = sum(shifts(seed))
    state = shared_shift.initial(2 * seed + 1)
    low = RANKS.index(2)
    records = []
    for rnd in range(rounds + 1):
        if rnd:
            instructions = strategy.configure(rnd, state, [ClientInfo(k, r, 16) for k, r in enumerate(RANKS)])
            replies = {
                k: shared_shift.train(
                    ins.arrays,
                    ins.config.get("subranks", [ins.arrays[KEY_A].shape[0]]),
                    T,
                    steps,
                    lr,
                    seed=100_000 * seed + 1000 * rnd + k,
                    sample=partial(inputs, 64, RANKS[k] >= skill_rank),
                )
                for k, ins in instructions.items()
            }
            state = strategy.aggregate(rnd, state, replies)
        own, skill = errors(strategy, state, low, T)
        records.append({"round": rnd, "own": own, "skill": skill, "skill_full": errors(strategy, state, None, T)[1]})
    return records


def table(res: dict) -> str:
    """Markdown: per local steps and rule, the rank-2 client's skill error after rounds 1, 2, 5 and
    the last, its own error and the full adapter's skill error after the last (mean ± 95% over seeds)."""
    last = res["rounds"]
    shown = [t for t in (1, 2, 5) if t < last] + [last]
    head = ["local steps", "rule", *(f"rank 2, skill, round {t}" for t in shown), f"rank 2, own, round {last}"]
    lines = markdown_table([*head, f"full adapter, skill, round {last}"])

    def cell(runs: list[dict], t: int, key: str) -> str:
        return mean_interval([r["by_round"][t][key] for r in runs]).text()

    for steps in res["steps"]:
        for rule in res["rules"]:
            runs = [r for r in res["runs"] if r["steps"] == steps and r["rule"] == rule]
            cells = [cell(runs, t, "skill") for t in shown] + [cell(runs, last, "own"), cell(runs, last, "skill_full")]
            lines.append(markdown_row([steps, rule, *cells]))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, nargs="+", default=[10])
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--skill-rank", type=int, default=8, help="the clients of this rank and above see the skill")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    p.add_argument("--json", type=Path, default=None, help="write every run and the settings here")
    args = p.parse_args()
    if args.skill_rank not in RANKS or args.skill_rank <= 2:
        p.error(f"--skill-rank must be one of the ranks above 2 ({sorted(set(RANKS) - {2})}), got {args.skill_rank}")
    if min(args.rounds, *args.steps, args.seeds) < 1:
        p.error("--rounds, --steps and --seeds must be >= 1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = []
    for steps in args.steps:
        for rule in args.rules:
            for seed in range(args.seeds):
                run = {"rule": rule, "steps": steps, "seed": seed}
                run["by_round"] = federate(rule, seed, args.rounds, steps, args.lr, args.skill_rank)
                runs.append(run)
                print(json.dumps(run), flush=True)
    res = {
        "bench": "rank_transfer",
        "command": " ".join(["bench/studies/rank_transfer.py", *sys.argv[1:]]),
        "rounds": args.rounds,
        "steps": args.steps,
        "lr": args.lr,
        "seeds": args.seeds,
        "skill_rank": args.skill_rank,
        "ranks": RANKS,
        "rules": args.rules,
        "wall_s": time.perf_counter() - t0,
        "runs": runs,
    }
    if args.json:
        write_json(args.json, res)
    print(table(res))


if __name__ == "__main__":
    main()
