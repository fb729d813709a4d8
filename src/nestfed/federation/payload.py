"""Serialise payloads, count their bytes, and validate client replies.

The byte count of a payload is the length of its safetensors serialisation: what would cross
the wire (Flower's ArrayRecord carries the same raw tensor bytes plus small headers).
"""

from __future__ import annotations

import functools

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from nestfed.errors import UpdateRejected
from nestfed.federation.messages import Arrays, Instruction, Reply
from nestfed.federation.update import FLAT_NUMEL
from nestfed.nn.keys import rank_dim


def encode(arrays: Arrays) -> bytes:
    """Serialise a payload to safetensors bytes (tensors made contiguous, on CPU).

    Args:
        arrays: the payload.

    Returns:
        The safetensors bytes.
    """
    return st_save({k: v.detach().contiguous().cpu() for k, v in arrays.items()})


def decode(data: bytes) -> Arrays:
    """Read a payload back from `encode`'s bytes.

    Args:
        data: safetensors bytes.

    Returns:
        The payload (CPU tensors).
    """
    return st_load(data)


@functools.lru_cache(maxsize=4096)
def _serialised_bytes(signature: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> int:
    """The length of `encode`'s bytes for payloads of this (key, dtype, shape) signature: the
    safetensors header and the raw data depend on nothing else (measured once per signature)."""
    return len(st_save({k: torch.zeros(shape, dtype=dtype) for k, dtype, shape in signature}))


def payload_stats(arrays: Arrays) -> dict:
    """Measure the size of a payload.

    The serialised size is counted once per signature of keys, dtypes and shapes, so a round of
    1,000 clients at 4 ranks serialises 4 times.

    Args:
        arrays: the payload.

    Returns:
        ``bytes`` (the length of `encode`'s bytes), ``params`` (elements), ``dtypes`` (sorted
        names, e.g. ``float32``).
    """
    signature = tuple(sorted((k, v.dtype, tuple(v.shape)) for k, v in arrays.items()))
    return {
        "bytes": _serialised_bytes(signature),
        "params": int(sum(v.numel() for v in arrays.values())),
        "dtypes": sorted({str(v.dtype).replace("torch.", "") for v in arrays.values()}),
    }


def validate_reply(instruction: Instruction, reply: Reply) -> None:  # noqa: C901 (one branch per way a reply can be malformed)
    """Check a reply against what its instruction expects.

    Args:
        instruction: the instruction sent; its ``expect``, ``may_shrink_rank`` and arrays.
        reply: the client's reply.

    Raises:
        UpdateRejected: with the reason, for missing or extra keys, a wrong shape, a rank above the
            instructed one (or any other rank unless ``may_shrink_rank``), A and B of one layer
            with different ranks, NaN or Inf, a dtype other than the sent array's (for an array
            that was not sent: other than `unsent_dtype`, or a bool / complex array), a
            non-positive number of examples.
    """
    expect = instruction.expect
    got = set(reply.arrays)
    missing, extra = sorted(set(expect) - got), sorted(got - set(expect))
    if missing:
        raise UpdateRejected(f"missing keys: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    if extra:
        raise UpdateRejected(f"unexpected keys: {extra[:3]}{' ...' if len(extra) > 3 else ''}")
    if not isinstance(reply.num_examples, int) or reply.num_examples <= 0:
        raise UpdateRejected(f"num_examples must be a positive integer, got {reply.num_examples!r}")
    ranks: dict[str, int] = {}
    unsent: torch.dtype | None = None
    for key, shape in expect.items():
        t = reply.arrays[key]
        if not isinstance(t, torch.Tensor):
            raise UpdateRejected(f"{key}: not a tensor")
        dim = rank_dim(key)
        if tuple(t.shape) != tuple(shape):
            ok = (
                instruction.may_shrink_rank
                and dim is not None
                and t.dim() == len(shape)
                and all(a == b for i, (a, b) in enumerate(zip(t.shape, shape)) if i != dim)
                and 1 <= t.shape[dim] <= shape[dim]
            )
            if not ok:
                if dim is not None and t.dim() == len(shape) and t.shape[dim] != shape[dim]:
                    raise UpdateRejected(f"{key}: rank {t.shape[dim]} but the instructed rank is {shape[dim]}")
                raise UpdateRejected(f"{key}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        sent = instruction.arrays.get(key)
        if sent is not None and t.dtype != sent.dtype:
            raise UpdateRejected(
                f"{key}: dtype {str(t.dtype).replace('torch.', '')}, but "
                f"{str(sent.dtype).replace('torch.', '')} was sent"
            )
        if sent is None:  # an array the server did not send (FLoRA's fresh factors): the payload's dtype
            if unsent is None:
                unsent = unsent_dtype(instruction.arrays)
            if t.is_floating_point() and t.dtype != unsent:
                raise UpdateRejected(
                    f"{key}: dtype {str(t.dtype).replace('torch.', '')}, but the method's "
                    f"arrays are {str(unsent).replace('torch.', '')}"
                )
            if not t.is_floating_point() and (t.dtype == torch.bool or t.is_complex()):
                raise UpdateRejected(
                    f"{key}: dtype {str(t.dtype).replace('torch.', '')} is neither the method's "
                    "floating-point dtype nor an integer index"
                )
        if dim is not None:
            module = key.rsplit(".", 2)[0]
            r = t.shape[dim]
            if ranks.setdefault(module, r) != r:
                raise UpdateRejected(f"{module}: lora_A and lora_B disagree on the rank")
    bad = non_finite_keys(reply.arrays)
    if bad:
        raise UpdateRejected(f"{bad[0]}: contains NaN or Inf")


def unsent_dtype(sent: Arrays) -> torch.dtype:
    """Give the dtype an array the server did not send must have.

    Args:
        sent: the arrays the server sent.

    Returns:
        The dtype of the sent floating-point arrays when they agree on one, else float32
        (nestfed's adapter dtype).
    """
    found = {v.dtype for v in sent.values() if v.is_floating_point()}
    return found.pop() if len(found) == 1 else torch.float32


def non_finite_keys(arrays: Arrays) -> list[str]:
    """Find the keys whose floating-point tensors hold NaN or Inf.

    Small payloads are checked in one pass over their concatenation first (a few kernels per
    reply, not per array).

    Args:
        arrays: the payload.

    Returns:
        The keys, sorted; [] when every entry is finite.
    """
    floats = [(k, t) for k, t in arrays.items() if t.is_floating_point()]
    if sum(t.numel() for _, t in floats) <= FLAT_NUMEL and (
        not floats or bool(torch.isfinite(torch.cat([t.reshape(-1) for _, t in floats])).all())
    ):
        return []
    return sorted(k for k, t in floats if not bool(torch.isfinite(t).all()))
