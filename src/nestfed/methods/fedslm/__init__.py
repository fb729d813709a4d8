"""FedSLM (arXiv 2607.29071): the home of the method.

Clients run SVD-compressed models at nested ranks (one group per compression ratio; shared with
FedMKT in nestfed.methods.compressed) and train small cores; the server fuses the cores within and
across groups (strategy.py), builds the weak global model W_g (weak_model.py), then lifts the full
model by weak-to-strong elicitation (elicitation.py) for "none", every ``compare_alphas`` and
``alpha``; run.py sets a run up. Sections: ``[compression]`` (shared) and ``[elicitation]``.

Its run directory adds ``weak_model_cores.safetensors`` (the fused cores M of W_g = U M V^T), and
the summary ``weak_eval`` / ``server_eval`` / ``elicitation`` / ``client_memory``. The exported
adapter is the server model's LoRA after elicitation with ``elicitation.alpha``.
"""

from __future__ import annotations

from nestfed.config.capabilities import Capability as C
from nestfed.methods.compressed.options import CompressionOptions, check_compression
from nestfed.methods.fedslm.options import ElicitationOptions
from nestfed.methods.method import Method

SECTIONS = {"compression": CompressionOptions, "elicitation": ElicitationOptions}

METHOD = Method(
    "fedslm",
    "clients run SVD-compressed models at nested ranks and train small cores; the server "
    "fuses across groups, then lifts the full model by weak-to-strong distillation (arXiv 2607.29071)",
    "nestfed.methods.fedslm.run",
    sections=SECTIONS,
    check_config=check_compression,
    # SERVER_OPTIMIZER: the fused cores M_l keep their shape, so the fusion minus M_l is an update
    capabilities=frozenset({C.HETEROGENEOUS_RANKS, C.SERVER_OPTIMIZER, C.RESUME}),
    refusals={
        C.QUANTIZED_BACKBONE: "its clients' models are derived from an SVD of the dense pretrained weights "
        "(nestfed.nn.svd), which a quantised weight does not hold; compare it with nf4 clients of another "
        "method at the same memory budget instead (docs/scale.md)",
        C.ROBUST_AGGREGATION: "its clients train cores of different shapes in nested SVD groups, fused by "
        "coverage; a rule would need one block per group and core position, which is not built (the norm "
        "bound, validation.max_update_norm, applies; docs/trust.md)",
        C.ELASTIC_RANKS: "its clients' ranks are compression ratios of their models, fixed when the models are derived",
        C.GLOBAL_MODEL: "its clients run compressed models at nested ranks, not one global model",
        C.EXPORT_AT_RANK: "its clients run compressed models at nested ranks, not one global LoRA adapter",
    },
    comparison="compressed",
    chooses_memory=True,  # compression.ratio_choices: a budget chooses the client's ratio (compressed/ratio_choice.py)
)

__all__ = ["METHOD", "SECTIONS"]
