"""Robust and differentially private aggregation in update space, one rank block at a time.

A strategy that supports it (``LoraStrategy.robust_aggregate``) cuts the replies into
`Block` s: regions of the adapter that every member of the block holds entirely (PreLort:
one block per rank segment [r_{l-1}, r_l), members the clients with r_k >= r_l; ZeroPad, HetLoRA
and equal-rank methods: one block of zero-padded updates, every client a member). A
`BlockRule` turns each block into its new values. docs/trust.md gives each rule's meaning at
heterogeneous ranks and the privacy derivation.

Rules (config ``[robust]``): coordinate-wise median, coordinate-wise trimmed mean (Yin et al.
2018), Krum and Multi-Krum (Blanchard et al. 2017); central DP (``[privacy] mode = "central"``):
DP-FedAvg's noisy mean with a fixed denominator (McMahan et al. 2018, Algorithm 1 with
the fixed-denominator estimator f_f).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nestfed.config import PrivacyConfig, RobustConfig
from nestfed.federation.messages import Arrays
from nestfed.seeds import stream_seed


@dataclass
class Block:
    """One unit of aggregation.

    Attributes:
        name: e.g. ``all`` or ``rank 2:4``.
        deltas: {cid: {key: update tensor}}, the members' updates restricted to the block (the
            same shapes for every member).
        weights: {cid: n_k}.
        holders: how many clients of the whole federation hold this block (DP's fixed
            denominator).
        base: {key: tensor} the strategy adds the combined update to (ZeroPad's n_k-weighted mean
            of the padded prefixes, else the global values).
        start: {key: tensor} the global state's values of the block.
    """

    name: str
    deltas: dict[int, Arrays]
    weights: dict[int, float]
    holders: int
    base: Arrays
    start: Arrays

    @property
    def members(self) -> list[int]:
        """The member client ids, sorted."""
        return sorted(self.deltas)


def stacked(block: Block, key: str) -> torch.Tensor:
    """Stack the members' updates of one key.

    Args:
        block: the block.
        key: one of its keys.

    Returns:
        [m, *shape], members in id order.
    """
    return torch.stack([block.deltas[c][key] for c in block.members])


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Take the coordinate-wise median over dim 0.

    Args:
        stack: [m, ...] the members' updates.

    Returns:
        [...] the median; for even m the mean of the two middle values (numpy.median's
        convention).
    """
    m = stack.shape[0]
    s = stack.sort(dim=0).values
    if m % 2:
        return s[m // 2]
    return (s[m // 2 - 1] + s[m // 2]) / 2


def trimmed_mean(stack: torch.Tensor, fraction: float) -> torch.Tensor:
    """Take the coordinate-wise trimmed mean over dim 0 (Yin et al. 2018, Definition 2).

    Args:
        stack: [m, ...] the members' updates.
        fraction: the share trimmed at each end: floor(fraction * m) smallest and largest values
            of each coordinate are dropped.

    Returns:
        [...] the mean of the remaining values.
    """
    m = stack.shape[0]
    k = int(fraction * m)
    return stack.sort(dim=0).values[k : m - k].mean(dim=0)


def krum_scores(flat: torch.Tensor, f: int) -> torch.Tensor:
    """Score updates by Krum (Blanchard et al. 2017, section 4).

    Args:
        flat: [m, D] the m updates, flattened.
        f: the number of Byzantine clients assumed.

    Returns:
        [m] float64: each update's sum of squared distances to its m - f - 2 (at least 1)
        nearest other updates.
    """
    x = flat.double()
    d = torch.cdist(x, x).pow(2)  # [m, m]
    m = x.shape[0]
    nearest = max(1, m - f - 2)
    d.fill_diagonal_(float("inf"))
    return d.sort(dim=1).values[:, :nearest].sum(dim=1)


def krum_select(block: Block, f: int, keep: int) -> list[int]:
    """Select the members with the lowest Krum scores over the whole block (all its keys concatenated).

    Args:
        block: the block.
        f: the number of Byzantine clients assumed.
        keep: how many members to select (1 for Krum).

    Returns:
        The selected member ids, in score order (ties by id).
    """
    cids = block.members
    flat = torch.stack([torch.cat([block.deltas[c][k].reshape(-1) for k in sorted(block.deltas[c])]) for c in cids])
    scores = krum_scores(flat, f)
    order = sorted(range(len(cids)), key=lambda i: (float(scores[i]), cids[i]))
    return [cids[i] for i in order[:keep]]


def weighted_update(block: Block, members: list[int]) -> Arrays:
    """Average some members' updates, weighted by n_k, over every key of the block.

    Args:
        block: the block.
        members: the member ids averaged.

    Returns:
        {key: mean update}, in the dtypes of ``block.start`` (computed in float64).
    """
    w = torch.tensor([block.weights[c] for c in members], dtype=torch.float64)
    w = w / w.sum()
    out = {}
    for key in block.start:
        s = torch.stack([block.deltas[c][key] for c in members]).double()
        out[key] = torch.tensordot(w, s, dims=1).to(block.start[key].dtype)
    return out


@dataclass
class BlockRule:
    """Turns a `Block` into its new values under the configured rule.

    The rule is ``[robust]``'s or, in central DP, the noisy mean (``[privacy]``). Calling the rule
    on a block gives its new values {key: tensor} (shapes of ``block.start``); call `start_round`
    before a round's blocks.

    Attributes:
        robust: the ``[robust]`` section.
        privacy: the ``[privacy]`` section.
        fraction: the client sampling rate q (DP's fixed denominator is q * holders); default 1.
        seed: the federation's (the noise of round t derives from the seed rule's stream
            ``dp_noise:<block>``).
        rnd: the current round.
        notes: per-block facts of the current round for the metrics line (selected clients, the
            rule actually used, the noise std).
    """

    robust: RobustConfig
    privacy: PrivacyConfig
    fraction: float = 1.0
    seed: int = 0
    rnd: int = 0
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def central_dp(self) -> bool:
        """Whether the server adds DP noise."""
        return self.privacy.mode == "central"

    @property
    def active(self) -> bool:
        """Whether aggregation goes through blocks (a robust rule or central DP), not the strategy's mean."""
        return self.robust.rule != "mean" or self.central_dp

    def start_round(self, rnd: int) -> None:
        """Begin a round: clear the notes.

        Args:
            rnd: the round.
        """
        self.rnd, self.notes = rnd, {}

    def __call__(self, block: Block) -> Arrays:
        """The block's new values {key: tensor} (shapes of ``block.start``)."""
        if self.central_dp:
            return self._noisy_mean(block)
        m = len(block.members)
        rule, note = self.robust.rule, {"members": block.members}
        if rule in ("krum", "multi_krum"):
            f = min(self.robust.byzantine, (m - 3) // 2) if m >= 3 else -1
            if f < 0:  # Krum needs m >= 3: a block held by 1-2 clients falls back to the median
                rule = "median"
            else:
                keep = 1 if rule == "krum" else (self.robust.multi_krum_keep or m - f)
                chosen = krum_select(block, f, min(keep, m))
                note.update({"byzantine_assumed": f, "selected": sorted(chosen)})
                self.notes[block.name] = {**note, "rule": rule}
                upd = weighted_update(block, chosen)
                return {k: block.base[k] + upd[k] for k in block.base}
        out = {}
        for key in block.base:
            s = stacked(block, key)
            if rule == "median":
                u = coordinate_median(s)
            elif rule == "trimmed_mean":
                u = trimmed_mean(s, self.robust.trim_fraction)
                note["trimmed_each_end"] = int(self.robust.trim_fraction * m)
            else:
                u = weighted_update(block, block.members)[key]
            out[key] = block.base[key] + u
        self.notes[block.name] = {**note, "rule": rule}
        return out

    def _noisy_mean(self, block: Block) -> Arrays:
        """DP-FedAvg's estimator: start + (sum_k clipped delta_k + N(0, (z C)^2 I)) / (q * holders).

        The deltas were clipped to C by the round loop. Adding or removing one client changes the
        concatenation of all blocks' sums by at most C in L2 (a client's blocks are disjoint parts
        of its one clipped update), so one Gaussian mechanism of multiplier z covers every block
        of the round (docs/trust.md).
        """
        p = self.privacy
        denom = self.fraction * block.holders
        std = p.noise_multiplier * p.clip_norm
        g = torch.Generator().manual_seed(stream_seed(self.seed, self.rnd, 0, f"dp_noise:{block.name}"))
        out = {}
        for key in block.start:
            total = stacked(block, key).double().sum(dim=0)
            noise = torch.randn(total.shape, generator=g, dtype=torch.float64) * std
            out[key] = block.start[key] + ((total + noise) / denom).to(block.start[key].dtype)
        self.notes[block.name] = {
            "members": block.members,
            "rule": "dp_noisy_mean",
            "denominator": denom,
            "noise_std_of_mean": std / denom,
        }
        return out
