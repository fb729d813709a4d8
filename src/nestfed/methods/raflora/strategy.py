"""raflora: the server strategy (the method is declared in nestfed.methods.raflora; its clients run
the default LoRA client trainer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.strategy import LoraSettings, examples
from nestfed.methods.flexlora.strategy import FlexLoRA
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.methods.prelort.strategy import segments
from nestfed.methods.raflora import RaFLoRAOptions
from nestfed.nn.keys import peft_key


def partition_terms(
    Bs: Sequence[torch.Tensor],
    As: Sequence[torch.Tensor],
    weights: Sequence[float],
    scales: Sequence[float],
    global_B: torch.Tensor,
    global_A: torch.Tensor,
    global_scale: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """List the terms (B_i, A_i, c_i) of raFLoRA's aggregate W = sum_i c_i B_i A_i for one layer.

    The rule is the module docstring's (nestfed.methods.raflora); the terms are in the form
    flexlora's ``product_svd`` takes. For each partition [lo, hi) of the bounds (the distinct r_k and
    r_max): one term per client with r_k >= hi, B_k[:, lo:hi], A_k[lo:hi] and
    c = w_k / (sum of the holders' w) s_k, holders in the order given; no holder: the global
    partition, c = s.

    Args:
        Bs: Bs[k] is client k's trained B [out, r_k].
        As: As[k] is its A [r_k, in].
        weights: weights[k] is its unnormalised weight (n_k, or 1).
        scales: scales[k] is its LoRA scale s_k.
        global_B: the state's B [out, r_max], at the global scale.
        global_A: the state's A [r_max, in], at the global scale.
        global_scale: the global scale s.

    Returns:
        The terms' B factors, A factors and coefficients c, partition by partition.

    Raises:
        ValueError: for lists of different lengths, no client, a weight <= 0, or a rank above r_max
            or of B and A that differ.
    """
    if not Bs or len(Bs) != len(As) or len(As) != len(weights) or len(weights) != len(scales):
        raise ValueError(
            f"partition_terms needs as many B, A, weights and scales (>= 1), got "
            f"{len(Bs)}, {len(As)}, {len(weights)}, {len(scales)}"
        )
    if min(weights) <= 0:
        raise ValueError(f"client weights must be > 0, got {list(weights)}")
    r_max = global_A.shape[0]
    ranks = [int(a.shape[0]) for a in As]
    if any(b.shape[1] != r for b, r in zip(Bs, ranks)) or max(ranks) > r_max:
        raise ValueError(f"ranks of B {[b.shape[1] for b in Bs]} and A {ranks} must agree and be <= r_max = {r_max}")
    out_B, out_A, coeffs = [], [], []
    for lo, hi in segments(ranks + [r_max]):
        holders = [k for k, r in enumerate(ranks) if r >= hi]
        if not holders:  # no client updated this partition: the global one stays
            out_B.append(global_B[:, lo:hi])
            out_A.append(global_A[lo:hi])
            coeffs.append(float(global_scale))
            continue
        held = float(sum(weights[k] for k in holders))
        for k in holders:
            out_B.append(Bs[k][:, lo:hi])
            out_A.append(As[k][lo:hi])
            coeffs.append(float(weights[k]) / held * float(scales[k]))  # FlexLoRA's p_k s_k order
    return out_B, out_A, coeffs


class RaFLoRA(FlexLoRA):
    """FlexLoRA's state and redistribution with raFLoRA's partition-wise W (`partition_terms`).

    The state is the rank-r_max truncated SVD of W at the global scale; each client continues from
    its rank-r_k truncation.

    Args:
        settings: r_max, lora_alpha, scaling and seeds.
        options: ``[raflora]`` (None: the defaults).
    """

    name = "raflora"

    def __init__(self, settings: LoraSettings, options: RaFLoRAOptions | None = None):
        self.o = options if options is not None else RaFLoRAOptions()
        super().__init__(settings, self.o)

    def weights(self, replies: dict[int, Reply]) -> dict[int, float]:
        """Give the unnormalised client weights.

        Args:
            replies: {cid: reply}.

        Returns:
            {cid: n_k} (``examples``) or {cid: 1} (``uniform``).
        """
        return {c: 1.0 for c in replies} if self.o.weighting == "uniform" else examples(replies)

    def layer_terms(
        self, state: GlobalState, replies: dict[int, Reply], module: str
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """List one layer's `partition_terms` over the replies and the state's factors.

        Args:
            state: the global state (its factors at r_max and the global scale).
            replies: {cid: reply}, taken in cid order, each at the rank it trained and that rank's
                scale.
            module: the layer's module path.

        Returns:
            The terms' B factors, A factors and coefficients (`partition_terms`).
        """
        a_key, b_key = peft_key(module, "lora_A"), peft_key(module, "lora_B")
        w = self.weights(replies)
        cids = sorted(replies)
        return partition_terms(
            [replies[c].arrays[b_key] for c in cids],
            [replies[c].arrays[a_key] for c in cids],
            [w[c] for c in cids],
            [self.s.scale(replies[c].arrays[a_key].shape[0]) for c in cids],
            state.arrays[b_key],
            state.arrays[a_key],
            self.s.scale(self.s.r_max),
        )


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> RaFLoRA:
    return RaFLoRA(lora_settings(cfg), cfg.section("raflora"))


IMPLEMENTATION = lora_implementation(_strategy)
