"""FedMKT (Fan et al., "FedMKT: Federated Mutual Knowledge Transfer for Large and Small Language
Models", COLING 2025): the home of the baseline FedSLM is measured against.

No parameters travel: the server's full model (with LoRA) and the clients' compressed models
(nestfed.methods.compressed, FedSLM's groups) exchange top-k logits on the server text
(distillation.py; clients.py; strategy.py; run.py sets a run up). Sections: ``[fedmkt]`` and
``[compression]`` (shared). The clients' own models are their kept state, checkpointed with every
round, so a run resumes exactly. The exported adapter is the server's LoRA after the last round.
"""

from __future__ import annotations

from nestfed.config.capabilities import Capability as C
from nestfed.methods.compressed.options import CompressionOptions, check_compression
from nestfed.methods.fedmkt.options import FedMKTOptions
from nestfed.methods.method import Method

METHOD = Method(
    "fedmkt",
    "mutual top-k logit distillation between the server's full model and the clients' "
    "compressed models on a shared text (Fan et al. 2025)",
    "nestfed.methods.fedmkt.run",
    sections={"fedmkt": FedMKTOptions, "compression": CompressionOptions},
    check_config=check_compression,
    capabilities=frozenset({C.HETEROGENEOUS_RANKS, C.RESUME}),
    refusals={
        C.QUANTIZED_BACKBONE: "its clients' compressed models are derived from an SVD of the dense pretrained "
        "weights (nestfed.nn.svd), which a quantised weight does not hold",
        C.ROBUST_AGGREGATION: "its server learns by distillation from logits, not by combining parameter "
        "updates (docs/trust.md)",
        C.SERVER_OPTIMIZER: "its server learns by distillation, and its state holds the server's knowledge "
        "(top-k logits recomputed every round), not an aggregate of client updates",
        C.ELASTIC_RANKS: "its clients' models are compressed at fixed ratios; no LoRA rank travels",
        C.GLOBAL_MODEL: "its clients run compressed models; the server's full model is distilled, not shared",
        C.EXPORT_AT_RANK: "its clients run compressed models; no LoRA adapter travels",
    },
    comparison="compressed",
    chooses_memory=True,  # compression.ratio_choices: a budget chooses the client's ratio (compressed/ratio_choice.py)
)

__all__ = ["METHOD"]
