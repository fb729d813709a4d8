"""What the server does so that a bad or hostile client cannot move the global model.

It screens each reply (beyond nestfed.federation.payload's shapes and finiteness), aggregates
robustly or with central DP, and counts the privacy spent. The round loop (nestfed.federation.loop) calls it for
every transport; docs/trust.md describes the rules. Every aggregate (the strategy's own, robust,
DP or rebuilt from secure sums) then goes through the server optimiser
(nestfed.federation.server_optimizer; identity by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nestfed.config import ExperimentConfig, PrivacyConfig, RobustConfig, ServerOptimizerConfig, ValidationConfig
from nestfed.errors import UpdateRejected
from nestfed.federation.messages import GlobalState, Instruction, Reply, SecureSum
from nestfed.federation.privacy import epsilon
from nestfed.federation.robust import BlockRule
from nestfed.federation.server_optimizer import server_step
from nestfed.federation.strategy import Strategy
from nestfed.federation.update import FLOAT32_MAX, clip_update, update_norm

#: the largest update norm float32 arithmetic survives (its square is the largest float32)
MAX_REPRESENTABLE_NORM = math.sqrt(FLOAT32_MAX)


@dataclass
class Safeguards:
    """The server's checks and aggregation rule for one run.

    Attributes:
        validation: the n_k policy and the optional norm bound.
        privacy: DP (central clipping and the accountant).
        rule: the block rule (robust or central DP) applied when active.
        optimizer: the server optimiser applied to every aggregate
            (nestfed.federation.server_optimizer).
    """

    validation: ValidationConfig = field(default_factory=ValidationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    rule: BlockRule = field(default_factory=lambda: BlockRule(RobustConfig(), PrivacyConfig()))
    optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> Safeguards:
        """Build the safeguards of an experiment.

        Args:
            cfg: the experiment: its ``[validation]``, ``[robust]``, ``[privacy]``,
                ``[server_optimizer]`` and federation (sampling rate, seed).

        Returns:
            The safeguards.
        """
        f = cfg.federation
        return cls(
            cfg.validation, cfg.privacy, BlockRule(cfg.robust, cfg.privacy, f.fraction, f.seed), cfg.server_optimizer
        )

    def screen(
        self, instruction: Instruction, reply: Reply, declared: int, block_norms: dict[str, float] | None = None
    ) -> tuple[Reply, dict[str, Any]]:
        """Check one (already shape-validated) reply; cap its n_k or clip its update where asked.

        Central DP clips every update to privacy.clip_norm.

        Args:
            instruction: the instruction the reply answers (its arrays: the update's origin).
            reply: the reply.
            declared: the n_k the client declared when it joined.
            block_norms: the update's norms per rank block (nestfed.federation.relative_screen);
                when measured, they give its norm without another pass over it.

        Returns:
            The reply (possibly capped or clipped) and the facts for the metrics line:
            ``update_norm``, and ``clipped_to``, ``num_examples_capped_from`` when they apply.

        Raises:
            UpdateRejected: for n_k above ``declared`` under the ``reject`` policy, an update whose
                norm overflows float32, or a norm above validation.max_update_norm under
                ``on_norm = "reject"``.
        """
        facts: dict[str, Any] = {}
        n = reply.num_examples
        if n > declared:
            if self.validation.num_examples == "reject":
                raise UpdateRejected(f"num_examples {n} is above the {declared} the client declared when it joined")
            facts["num_examples_capped_from"] = n
            n = declared
        arrays = reply.arrays
        bounds = []
        if self.validation.max_update_norm > 0:
            bounds.append(("validation.max_update_norm", self.validation.max_update_norm, self.validation.on_norm))
        if self.privacy.mode == "central":
            bounds.append(("privacy.clip_norm", self.privacy.clip_norm, "clip"))
        # the update's norm: from its rank blocks' norms when the default screen measured them
        norm = (
            math.sqrt(sum(x * x for x in block_norms.values()))
            if block_norms is not None
            else update_norm(instruction.arrays, arrays)
        )
        if not math.isfinite(norm) or norm > MAX_REPRESENTABLE_NORM:
            raise UpdateRejected(f"update norm {norm:.3g} overflows float32 (its square exceeds {FLOAT32_MAX:.3g})")
        facts["update_norm"] = norm
        for name, bound, action in bounds:
            if norm > bound:
                if action == "reject":
                    raise UpdateRejected(f"update norm {norm:.4g} is above {name} = {bound:g}")
                arrays, _ = clip_update(instruction.arrays, arrays, bound)
                norm = bound
                facts["clipped_to"] = bound
        return Reply(arrays, n, reply.metrics), facts

    def aggregate(
        self, strategy: Strategy, rnd: int, state: GlobalState, replies: dict[int, Reply]
    ) -> tuple[GlobalState, dict[str, Any]]:
        """Aggregate a round's replies, then take the server optimiser's step.

        The strategy's aggregate, or its block form under a robust rule or central DP, then
        nestfed.federation.server_optimizer.server_step.

        Args:
            strategy: the method's strategy.
            rnd: the round.
            state: the global state the round started from.
            replies: {cid: accepted reply}.

        Returns:
            The new state and, for the metrics line, ``robust`` (per block: members, rule,
            selection) and ``server_optimizer`` (absent when it is the identity).

        Raises:
            ValueError: from the server optimiser's step.
        """
        if not self.rule.active:
            return server_step(self.optimizer, state, strategy.aggregate(rnd, state, replies))
        self.rule.start_round(rnd)
        new, facts = server_step(self.optimizer, state, strategy.robust_aggregate(rnd, state, replies, self.rule))
        return new, {"robust": dict(self.rule.notes), **facts}

    def aggregate_secure(
        self, strategy: Strategy, rnd: int, state: GlobalState, secure: SecureSum
    ) -> tuple[GlobalState, dict[str, Any]]:
        """Rebuild a round from secure sums alone, then take the server optimiser's step.

        The strategy's ``aggregate_secure`` (nestfed.federation.secure_sum); the optimiser needs
        only the aggregate, never a single client's update, so it composes with secure
        aggregation.

        Args:
            strategy: the method's strategy.
            rnd: the round.
            state: the global state the round started from.
            secure: what secure aggregation revealed.

        Returns:
            As `aggregate` (no ``robust``: secure aggregation refuses block rules).

        Raises:
            ValueError: from the server optimiser's step.
        """
        new = strategy.aggregate_secure(rnd, state, secure)
        return server_step(self.optimizer, state, new)

    def privacy_spent(self, rnd: int, fraction: float) -> dict[str, Any]:
        """Report the privacy spent after a round.

        Args:
            rnd: the round (the rounds composed).
            fraction: the client sampling rate q.

        Returns:
            {"privacy": {mode, epsilon (None = infinite), delta, rounds, noise_multiplier,
            clip_norm, accountant}}; {} when privacy is off.
        """
        if self.privacy.mode == "off":
            return {}
        eps = epsilon(self.privacy, rnd, fraction)
        return {
            "privacy": {
                "mode": self.privacy.mode,
                "epsilon": eps if math.isfinite(eps) else None,
                "delta": self.privacy.delta,
                "rounds": rnd,
                "noise_multiplier": self.privacy.noise_multiplier,
                "clip_norm": self.privacy.clip_norm,
                "accountant": self.privacy.accountant,
            }
        }
