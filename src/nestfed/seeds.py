"""The one seed rule: every random choice of a run derives from (seed, round, client, stream).

``stream`` names what the random numbers are for (``"batches"``, ``"lora_init/<module>"``, ...),
so two choices of one client in one round never share a generator, and a run resumed after round
t draws exactly what an uninterrupted run draws (the exact-resume guarantee rests on this).
Round 0 and client 0 stand for "not tied to a round / a client" (initialisation, the server).
"""

from __future__ import annotations

_P = 1_000_003
_M = 2**63 - 1


def _legacy(seed: int, rnd: int, client: int, stream: str) -> int:
    """The formulas written by hand before the seed rule, kept until the commit that replaces them."""
    if stream == "batches":
        return ((seed * _P + rnd) * _P + client) % _M
    if stream == "ala_weights":
        return (seed * _P + rnd * 7_919 + client * 31 + 17) % _M
    if stream == "surrogate":
        return (seed * _P + rnd * 7_919 + client * 31 + 29) % _M
    if stream == "fresh_lora":
        return (seed * _P + rnd * 10_007 + client) % 2**31
    if stream == "distill_server":
        return ((seed * _P + rnd) * _P + 7919) % _M
    if stream == "distill_client":
        return (((seed * _P + rnd) * _P + client) * _P + 104729) % _M
    if stream.startswith("lora_init/"):
        h = 0
        for ch in stream[len("lora_init/"):].encode():
            h = (h * 131 + ch) % 2_147_483_647
        return seed * _P + h
    if stream == "elicitation":
        return seed
    raise KeyError(f"unknown seed stream {stream!r}")


def stream_seed(seed: int, rnd: int, client: int, stream: str) -> int:
    """A deterministic seed in [0, 2**63) for one random choice.

    seed: the run's seed (``federation.seed``, ``lora.init_seed``, ...); rnd: the round (1-based;
    0 = before the first round); client: the client id (0 for server-side choices); stream: what
    the numbers are for. Raises KeyError for a stream this rule does not know.
    """
    return _legacy(int(seed), int(rnd), int(client), stream)
