"""What the server does so that a bad or hostile client cannot move the global model: screen each
reply (beyond nestfed.federation.payload's shapes and finiteness), aggregate robustly or with
central DP, and count the privacy spent. The round loop (nestfed.federation.loop) calls it for
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

    validation: n_k policy and the optional norm bound; privacy: DP (central clipping and the
    accountant); rule: the block rule (robust or central DP) applied when active; optimizer: the
    server optimiser applied to every aggregate (nestfed.federation.server_optimizer).
    """

    validation: ValidationConfig = field(default_factory=ValidationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    rule: BlockRule = field(default_factory=lambda: BlockRule(RobustConfig(), PrivacyConfig()))
    optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> Safeguards:
        """The safeguards of an experiment's ``[validation]``, ``[robust]``, ``[privacy]``,
        ``[server_optimizer]`` and federation (sampling rate, seed)."""
        f = cfg.federation
        return cls(
            cfg.validation, cfg.privacy, BlockRule(cfg.robust, cfg.privacy, f.fraction, f.seed), cfg.server_optimizer
        )

    def screen(
        self, instruction: Instruction, reply: Reply, declared: int, block_norms: dict[str, float] | None = None
    ) -> tuple[Reply, dict[str, Any]]:
        """Check one (already shape-validated) reply; return it, possibly capped or clipped, and the
        facts for the metrics line (``update_norm``; ``clipped_to``, ``num_examples_capped_from``).

        Raises UpdateRejected: n_k above the client's declared ``declared`` under the ``reject``
        policy; an update whose norm overflows float32; a norm above validation.max_update_norm
        under ``on_norm = "reject"``. Central DP clips every update to privacy.clip_norm.
        ``block_norms``: the update's norms per rank block (nestfed.federation.relative_screen), when
        measured, give its norm without another pass over it.
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
        """The strategy's aggregate, or its block form under a robust rule or central DP, then the
        server optimiser's step (nestfed.federation.server_optimizer.server_step, whose ValueError
        propagates); returns the new state and, for the metrics line, ``robust`` (per block:
        members, rule, selection) and ``server_optimizer`` (absent when it is the identity)."""
        if not self.rule.active:
            return server_step(self.optimizer, state, strategy.aggregate(rnd, state, replies))
        self.rule.start_round(rnd)
        new, facts = server_step(self.optimizer, state, strategy.robust_aggregate(rnd, state, replies, self.rule))
        return new, {"robust": dict(self.rule.notes), **facts}

    def aggregate_secure(
        self, strategy: Strategy, rnd: int, state: GlobalState, secure: SecureSum
    ) -> tuple[GlobalState, dict[str, Any]]:
        """The strategy's rebuild from secure sums alone (``aggregate_secure``,
        nestfed.federation.secure_sum), then the server optimiser's step: it needs only the
        aggregate, never a single client's update, so it composes with secure aggregation. Returns
        as :meth:`aggregate` (no ``robust``: secure aggregation refuses block rules)."""
        new = strategy.aggregate_secure(rnd, state, secure)
        return server_step(self.optimizer, state, new)

    def privacy_spent(self, rnd: int, fraction: float) -> dict[str, Any]:
        """``privacy``: {mode, epsilon (None = infinite), delta, rounds} after round ``rnd``; {}
        when privacy is off."""
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
