"""FedSSI (Li et al., "Rehearsal-Free Continual Federated Learning with Synergistic Synaptic
Intelligence", ICML 2025) as a baseline: FedAvg on the server; each client first runs a
personalised surrogate model from the global theta (eq. 5, mixing local and global knowledge
with lambda), takes its synaptic-intelligence parameter importance Omega along that path (eq. 6-7),
then trains with CE + c * sum Omega (theta - theta_global)^2 (eq. 2). Client side:
federation/client_state.py (:func:`surrogate_importance`) and objectives.ssi.
"""

from __future__ import annotations

from typing import Any

from nestfed.federation.messages import ClientInfo, GlobalState
from nestfed.strategies.fedavg import FedAvg


class FedSSI(FedAvg):
    """Options: ``c``, ``lambda`` (in (0, 1]), ``psm_steps``, ``xi``. Requires equal client ranks."""

    name = "fedssi"
    objective = "ssi"

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        o = self.options
        return {"fedssi_c": float(o.get("c", 0.1)), "fedssi_lambda": float(o.get("lambda", 0.5)),
                "fedssi_psm_steps": int(o.get("psm_steps", 2)), "fedssi_xi": float(o.get("xi", 1e-3))}
