"""The one seed rule: every random choice of a run derives from (seed, round, client, stream).

``stream`` names what the random numbers are for (``"batches"``, ``"lora_init/<module>"``,
``"fresh_lora"``, ``"sampling"``, ...), so two choices of one client in one round never share a
generator, and a run resumed after round t draws exactly what an uninterrupted run draws (the
exact-resume guarantee rests on this). Round 0 and client 0 stand for "not tied to a round / a
client" (initialisation, the server's own draws).

The four numbers go through NumPy's ``SeedSequence`` (a hash designed for exactly this: distinct
inputs give statistically independent streams); the stream's name enters as its CRC-32, which,
unlike Python's ``hash``, is the same in every process.
"""

from __future__ import annotations

import zlib

import numpy as np


def stream_seed(seed: int, rnd: int, client: int, stream: str) -> int:
    """Derive the deterministic seed of one random choice.

    Args:
        seed: the run's seed (``federation.seed``, ``lora.init_seed``, ...).
        rnd: the round, 1-based; 0 = before the first round.
        client: the client id; 0 for server-side choices.
        stream: what the numbers are for (``"batches"``, ``"lora_init/<module>"``, ...).

    Returns:
        A seed in [0, 2**63).

    Raises:
        ValueError: for a negative seed, round or client.
    """
    parts = (int(seed), int(rnd), int(client))
    if min(parts) < 0:
        raise ValueError(f"seed, round and client must be >= 0, got {parts}")
    state = np.random.SeedSequence([*parts, zlib.crc32(stream.encode("utf-8"))]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))
