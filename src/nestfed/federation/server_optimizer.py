"""Server optimisers: the strategy's aggregate taken as a pseudo-gradient and applied by an optimiser.

Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar and McMahan, "Adaptive Federated
Optimization", ICLR 2021 (arXiv 2003.00295v5). Whatever a strategy's rule is (its own mean, a
robust or central-DP block rule, or its rebuild from secure sums), the round loop
(nestfed.federation.loop, through nestfed.federation.safeguards) hands this module the global
state before (x_t) and the aggregate (x_t + Delta_t), and every floating array of the state is
stepped entrywise, in float64:

- Delta_t = aggregate - x_t (Algorithm 2, line 10: the pseudo-gradient; here the strategy's own
  aggregate, so a per-segment or per-row mean, a median or a noisy mean alike);
- ``sgd``: x_{t+1} = x_t + eta Delta_t (Algorithm 1 with ServerOpt = SGD; FedAvg at eta = 1);
- ``sgdm`` (FedAvgM, Hsu et al. 2019): m_t = mu m_{t-1} + Delta_t, x_{t+1} = x_t + eta m_t;
- ``adagrad`` / ``yogi`` / ``adam`` (Algorithm 2): m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
  (line 11); v_t = v_{t-1} + Delta_t^2 (line 12, FedAdagrad), v_t = v_{t-1} - (1 - beta2)
  Delta_t^2 sign(v_{t-1} - Delta_t^2) (line 13, FedYogi), v_t = beta2 v_{t-1} + (1 - beta2)
  Delta_t^2 (line 14, FedAdam); x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau) (line 15). No bias
  correction (the algorithm has none); m_{-1} = 0 and v_{-1} = tau^2 (line 1: v_{-1} >= tau^2).

**The frozen-entries rule** (ours; the paper samples whole models and never meets it): an entry
whose Delta_t is exactly 0 this round received no update, and it is frozen: its value, m and v
stay as they were, so no stale momentum moves it and no decay shrinks its moments. This is what
a rank row that no accepted client holds gets from every rule that leaves such rows unchanged
(segment-wise means, their robust and DP blocks, the secure rebuild), without the core knowing
which rule ran. An entry that was held but whose update rounds to exactly 0 is frozen too (it
carries no information the optimiser could use). A rule that writes unheld rows (a zero-padded
mean pulls them toward 0) gives them a non-zero Delta_t, which is stepped like any other.

**Exactness.** The new value is computed as aggregate + (step - Delta_t): where the step equals
Delta_t (``sgd`` at eta = 1, ``sgdm`` with mu = 0 and eta = 1) the strategy's aggregate is returned
bit for bit, and a frozen entry keeps its bits. The optimiser state lives in
`GlobalState.optimizer` (float64, keys ``m/<key>``, ``v/<key>``), never in the arrays a
client receives or the adapter a run exports, and is checkpointed with them (a resume is exact).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nestfed.config import ServerOptimizerConfig
from nestfed.federation.messages import Arrays, GlobalState

#: key prefixes of the first and second moments in GlobalState.optimizer
M, V = "m/", "v/"


def momentum_step(o: ServerOptimizerConfig, delta: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Take FedAvgM's server step: m_t = mu m_{t-1} + Delta_t, step = eta m_t.

    Hsu et al. 2019; Reddi et al. 2021, section 5's baseline.

    Args:
        o: the ``[server_optimizer]`` section (lr eta, momentum mu).
        delta: Delta_t, float64, of one array's shape.
        m: m_{t-1}, float64, of the same shape.

    Returns:
        (step, m_t), float64, same shape.
    """
    m_new = o.momentum * m + delta
    return o.lr * m_new, m_new


