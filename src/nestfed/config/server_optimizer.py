"""The server optimiser section ``[server_optimizer]``: how the server turns the aggregate into a step.

Reddi et al., "Adaptive Federated Optimization" (ICLR 2021; arXiv 2003.00295v5): the strategy's
aggregate minus the global state is a pseudo-gradient Delta_t (Algorithm 1, FedOpt: x_{t+1} =
ServerOpt(x_t, -Delta_t, eta, t)), and the server applies it with an optimiser of its own
(nestfed.federation.server_optimizer does the arithmetic; docs/architecture.md, "Server
optimisers"):

- ``sgd``: x_{t+1} = x_t + eta Delta_t. With ``lr = 1`` (the default) this is the strategy's own
  aggregate, bit for bit (plain FedAvg of the LoRA methods): no optimiser runs.
- ``sgdm``: FedAvgM (Hsu et al. 2019, the paper's baseline): m_t = mu m_{t-1} + Delta_t,
  x_{t+1} = x_t + eta m_t, mu = ``momentum``.
- ``adagrad`` / ``adam`` / ``yogi``: FedAdagrad, FedAdam, FedYogi (Algorithm 2, lines 11-15),
  with beta1, beta2 and the adaptivity tau (v_{-1} = tau^2, the smallest line 1 allows).

The names are the server optimiser's (Algorithm 1's ServerOpt), not a federated method's: the
section composes with every method whose home allows it (nestfed.methods refuses the rest, with
the reason). Values that types cannot check raise ValueError("server_optimizer.<key>: <reason>").
"""

from __future__ import annotations

from dataclasses import dataclass

#: ServerOpt of Algorithm 1: SGD (FedAvg at lr 1), SGD with momentum (FedAvgM), Adagrad, Adam, Yogi
NAMES = ("sgd", "sgdm", "adagrad", "adam", "yogi")
#: what a name written after the paper's methods (their prefix dropped) probably meant
_HINTS = {"avg": "sgd", "avgm": "sgdm", "adagrad": "adagrad", "adam": "adam", "yogi": "yogi"}


@dataclass(frozen=True)
class ServerOptimizerConfig:
    """The server optimiser (Reddi et al. 2021, Algorithms 1 and 2).

    Attributes:
        name: one of `NAMES`.
        lr: the server learning rate eta (> 0; 1 with ``sgd`` is the strategy's aggregate
            unchanged; the adaptive optimisers need far smaller values, the paper tunes eta over
            powers of 10).
        momentum: FedAvgM's mu in [0, 1).
        beta1: the first decay parameter of Algorithm 2, in [0, 1).
        beta2: the second decay parameter of Algorithm 2, in [0, 1) (unused by ``adagrad``).
        tau: the adaptivity epsilon (> 0; the paper's 1e-3 default), also fixing v_{-1} = tau^2.
    """

    name: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    @property
    def identity(self) -> bool:
        """Whether the optimiser returns the strategy's aggregate unchanged (``sgd`` at lr 1)."""
        return self.name == "sgd" and self.lr == 1.0


def check_server_optimizer(o: ServerOptimizerConfig) -> None:
    """Check ``[server_optimizer]``'s values (the ranges of Reddi et al. 2021, Algorithm 2, line 1).

    Args:
        o: the section.

    Raises:
        ValueError: "server_optimizer.<key>: <reason>", for the first value at fault.
    """
    if o.name not in NAMES:
        low = o.name.lower()
        guess = _HINTS.get(low[3:] if low.startswith("fed") else low)
        hint = f"; did you mean '{guess}'?" if guess else ""
        raise ValueError(
            f"server_optimizer.name: unknown server optimiser '{o.name}' (known: {', '.join(NAMES)}){hint}"
        )
    if not o.lr > 0:
        raise ValueError(f"server_optimizer.lr: the server learning rate eta must be > 0, got {o.lr}")
    if not 0 <= o.momentum < 1:
        raise ValueError(f"server_optimizer.momentum: mu must be in [0, 1), got {o.momentum}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ValueError(f"server_optimizer.{key}: the decay parameters must be in [0, 1), got {getattr(o, key)}")
    if not o.tau > 0:
        raise ValueError(
            f"server_optimizer.tau: the adaptivity tau must be > 0 (it bounds the step's "
            f"denominator sqrt(v) + tau), got {o.tau}"
        )
