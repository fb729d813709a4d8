"""The ``[compression]`` section: the compressed client models FedSLM and FedMKT share."""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config import ExperimentConfig
from nestfed.nn.patterns import DEFAULT_TARGET

FUSIONS = ("coverage", "average")
WHITENINGS = ("none", "activation")


@dataclass(frozen=True)
class CompressionOptions:
    """Options of ``[compression]``: compressed clients (arXiv 2607.29071 step 1; docs/methods.md, FedSLM).

    Attributes:
        client_ratios: the compression ratio rho of each client (one value = every client); each
            distinct value is a group.
        target: regex over module paths of the Linear layers factorised as U Sigma V^T (default
            every attention and MLP projection of the decoder blocks).
        train_layers: decoder layers whose cores train and travel (negative counts from the top;
            empty = every compressed layer); the other cores stay diag(S).
        fusion: ``coverage`` or ``average`` (FedSLM's cross-group fusion).
        core_lr: AdamW learning rate of the cores (> 0).
        server_blocks: blocks of unlabeled server text held out from every client (elicitation's
            D_server, FedMKT's public set, the whitening's calibration text; >= 1).
        whitening: ``activation`` (default, our decision beyond the paper's plain SVD: SVD-LLM's
            truncation-aware data whitening, arXiv 2403.07378, section 3.1; needs server_blocks *
            data.block_size >= the widest compressed layer's input size, checked when the model is
            prepared) or ``none`` (the plain truncated SVD of W).

    Raises:
        ValueError: for a value out of range or an unknown fusion or whitening.
    """

    client_ratios: tuple[float, ...] = (0.5,)
    target: str = DEFAULT_TARGET
    train_layers: tuple[int, ...] = ()
    fusion: str = "coverage"
    core_lr: float = 1e-2
    server_blocks: int = 16
    whitening: str = "activation"

    def __post_init__(self) -> None:
        if not self.client_ratios or any(r <= 0 for r in self.client_ratios):
            raise ValueError(f"client_ratios: every ratio must be > 0, got {list(self.client_ratios)}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be 'coverage' or 'average', got '{self.fusion}'")
        if self.whitening not in WHITENINGS:
            raise ValueError(f"whitening must be 'none' or 'activation', got '{self.whitening}'")
        if self.core_lr <= 0 or self.server_blocks < 1:
            raise ValueError("core_lr must be > 0 and server_blocks >= 1")


def check_compression(cfg: ExperimentConfig) -> None:
    """One compression ratio or one per client, and documents as the unit.

    The server text is the documents no client uses.

    Args:
        cfg: the experiment.

    Raises:
        ValueError: naming compression.client_ratios or data.unit.
    """
    n = len(cfg.section("compression").client_ratios)
    if n not in (1, cfg.data.num_clients):
        raise ValueError(f"compression.client_ratios: {n} ratios for data.num_clients = {cfg.data.num_clients} clients")
    if cfg.data.unit != "document":
        raise ValueError(
            "data.unit: the compressed methods draw the server text from the documents no client uses "
            "(data.unit = 'document')"
        )