def adaptive_step(
    o: ServerOptimizerConfig, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take one step of FedAdagrad, FedYogi or FedAdam (Reddi et al. 2021, Algorithm 2, lines 11-15).

    Args:
        o: the ``[server_optimizer]`` section (name, lr eta, beta1, beta2, tau).
        delta: Delta_t, float64, of one array's shape.
        m: m_{t-1}, float64, of the same shape.
        v: v_{t-1}, float64, of the same shape.

    Returns:
        (step = eta m_t / (sqrt(v_t) + tau), m_t, v_t), float64, same shape.

    Raises:
        ValueError: for a name that is not adaptive.
    """
    m_new = o.beta1 * m + (1 - o.beta1) * delta  # line 11
    d2 = delta * delta
    if o.name == "adagrad":
        v_new = v + d2  # line 12
    elif o.name == "yogi":
        v_new = v - (1 - o.beta2) * d2 * torch.sign(v - d2)  # line 13
    elif o.name == "adam":
        v_new = o.beta2 * v + (1 - o.beta2) * d2  # line 14
    else:
        raise ValueError(f"server_optimizer.name: '{o.name}' is not an adaptive optimiser")
    return o.lr * m_new / (v_new.sqrt() + o.tau), m_new, v_new  # line 15


def optimiser_step(
    o: ServerOptimizerConfig, delta: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Take the optimiser's step for one array, before the frozen-entries rule.

    Args:
        o: the ``[server_optimizer]`` section.
        delta: Delta_t, float64.
        m: the first moment before this round, float64 of delta's shape; None for m_{-1} = 0.
        v: the second moment before this round, float64 of delta's shape; None for
            v_{-1} = tau^2.

    Returns:
        (step, m_t, v_t); a moment the optimiser does not keep is None (``sgd`` keeps none,
        ``sgdm`` only m).

    Raises:
        ValueError: for an unknown optimiser name (`adaptive_step`).
    """
    m = torch.zeros_like(delta) if m is None else m
    if o.name == "sgd":
        return o.lr * delta, None, None
    if o.name == "sgdm":
        step, m_new = momentum_step(o, delta, m)
        return step, m_new, None
    v = torch.full_like(delta, o.tau**2) if v is None else v
    return adaptive_step(o, delta, m, v)


def _moment(state: Arrays, key: str, shape: torch.Size) -> torch.Tensor | None:
    """A stored moment (float64), None when absent. Raises ValueError for a wrong shape."""
    t = state.get(key)
    if t is None:
        return None
    if t.shape != shape:
        raise ValueError(f"server optimiser state {key}: shape {tuple(t.shape)}, the array has {tuple(shape)}")
    return t.to(torch.float64)


def _finite(x: float) -> float | None:
    """x, or None when it is not finite (a non-finite aggregate, refused by the round loop)."""
    return x if math.isfinite(x) else None


def server_step(o: ServerOptimizerConfig, old: GlobalState, new: GlobalState) -> tuple[GlobalState, dict[str, Any]]:
    """Apply the server optimiser to a round's aggregate (module docstring).

    Every floating array of ``new`` is stepped entrywise with the frozen-entries rule; other
    arrays and the meta are ``new``'s.

    Args:
        o: the ``[server_optimizer]`` section.
        old: the global state x_t (with its optimiser state).
        new: the strategy's aggregate.

    Returns:
        The state x_{t+1} with the new optimiser state, and {"server_optimizer": facts} for the
        metrics line: name, lr, ``step_norm`` = ||x_{t+1} - x_t|| and ``pseudo_gradient_norm`` =
        ||Delta_t|| over all stepped arrays (L2, float64; None when not finite),
        ``frozen_entries``. With the identity optimiser (``sgd`` at lr 1): ``new`` itself and {}.

    Raises:
        ValueError: when a floating array of the aggregate is absent from x_t or changed its shape
            (no pseudo-gradient exists; nestfed.methods refuses such methods at config time), or
            a stored moment has a wrong shape.
    """
    if o.identity:
        return new, {}
    arrays: Arrays = {}
    moments: Arrays = {}
    step_sq = delta_sq = 0.0
    frozen = 0
    for key in sorted(new.arrays):
        x1 = new.arrays[key]
        if not x1.is_floating_point():
            arrays[key] = x1
            continue
        x0 = old.arrays.get(key)
        if x0 is None or x0.shape != x1.shape:
            was = "absent" if x0 is None else f"of shape {tuple(x0.shape)}"
            raise ValueError(
                f"{key}: the aggregate has shape {tuple(x1.shape)} but the global array was {was}: "
                "no pseudo-gradient for the server optimiser"
            )
        delta = x1.to(torch.float64) - x0.to(torch.float64)
        m0, v0 = _moment(old.optimizer, M + key, x1.shape), _moment(old.optimizer, V + key, x1.shape)
        step, m1, v1 = optimiser_step(o, delta, m0, v0)
        held = delta != 0  # the frozen-entries rule: Delta_t == 0 keeps the value, m and v
        frozen += int(held.numel() - held.sum())
        step = torch.where(held, step, torch.zeros_like(step))
        if m1 is not None:
            moments[M + key] = torch.where(held, m1, torch.zeros_like(m1) if m0 is None else m0)
        if v1 is not None:
            moments[V + key] = torch.where(held, v1, torch.full_like(v1, o.tau**2) if v0 is None else v0)
        correction = step - delta  # x_t + step = aggregate + (step - Delta_t)
        arrays[key] = torch.where(correction == 0, x1, (x1.to(torch.float64) + correction).to(x1.dtype))
        step_sq += float((step * step).sum())
        delta_sq += float((delta * delta).sum())
    facts = {
        "name": o.name,
        "lr": o.lr,
        "step_norm": _finite(math.sqrt(step_sq)),
        "pseudo_gradient_norm": _finite(math.sqrt(delta_sq)),
        "frozen_entries": frozen,
    }
    return GlobalState(arrays, new.meta, moments), {"server_optimizer": facts}
