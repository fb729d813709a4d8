"""nestfed payloads <-> Flower records (flwr 1.42's Message API).

- Arrays (``{name: tensor}``) <-> ``ArrayRecord``: one ``Array`` per key, any shape, so each node
  may receive its own rank. Dtypes NumPy knows travel as NumPy arrays (Flower's own format);
  bfloat16 (which NumPy lacks) travels as raw little-endian bytes with stype ``torch.raw``.
  The round trip is bit-exact.
- Config dicts (JSON-able) <-> ``ConfigRecord``: ints, floats, strings, bools, bytes and
  homogeneous lists of them travel natively; anything else (None, nested dicts, mixed or nested
  lists, tuples) travels as JSON under the reserved key ``__json__`` and comes back as JSON
  values (tuples become lists).
- A client's reply -> ``RecordDict`` with ``arrays`` (ArrayRecord) and ``metrics``
  (MetricRecord holding ``num_examples`` and the float metrics).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from nestfed.federation.messages import Arrays, Reply

RAW_STYPE = "torch.raw"
JSON_KEY = "__json__"
_RAW_DTYPES = {torch.bfloat16: "bfloat16"}
_RAW_BACK = {v: k for k, v in _RAW_DTYPES.items()}


def tensor_to_array(t: torch.Tensor) -> Array:
    """One tensor as a Flower ``Array`` (detached, contiguous, on CPU).

    Args:
        t: a tensor of any shape and dtype; bfloat16 travels as raw bytes (stype ``torch.raw``).

    Returns:
        The ``Array``.
    """
    t = t.detach().contiguous().cpu()
    if t.dtype in _RAW_DTYPES:
        data = t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
        return Array(dtype=_RAW_DTYPES[t.dtype], shape=tuple(int(s) for s in t.shape), stype=RAW_STYPE, data=data)
    return Array(t.numpy())


def array_to_tensor(a: Array) -> torch.Tensor:
    """Inverse of `tensor_to_array`.

    Args:
        a: an ``Array``, NumPy-backed or raw (stype ``torch.raw``).

    Returns:
        A writable tensor that owns its memory, of the array's shape and dtype.

    Raises:
        ValueError: when a raw array's dtype is not one nestfed sends raw (bfloat16).
    """
    if a.stype == RAW_STYPE:
        if a.dtype not in _RAW_BACK:
            raise ValueError(f"unsupported raw dtype {a.dtype!r}")
        raw = np.frombuffer(a.data, dtype="<i2").copy()
        return torch.from_numpy(raw).view(_RAW_BACK[a.dtype]).reshape(tuple(a.shape))
    return torch.from_numpy(np.array(a.numpy(), copy=True))


def arrays_to_record(arrays: Arrays) -> ArrayRecord:
    """A nestfed payload as an ``ArrayRecord`` (keys and order kept).

    Args:
        arrays: the payload, ``{name: tensor}``.

    Returns:
        The ``ArrayRecord``, one ``Array`` per key.
    """
    rec = ArrayRecord()
    for key, t in arrays.items():
        rec[key] = tensor_to_array(t)
    return rec


def record_to_arrays(record: ArrayRecord) -> Arrays:
    """Inverse of `arrays_to_record`.

    Args:
        record: an ``ArrayRecord``.

    Returns:
        The payload, ``{name: tensor}``, keys and order kept.
    """
    return {key: array_to_tensor(a) for key, a in record.items()}


_SCALARS = (bool, int, float, str, bytes)


def _native(value: Any) -> bool:
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, list):
        if not value:
            return False  # the element type of an empty list is lost: send as JSON
        first = type(value[0])
        return first in _SCALARS and all(type(v) is first for v in value)
    return False


def config_to_record(config: dict[str, Any]) -> ConfigRecord:
    """A JSON-able config dict as a ``ConfigRecord`` (see the module docstring).

    Args:
        config: the config; values Flower cannot carry natively travel as JSON under ``__json__``.

    Returns:
        The ``ConfigRecord``.

    Raises:
        ValueError: when the config uses the reserved key ``__json__``.
    """
    native, other = {}, {}
    for key, value in config.items():
        if key == JSON_KEY:
            raise ValueError(f"config key {JSON_KEY!r} is reserved")
        (native if _native(value) else other)[key] = value
    rec = ConfigRecord(native)
    if other:
        rec[JSON_KEY] = json.dumps(other)
    return rec


def record_to_config(record: ConfigRecord) -> dict[str, Any]:
    """Inverse of `config_to_record`.

    Args:
        record: a ``ConfigRecord``.

    Returns:
        The config dict; JSON-carried values come back as JSON values (tuples as lists).
    """
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in record.items() if k != JSON_KEY}
    if JSON_KEY in record:
        out.update(json.loads(str(record[JSON_KEY])))
    return out


def reply_to_content(reply: Reply) -> RecordDict:
    """A client's reply as message content.

    Args:
        reply: the reply; its non-numeric (and bool) metrics are dropped.

    Returns:
        A ``RecordDict`` with ``arrays`` (ArrayRecord) and ``metrics`` (MetricRecord: ``num_examples``
        and the float metrics).
    """
    metrics: dict[str, Any] = {"num_examples": int(reply.num_examples)}
    for k, v in reply.metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            metrics[k] = float(v)
    return RecordDict({"arrays": arrays_to_record(reply.arrays), "metrics": MetricRecord(metrics)})


def content_to_reply(content: RecordDict) -> Reply:
    """Inverse of `reply_to_content`.

    Args:
        content: a ``RecordDict`` with ``arrays`` and ``metrics`` records.

    Returns:
        The reply.

    Raises:
        KeyError: when a record (or ``num_examples``) is missing.
    """
    arrays = record_to_arrays(content.array_records["arrays"])
    metrics = dict(content.metric_records["metrics"])
    n = metrics.pop("num_examples")
    return Reply(arrays, int(n) if isinstance(n, int) else n, {k: float(v) for k, v in metrics.items()})
