"""Byzantine clients on the real client path (config ``[attack]``).

What an attacking client does to the update it sends. The client trainer
(nestfed.federation.client) applies it after local training; data poisoning happens earlier, to
the client's training text (nestfed.data.poisoning). Used to test the server's defences, never by
an honest run.
"""

from __future__ import annotations

import torch

from nestfed.config import AttackConfig
from nestfed.federation.messages import Arrays
from nestfed.federation.update import origin, scale_update

#: attacks applied to the update (the others poison the data or skip training)
UPDATE_ATTACKS = ("sign_flip", "scale", "noise", "free_rider", "constant", "nans", "float64")


def attacks(attack: AttackConfig, cid: int) -> str | None:
    """Name the attack a client runs on its update.

    Args:
        attack: the ``[attack]`` section.
        cid: the client's id.

    Returns:
        ``attack.kind`` when it is an update attack (`UPDATE_ATTACKS`) and ``cid`` one of its
        clients, else None.
    """
    return attack.kind if attack.kind in UPDATE_ATTACKS and cid in attack.clients else None


def attacked_reply(kind: str, sent: Arrays, reply: Arrays, attack: AttackConfig, generator: torch.Generator) -> Arrays:
    """Build the arrays an attacking client sends instead of its trained reply.

    The attacks:

    - ``sign_flip``: origin - update (Damaskinos et al. 2018's "reversed gradient");
    - ``scale``: origin + attack.scale * update (model replacement, Bagdasaryan et al. 2020);
    - ``noise``: origin + N(0, attack.noise_std^2) per entry, the update discarded (the Gaussian
      attack of Fang et al. 2020);
    - ``free_rider``: origin, i.e. what it received (Lin et al. 2019).

    Faults rather than attacks, to test the server's checks: ``constant`` (every entry
    attack.value, finite, e.g. 1e9), ``nans`` (every entry NaN), ``float64`` (the trained reply
    sent as float64).

    Args:
        kind: one of `UPDATE_ATTACKS`.
        sent: the arrays the server sent (the update's origin).
        reply: the trained arrays.
        attack: the ``[attack]`` section (scale, noise_std, value).
        generator: the generator of the ``noise`` attack.

    Returns:
        The arrays sent (the keys and shapes of ``reply``).

    Raises:
        ValueError: for another kind.
    """
    if kind == "constant":
        return {k: torch.full_like(v, attack.value) if v.is_floating_point() else v for k, v in reply.items()}
    if kind == "nans":
        return {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in reply.items()}
    if kind == "float64":
        return {k: v.double() if v.is_floating_point() else v for k, v in reply.items()}
    if kind == "sign_flip":
        return scale_update(sent, reply, -1.0)
    if kind == "scale":
        return scale_update(sent, reply, attack.scale)
    if kind == "noise":
        return {
            k: origin(sent, k, v)
            + (torch.randn(v.shape, generator=generator, dtype=torch.float64) * attack.noise_std).to(v.dtype)
            if v.is_floating_point()
            else v
            for k, v in reply.items()
        }
    if kind == "free_rider":
        return {k: origin(sent, k, v).clone() if v.is_floating_point() else v for k, v in reply.items()}
    raise ValueError(f"attack.kind: '{kind}' is not an attack on the update")
