"""Which Linear layers of a model a pattern selects, and the frozen Linear behind a wrapped one."""

from __future__ import annotations

import re

from torch import nn

from nestfed.nn.lora import LoraLinear
from nestfed.nn.patterns import DEFAULT_TARGET


def base_linear(module: nn.Module) -> nn.Linear:
    """Find the frozen ``nn.Linear`` of a module.

    The SVD is of the pretrained W; a LoRA update on top is ignored.

    Args:
        module: an ``nn.Linear`` or a `LoraLinear`.

    Returns:
        The module itself, or a `LoraLinear`'s ``base_layer``.

    Raises:
        TypeError: for any other module.
    """
    if isinstance(module, LoraLinear):
        return module.base_layer
    if isinstance(module, nn.Linear):
        return module
    raise TypeError(f"{type(module).__name__} is not a Linear layer")


def target_linear_names(model: nn.Module, pattern: str = DEFAULT_TARGET) -> list[str]:
    """List the Linear modules (``nn.Linear`` or LoRA-wrapped) whose full path matches a pattern.

    Args:
        model: the model searched.
        pattern: a regex, matched against the whole module path.

    Returns:
        The module paths, in the model's order.

    Raises:
        ValueError: for an invalid regex or when nothing matches.
    """
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"svd target pattern {pattern!r} is not a valid regex: {exc}") from None
    names = [
        n
        for n, m in model.named_modules()
        if (
            isinstance(m, LoraLinear)
            or (isinstance(m, nn.Linear) and not n.endswith("base_layer") and ".lora_" not in n)
        )
        and rx.fullmatch(n)
    ]
    if not names:
        raise ValueError(f"svd target pattern {pattern!r} matched no Linear layer")
    return names
