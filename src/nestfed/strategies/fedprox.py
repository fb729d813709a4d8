"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020): FedAvg's aggregation, with the proximal term
mu/2 ||theta - theta_global||^2 added to every client's local loss (eq. 2)."""

from __future__ import annotations

from typing import Any

from nestfed.federation.messages import ClientInfo, GlobalState
from nestfed.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """Options: ``mu`` (>= 0; 0 is FedAvg exactly). Requires equal client ranks."""

    name = "fedprox"
    objective = "prox"

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        return {"fedprox_mu": float(self.options.get("mu", 0.01))}
