"""Split a decoder-only LM at its first adapted layer and reuse the frozen prefix's outputs.

When adapters sit only on the top decoder layers, the layers below them are frozen and their
outputs for a fixed dataset never change: `prefix_features` computes them once, and
`lm_logits` runs only the remaining layers, the final norm and the LM head. Backward stops
at the first adapted layer. The logits equal the full model's (tested); this is a CPU speed-up
to be reported as what it is (docs/methods.md section 4, "the frozen prefix"), not an approximation.

Works for the families nestfed computes exactly (nestfed.nn.layer_inputs.FAMILIES: Llama, Qwen2,
Qwen3, Gemma-3's text model; ``model.model.layers``, ``model.model.rotary_emb``,
``model.model.norm``, ``model.lm_head``) over right-padded sequences (padding only follows real
tokens), under any attention implementation and with sliding-window layers: each layer gets the
mask and rotary embeddings of its type that the model's own forward builds (Gemma-3's local and
global layers, nestfed.nn.layer_inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.nn.keys import layer_of
from nestfed.nn.layer_inputs import decoder_inputs
from nestfed.nn.lora import lora_modules
from nestfed.nn.placement import autocast, to_model


def first_adapted_layer(model: nn.Module) -> int:
    """Find the lowest decoder layer that holds a LoRA layer.

    Args:
        model: the backbone.

    Returns:
        Its index; 0 when there is none or a LoRA layer sits outside the decoder layers.
    """
    idx = []
    for name in lora_modules(model):
        i = layer_of(name)
        if i is None:
            return 0
        idx.append(i)
    return min(idx) if idx else 0


def _run_layers(model: nn.Module, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    inner = model.model
    T = hidden.shape[1]
    position_ids = torch.arange(T, device=hidden.device).unsqueeze(0)
    masks, embeddings = decoder_inputs(model, hidden, position_ids)
    for i, layer in enumerate(inner.layers[start:stop], start):
        out = layer(hidden, attention_mask=masks[i], position_ids=position_ids, position_embeddings=embeddings[i])
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def labelled_length(labels: torch.Tensor) -> torch.Tensor:
    """Count, per row, the positions its loss depends on: up to and including its last labelled token.

    A causal model's outputs there never depend on the positions after them.

    Args:
        labels: [N, T] labels, -100 = no loss.

    Returns:
        [N] lengths in tokens; 0 for a row without labels.
    """
    positions = torch.arange(1, labels.shape[1] + 1, device=labels.device)
    return ((labels != -100) * positions).amax(dim=1) if labels.numel() else labels.new_zeros(labels.shape[0])


@torch.no_grad()
def prefix_features(
    model: nn.Module, input_ids: torch.Tensor, start: int, batch_size: int = 8, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Compute the hidden states entering a decoder layer, without gradients.

    The layers run on the model's device (under its autocast, nestfed.nn.placement); the result is
    kept in host memory, so a GPU holds one batch's activations at a time. With ``lengths``, rows
    are batched longest first and each batch runs only to its longest row, so right padding costs
    nothing (MMLU prompts: about half the positions).

    Args:
        model: the backbone.
        input_ids: [N, T] token ids.
        start: the decoder layer entered; 0 gives the token embeddings.
        batch_size: sequences per forward.
        lengths: [N] tokens (e.g. `labelled_length`): only the first ``lengths[i]`` positions
            of row i are needed; None = all of them.

    Returns:
        [N, T, hidden] in host memory; positions at or past a row's length hold zeros or values
        nobody reads.
    """
    N, T = input_ids.shape

    def run(ids: torch.Tensor) -> torch.Tensor:
        with autocast(model):
            return _run_layers(model, model.model.embed_tokens(to_model(model, ids)), 0, start).cpu()

    if lengths is None:
        outs = [run(input_ids[i : i + batch_size]) for i in range(0, N, batch_size)]
        return torch.cat(outs) if outs else torch.empty(0)
    emb = model.model.embed_tokens.weight
    out = torch.zeros(N, T, emb.shape[1], dtype=emb.dtype)
    order = torch.argsort(lengths.clamp(1, T), descending=True, stable=True)
    for i in range(0, N, batch_size):
        rows = order[i : i + batch_size]
        t = int(lengths[rows].clamp(1, T).max())
        out[rows, :t] = run(input_ids[rows, :t])
    return out


