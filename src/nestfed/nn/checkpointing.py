"""Activation (gradient) checkpointing of a backbone's decoder layers: the memory lever that
trades a second forward of each layer in backward for not keeping its activations.

transformers' own mechanism does the work (``GradientCheckpointingLayer``: each decoder layer's
forward runs under ``torch.utils.checkpoint`` when the layer is in training mode), so it applies
however the layers are called, by the model's forward or by nestfed's frozen-prefix path
(nestfed.nn.frozen_prefix), which calls them one by one. The client trainer puts the model in
training mode for its local steps only; evaluation keeps everything as before.
"""

from __future__ import annotations

from torch import nn

from nestfed.errors import ConfigError


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer with the non-reentrant ``torch.utils.checkpoint``.

    Peak activation memory falls from every layer's saved tensors to one layer's plus each layer's
    input [B, T, d]; gradients are unchanged.

    Args:
        model: a transformers ``PreTrainedModel``.

    Raises:
        ConfigError: naming the model class when it does not support checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"train.gradient_checkpointing: {type(model).__name__} does not support activation checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
