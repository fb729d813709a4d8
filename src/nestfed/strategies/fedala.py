"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma and Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023): FedAvg on the server; each client starts a round
from theta_local + (theta_global - theta_local) * W on its top layers, with element-wise weights
W in [0, 1] it learns on local data (section 4, eq. 5-7). The client side lives in
federation/client_state.py; W and the local model never travel.

Applied here to the trained parameters (LoRA A and B): ``layers`` = how many of the top decoder
layers holding LoRA are mixed (FedALA's p), ``steps`` = local batches spent learning W per round
(FedALA trains W to convergence in the first round it applies and one epoch after; a fixed step
count fits CPU budgets), ``eta`` = W's learning rate (FedALA's default 1.0).
"""

from __future__ import annotations

from typing import Any

from nestfed.federation.messages import ClientInfo, GlobalState
from nestfed.strategies.fedavg import FedAvg


class FedALA(FedAvg):
    """Options: ``layers`` (p), ``steps``, ``eta``. Requires equal client ranks."""

    name = "fedala"

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        return {"fedala_layers": int(self.options.get("layers", 1)), "fedala_steps": int(self.options.get("steps", 2)),
                "fedala_eta": float(self.options.get("eta", 1.0))}