def final_hidden(
    model: nn.Module, input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None, start: int = 0
) -> torch.Tensor:
    """Compute the normed last hidden states (what the LM head reads).

    Args:
        model: the backbone.
        input_ids: [B, T] token ids.
        hidden: [B, T, d] the hidden states entering layer ``start``.
        start: the layer ``hidden`` enters.

    Returns:
        [B, T, d] on the model's device.

    Raises:
        ValueError: unless exactly one of input_ids and hidden is given.
    """
    if (input_ids is None) == (hidden is None):
        raise ValueError("give exactly one of input_ids and hidden")
    with autocast(model):
        if hidden is None:
            hidden = model.model.embed_tokens(to_model(model, input_ids))
            start = 0
        return model.model.norm(_run_layers(model, to_model(model, hidden), start, len(model.model.layers)))


def lm_logits(
    model: nn.Module, input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None, start: int = 0
) -> torch.Tensor:
    """Compute the logits from token ids, or from the hidden states entering a layer.

    Args:
        model: the backbone.
        input_ids: [B, T] token ids (may be in host memory: moved to the model's device).
        hidden: [B, T, d] the hidden states entering layer ``start`` (likewise).
        start: the layer ``hidden`` enters.

    Returns:
        [B, T, vocab] on the model's device.

    Raises:
        ValueError: unless exactly one of input_ids and hidden is given.
    """
    h = final_hidden(model, input_ids, hidden, start)
    with autocast(model):
        return model.lm_head(h)


def labelled_logits(
    model: nn.Module,
    labels: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the LM head only where a next token is labelled: what every loss here needs.

    The same values as ``lm_logits`` at those positions; on multiple-choice or response-only batches
    (one or a few labelled tokens per row) it skips the [B, T, vocab] head, most of a step's cost on
    SmolLM2 (49,152-word vocabulary), and the layers run only up to the batch's last labelled
    position (`labelled_length`: right padding after it costs nothing).

    Args:
        model: the backbone.
        labels: [B, T] (HF convention: logits[t] predict labels[t + 1], -100 ignored).
        input_ids: as in `lm_logits`.
        hidden: as in `lm_logits`.
        start: as in `lm_logits`.

    Returns:
        (logits [N, vocab], targets [N]) for the N labelled next tokens in row-major order.

    Raises:
        ValueError: as `final_hidden`.
    """
    t = max(int(labelled_length(labels).max()), 1) if labels.numel() else labels.shape[1]
    if t < labels.shape[1]:
        labels = labels[:, :t]
        input_ids = None if input_ids is None else input_ids[:, :t]
        hidden = None if hidden is None else hidden[:, :t]
    h = final_hidden(model, input_ids, hidden, start)
    labels = to_model(model, labels)
    mask = labels[:, 1:] != -100
    with autocast(model):
        return model.lm_head(h[:, :-1][mask]), labels[:, 1:][mask]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Compute the next-token cross-entropy, in nats.

    Args:
        logits: [B, T, V].
        labels: [B, T] (HF convention, -100 ignored).
        reduction: ``mean`` (per labelled token) or ``sum``.

    Returns:
        The loss, a scalar in float32.
    """
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction=reduction,
    )


@dataclass
class CachedText:
    """Token blocks as one model sees them.

    Attributes:
        input_ids: [N, T] token ids.
        hidden: [N, T, d] the outputs of the model's layers below ``start`` when those are frozen
            (the frozen prefix above); None otherwise.
        start: the layer ``hidden`` enters.
    """

    input_ids: torch.Tensor
    hidden: torch.Tensor | None = None
    start: int = 0

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        """Compute a model's logits on some of the blocks.

        Args:
            model: the backbone.
            idx: the blocks' indices.

        Returns:
            [len(idx), T, V] on the model's device.
        """
        if self.hidden is not None:
            return lm_logits(model, hidden=self.hidden[idx], start=self.start)
        return lm_logits(model, self.input_ids[idx])
