"""How much of a shift every client wants does one round of each heterogeneous rule add?

A capability check for the long cross-device protocol's Fed-PLoRA instability (docs/results.md,
"The long cross-device protocol"). One linear layer W0 = 0 [d, d] and a target shift T (rank 1,
||T||_F = 1) that every client wants: client data x ~ N(0, I), loss ||s B A x - T x||^2 averaged
over a batch. 30 clients at ranks 2/4/8/16 (12/9/6/3, the protocol's 40/30/20/10%), a global
adapter of R = 16 (A kaiming-uniform-like, B = 0, s = 1), each client running Adam on its own
trainable part for ``steps`` steps, then one aggregation by nestfed's own strategies (each
client's payload is its strategy's `configure`, the server's own path):

- ``fed_plora``: the client trains the modules its selection drew (``random`` or ``prefix``) on top
  of the others folded (`FedPLoRA.configure`'s `fold_payload`), and `FedPLoRA.aggregate` averages each
  module over its holders;
- ``prelort``: the client trains the rank-r_k prefix with the nested objective (the mean over the
  federation's ranks r <= r_k of the loss of the rank-r prefix), `PreLort.aggregate` averages each
  segment over its holders;
- ``zeropad``: the client trains the prefix with the plain loss, `ZeroPad.aggregate` averages the
  zero-padded updates over every client.

Reported per rule: ``share`` = <s B A, T> / ||T||^2 (1: the shift added once; 2: twice) and
``error`` = ||s B A - T|| / ||T|| (1: no better than doing nothing), and the same for one client
alone at r = 2 and 16 (how far the local steps get). Prints JSON::

    .venv/bin/python bench/studies/shared_shift.py --steps 3 10 50 --lr 5e-3

Clients' data and module draws are seeded; 5 minutes for the three settings on a core shared with
a training run. The stored output: bench/results/cross_device_long/shared_shift.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch

from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fed_plora import FedPLoRAOptions
from nestfed.methods.fed_plora.strategy import FedPLoRA
from nestfed.methods.prelort.strategy import PreLort
from nestfed.methods.zeropad.strategy import ZeroPad
from nestfed.nn.keys import merged_key, peft_key

D, R = 32, 16
RANKS = [2] * 12 + [4] * 9 + [8] * 6 + [16] * 3
KEY_A, KEY_B = peft_key("layer", "lora_A"), peft_key("layer", "lora_B")


def target() -> torch.Tensor:
    """T = u v^T / (||u|| ||v||): [D, D], rank 1, unit Frobenius norm."""
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(D, generator=g), torch.randn(D, generator=g)
    return torch.outer(u, v) / (u.norm() * v.norm())


def initial(seed: int = 1) -> GlobalState:
    """The global adapter: A [R, D] uniform in +-1/sqrt(D), B [D, R] zero; every client's rank in meta."""
    g = torch.Generator().manual_seed(seed)
    A = (torch.rand(R, D, generator=g) * 2 - 1) / math.sqrt(D)
    return GlobalState({KEY_A: A, KEY_B: torch.zeros(D, R)}, {"ranks": {str(k): r for k, r in enumerate(RANKS)}})


def train(
    payload: dict,
    subranks: list[int],
    T: torch.Tensor,
    steps: int,
    lr: float,
    seed: int,
    sample: Callable[[torch.Generator], torch.Tensor] | None = None,
) -> Reply:
    """Adam on the payload's trainable A [r, D], B [D, r] against T (its frozen fold added).

    The loss is the mean over ``subranks`` of the loss of the rank-p prefix (one entry: plain LoRA),
    on a batch x [64, D] a step from ``sample`` (default: N(0, I)).
    """
    a, b = payload[KEY_A].clone().requires_grad_(), payload[KEY_B].clone().requires_grad_()
    fold = torch.zeros(D, D)
    if merged_key("layer", "A") in payload:
        fold = payload[merged_key("layer", "B")] @ payload[merged_key("layer", "A")]
    opt = torch.optim.Adam([a, b], lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, D, generator=g) if sample is None else sample(g)
        loss = sum((((x @ (fold + b[:, :p] @ a[:p]).T) - x @ T.T) ** 2).mean() for p in subranks) / len(subranks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return Reply({KEY_A: a.detach(), KEY_B: b.detach()}, num_examples=16)


def measure(arrays: dict, T: torch.Tensor) -> dict[str, float]:
    """share = <B A, T> / ||T||^2 and error = ||B A - T|| / ||T|| (s = 1)."""
    W = arrays[KEY_B] @ arrays[KEY_A]
    return {"share": float((W * T).sum() / (T * T).sum()), "error": float((W - T).norm() / T.norm())}


def one_round(rule: str, T: torch.Tensor, steps: int, lr: float) -> dict[str, float]:
    """One round of ``rule`` (fed_plora_random, fed_plora_prefix, prelort, zeropad) over the 30 clients."""
    settings = LoraSettings(r_max=R, lora_alpha=float(R))
    state = initial()
    fed = sorted(set(RANKS))
    if rule.startswith("fed_plora"):
        strategy = FedPLoRA(settings, FedPLoRAOptions(selection=rule.split("_")[-1]))
    else:
        strategy = PreLort(settings) if rule == "prelort" else ZeroPad(settings)
    instructions = strategy.configure(1, state, [ClientInfo(k, r, 16) for k, r in enumerate(RANKS)])
    replies = {}
    for k, r in enumerate(RANKS):
        subranks = [p for p in fed if p <= r] if rule == "prelort" else [r]
        replies[k] = train(instructions[k].arrays, subranks, T, steps, lr, seed=1000 + k)
    return measure(strategy.aggregate(1, state, replies).arrays, T)


def alone(r: int, T: torch.Tensor, steps: int, lr: float) -> dict[str, float]:
    """One client at rank r training the prefix alone (no aggregation)."""
    state = initial()
    reply = train({KEY_A: state.arrays[KEY_A][:r], KEY_B: state.arrays[KEY_B][:, :r]}, [r], T, steps, lr, seed=1000)
    return measure(reply.arrays, T)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[3, 10, 50])
    p.add_argument("--lr", type=float, default=5e-3)
    args = p.parse_args()
    T = target()
    rules = ("fed_plora_random", "fed_plora_prefix", "prelort", "zeropad")
    for steps in args.steps:
        row = {"steps": steps, "lr": args.lr, **{rule: one_round(rule, T, steps, args.lr) for rule in rules}}
        row["alone_r2"], row["alone_r16"] = alone(2, T, steps, args.lr), alone(16, T, steps, args.lr)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
