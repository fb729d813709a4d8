"""What a Flower run refuses that the embedded runner serves: settings that need the server to hold
the clients' data or to receive more than arrays and metrics from them. Checked before anything is
written."""

from __future__ import annotations

from nestfed.config import ExperimentConfig
from nestfed.errors import ConfigError

EMBEDDED_ONLY = {  # setting: why Flower refuses it
    "evaluation.global_test": "on Flower no server holds the clients' held-out records to draw a global held-out "
    "set from (the embedded runner has one; docs/scale.md)",
    "generation.rows": "the generated evaluation runs embedded (nestfed run), which writes the answers into the "
    "run directory; on Flower the nodes would have to send their texts back",
}


def embedded_only(cfg: ExperimentConfig) -> None:
    """Raises ConfigError naming the first setting only the embedded runner serves (EMBEDDED_ONLY)."""
    asked = {"evaluation.global_test": cfg.evaluation.global_test, "generation.rows": cfg.generation.rows}
    for key, why in EMBEDDED_ONLY.items():
        if asked[key]:
            raise ConfigError(f"{key}: {why}")
