"""FedSLM's weak global model f_w (arXiv 2607.29071, step 3's W_g as a model) and how it sees the
server text and the clients' test data."""

from __future__ import annotations

import torch
from torch import nn

from nestfed.config import ExperimentConfig
from nestfed.data.clients import ClientData
from nestfed.federation.messages import Arrays
from nestfed.federation.prepared import Prepared
from nestfed.methods.compressed.setup import CompressedSetup
from nestfed.methods.fedslm.strategy import fuse_cores
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.frozen_prefix import CachedText, prefix_features
from nestfed.nn.svd import derive_compressed, layer_ranks


def weak_model(setup: CompressedSetup, prep: Prepared, fused: Arrays, fusion: str) -> nn.Module:
    """The weak global model f_w: the backbone with every compressed layer at the largest rank R, holding W_g = U M V^T.

    Trained layers take M from ``fused``; the other compressed layers take the fusion of the groups'
    fixed cores diag(S[:r_g]) weighted by N_g (``coverage``: diag(S[:R]); ``average``: the shrunken
    average; nestfed.methods.fedslm.strategy).

    Args:
        setup: the compressed side of the experiment.
        prep: the prepared experiment (its backbone).
        fused: {core key: M [R, R]} of the trained layers.
        fusion: ``coverage`` or ``average``.

    Returns:
        The weak model.
    """
    top = max(setup.ratios)
    sizes = setup.group_examples()
    groups = [g for g in range(len(setup.ratios)) if sizes[g] > 0]
    ranks = {g: layer_ranks(setup.bases, setup.ratios[g]) for g in groups}
    cores = {}
    for name, f in setup.bases.items():
        if name in setup.trained:
            continue
        R = layer_ranks({name: f}, top)[name]
        init = torch.diag(f.S[:R])
        cores[name] = fuse_cores(
            init, [torch.diag(f.S[: ranks[g][name]]) for g in groups], [sizes[g] for g in groups], fusion
        )
    weak = derive_compressed(prep.backbone.model, setup.bases, top, cores)
    apply_arrays(weak, fused, 1.0)
    return weak


def weak_views(
    setup: CompressedSetup, prep: Prepared, weak: nn.Module, cfg: ExperimentConfig
) -> tuple[CachedText, dict[int, ClientData]]:
    """The server text and the clients' test data as the weak model sees them (its frozen prefix).

    Args:
        setup: the compressed side of the experiment.
        prep: the prepared experiment (its clients' data).
        weak: the weak model.
        cfg: the experiment (``train.eval_batch_size``).

    Returns:
        The server text and {cid: ClientData} (test rows only).
    """
    if setup.shared_prefix or not setup.start:
        data = {cid: d for g in setup.data for cid, d in setup.data[g].items()}
        return setup.public["strong" if setup.shared_prefix else 0], data
    bs = cfg.train.eval_batch_size
    text = CachedText(
        setup.server_text.input_ids, prefix_features(weak, setup.server_text.input_ids, setup.start, bs), setup.start
    )
    data = {}
    for cid, d in prep.data.items():
        nd = ClientData(
            d.train_ids[:0], d.train_labels[:0], d.test_ids, d.test_labels, letter_ids=d.letter_ids, label=d.label
        )
        nd.start = setup.start
        nd.test_hidden = prefix_features(weak, d.test_ids, setup.start, bs)
        data[cid] = nd
    return text, data
