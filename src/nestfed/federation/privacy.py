"""Client-level differential privacy: the local mechanism and the privacy spent.

Central DP's noisy mean lives with the other block rules (nestfed.federation.robust); the round
loop clips every accepted update to C first. The accountant is Google's ``dp-accounting`` (its PLD
or RDP accountant); docs/trust.md derives the sensitivity per rank segment.
"""

from __future__ import annotations

import logging
import math

import torch

from nestfed.config import PrivacyConfig
from nestfed.federation.messages import Arrays
from nestfed.federation.update import clip_update


def epsilon(privacy: PrivacyConfig, rounds: int, q: float) -> float:
    """Compute the epsilon spent at ``privacy.delta`` after some rounds.

    - ``central``: each round is the Gaussian mechanism of noise multiplier z on sensitivity C,
      Poisson-subsampled with rate q, composed ``rounds`` times.
    - ``local``: each client's release is its clipped update plus N(0, (z C)^2); under replacing
      the client's whole data the update moves by up to 2C, so it is the Gaussian mechanism of
      multiplier z / 2, composed over the rounds the client took part in (at most ``rounds``; no
      amplification: the server sees who sent what).

    Args:
        privacy: the ``[privacy]`` section (mode, noise multiplier z, delta, accountant).
        rounds: the rounds composed; 0 or fewer spends nothing.
        q: the sampling rate (federation.fraction; q = 1 is no subsampling); central mode only.

    Returns:
        Epsilon; math.inf without noise, 0.0 for no rounds.

    Raises:
        ValueError: when privacy is off.
    """
    if privacy.mode == "off":
        raise ValueError("privacy.mode is off: no epsilon")
    if rounds <= 0:
        return 0.0
    z = privacy.noise_multiplier if privacy.mode == "central" else privacy.noise_multiplier / 2
    if z <= 0:
        return math.inf
    # imported here: a Flower ClientApp process (started per message) never needs the accountant
    import dp_accounting
    from dp_accounting import pld, rdp

    logging.getLogger("absl").setLevel(logging.ERROR)  # RDP orders that do not converge are only warned about
    event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(z)
    if privacy.mode == "central" and q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    # PLD's support grows as 1 / z^2 over its discretisation interval: at z = 0.01 the default 1e-4
    # needs over 20 GB. A coarser interval keeps it small; the pessimistic discretisation stays an
    # upper bound on epsilon (dp-accounting's connect-the-dots PLD).
    interval = 1e-4 * max(1.0, (0.5 / z) ** 2)
    acc = (
        pld.PLDAccountant(value_discretization_interval=interval)
        if privacy.accountant == "pld"
        else rdp.RdpAccountant()
    )
    acc.compose(event, rounds)
    return float(acc.get_epsilon(privacy.delta))


def local_dp(sent: Arrays, reply: Arrays, privacy: PrivacyConfig, generator: torch.Generator) -> tuple[Arrays, float]:
    """Run the local mechanism on a client: clip the update to C and add N(0, (z C)^2) to every entry.

    Args:
        sent: the arrays the server sent (the update is reply - sent).
        reply: the trained arrays.
        privacy: the ``[privacy]`` section (clip norm C, noise multiplier z).
        generator: the noise's generator.

    Returns:
        The released arrays and the update's L2 norm before clipping.
    """
    clipped, norm = clip_update(sent, reply, privacy.clip_norm)
    std = privacy.noise_multiplier * privacy.clip_norm
    out = {}
    for k, v in clipped.items():
        if std > 0 and v.is_floating_point():
            v = v + (torch.randn(v.shape, generator=generator, dtype=torch.float64) * std).to(v.dtype)
        out[k] = v
    return out, norm
