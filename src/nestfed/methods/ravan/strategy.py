"""ravan: the server strategy (the method is declared in nestfed.methods.ravan).

The clients draw A and B from the seed (nestfed.methods.fed_sb.frozen_factors.CoreHooks); the
payload's ``lora_heads`` key installs RAVAN's gated heads on each LoRA layer
(nestfed.nn.lora_core.GatedHeads: the gates start at 1 on every load), which train H_i and s_i and
reply with s_i H_i; a client of rank r_k receives its first r_k / q heads and runs the others as
its frozen residual.
"""

from __future__ import annotations

from nestfed.config import ExperimentConfig
from nestfed.federation.messages import Arrays
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fed_sb.frozen_factors import CoreHooks
from nestfed.methods.fed_sb.strategy import CoreStrategy
from nestfed.methods.implementation import lora_implementation, lora_settings


class Ravan(CoreStrategy):
    """RAVAN's server: the core is h heads H_i [q, q] (q = r_max / h) stacked row-wise, [r, q].

    The heads sit between the stacked frozen factors A = [A_1; ...; A_h] (shape [r, in]) and B =
    [B_1, ..., B_h] (shape [out, r]); a client of rank r_k trains the first r_k / q heads, running
    the others as a frozen residual; the server averages the replied s_i H_i with n_k weights, heads
    a client did not train counting at the values it ran (CoreStrategy), and the gates restart at 1
    (module docstring of nestfed.methods.ravan).

    Args:
        settings: the LoRA numbers.
        options (RavanOptions | None): ``[ravan]``; its ``heads`` is h unless ``heads`` is given.
        heads: h, overriding the options'.
    """

    name = "ravan"
    kind = "lora_heads"
    stream = "ravan_init"

    def __init__(self, settings: LoraSettings, options=None, heads: int | None = None):
        super().__init__(settings, options)
        self._heads = heads if heads is not None else options.heads

    def heads(self) -> int:
        """h, the heads the rank is cut into."""
        return self._heads


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> Ravan:
    return Ravan(lora_settings(cfg), cfg.section("ravan"))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: CoreHooks(cfg.section("ravan").lr))
