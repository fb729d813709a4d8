"""The default screen: an update far larger than its peers' is rejected, rank block by rank block.

A client's update (its reply minus what it was sent) is cut, by
nestfed.federation.update.block_norms, into the round's rank blocks [r_{j-1}, r_j) (the distinct
ranks r_1 < r_2 < ... of the round's instructions, r_0 = 0; rows of lora_A, columns of lora_B)
plus one block for the arrays without a rank dimension.

Its norm in a block is compared with the reference of that block: the lower median of the norms
of the replies already accepted in the round that hold the block (all the held replies when the
round settles; those accepted so far once replies are folded on arrival,
nestfed.federation.folding). A reply is rejected when any block's norm exceeds ``ratio`` times the
reference (``validation.norm_ratio``, default 10; 0 turns the screen off). Secure aggregation's
sums reveal no update: they are not screened.

The lower median makes one honest reply beside one hostile reply the reference; a block held by
one reply alone is compared with nothing (set ``validation.max_update_norm`` for an absolute
bound). Comparing within a block, never across, keeps heterogeneous ranks fair: a rank-16
client's top rows are never measured against rank-2 rows.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from nestfed.federation.messages import Instruction
from nestfed.nn.keys import rank_dim


def round_blocks(instructions: dict[int, Instruction]) -> tuple[int, ...]:
    """List the distinct ranks of a round's instructions: the blocks' upper ends.

    Args:
        instructions: {cid: instruction}; an instruction's rank is its config's ``rank``, else
            the rank of its first expected LoRA array.

    Returns:
        The ranks, sorted ascending.
    """
    ranks = set()
    for ins in instructions.values():
        r = ins.config.get("rank")
        if r is None:
            r = next((shape[rank_dim(k)] for k, shape in ins.expect.items() if rank_dim(k) is not None), None)
        if r is not None:
            ranks.add(int(r))
    return tuple(sorted(ranks))


@dataclass
class RelativeScreen:
    """One round's default screen (module docstring).

    Attributes:
        ratio: the largest norm / reference accepted (``validation.norm_ratio``); 0 = off.
        ends: the round's ranks (`round_blocks`).
        accepted: {block: norms} of the replies accepted so far (the references of later
            arrivals).
    """

    ratio: float
    ends: tuple[int, ...]
    accepted: dict[str, list[float]] = field(default_factory=dict)

    def worst(self, norms: dict[str, float], among: dict[str, list[float]]) -> tuple[float, str]:
        """Find the block whose norm is largest against its reference.

        Args:
            norms: {block: norm} of one reply.
            among: {block: peers' norms}; the reference is their lower median.

        Returns:
            The largest norm / reference over the blocks (1.0 where a block has no peer, or peers
            that did not move) and its block; (0.0, "") for no blocks.
        """
        best = (0.0, "")
        for block, x in norms.items():
            peers = among.get(block, [])
            ref = statistics.median_low(peers) if peers else 0.0
            ratio = x / ref if ref > 0 else 1.0  # no peer, or peers that did not move: no reference
            best = max(best, (ratio, block))
        return best

    def reason(self, norms: dict[str, float], among: dict[str, list[float]]) -> str | None:
        """Say why a reply with these block norms is rejected.

        Args:
            norms: {block: norm} of one reply.
            among: {block: peers' norms}.

        Returns:
            The reason (norm, block, ratio, the peers' median); None when accepted or the screen
            is off.
        """
        if self.ratio <= 0:
            return None
        ratio, block = self.worst(norms, among)
        if ratio <= self.ratio:
            return None
        ref = statistics.median_low(among[block])
        return (
            f"update norm {norms[block]:.4g} in rank block {block} is {ratio:.3g} x its peers' median "
            f"{ref:.4g} (above validation.norm_ratio = {self.ratio:g})"
        )

    def accept(self, norms: dict[str, float]) -> None:
        """Count an accepted reply's block norms among the references of later arrivals.

        Args:
            norms: {block: norm} of the accepted reply.
        """
        for block, x in norms.items():
            self.accepted.setdefault(block, []).append(x)
