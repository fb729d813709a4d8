"""The ``[compression]`` section: the compressed client models FedSLM and FedMKT share."""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config import ExperimentConfig
from nestfed.nn.patterns import DEFAULT_TARGET

FUSIONS = ("coverage", "average")
#: every client's compression ratio when neither ``client_ratios`` nor ``ratio_choices`` is set
DEFAULT_RATIO = 0.5
WHITENINGS = ("none", "activation")


@dataclass(frozen=True)
class CompressionOptions:
    """Options of ``[compression]``: compressed clients (arXiv 2607.29071 step 1; docs/methods.md, FedSLM).

    Attributes:
        client_ratios: the compression ratio rho of each client (one value = every client; empty =
            `DEFAULT_RATIO` for every client, unless ``ratio_choices`` is set); each distinct value
            is a group.
        ratio_choices: the ratios a memory budget chooses from (``population.memory_mib``; empty =
            off): each client's rho is the largest choice whose compressed model's training
            footprint fits its budget (nestfed.methods.compressed.ratio_choice; the footprint is
            the accounting of nestfed.nn.footprint, measured on each choice's derived model). Set
            with budgets only, and instead of ``client_ratios``.
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

    client_ratios: tuple[float, ...] = ()
    ratio_choices: tuple[float, ...] = ()
    target: str = DEFAULT_TARGET
    train_layers: tuple[int, ...] = ()
    fusion: str = "coverage"
    core_lr: float = 1e-2
    server_blocks: int = 16
    whitening: str = "activation"

    def __post_init__(self) -> None:
        if any(r <= 0 for r in self.client_ratios):
            raise ValueError(f"client_ratios: every ratio must be > 0, got {list(self.client_ratios)}")
        if any(r <= 0 for r in self.ratio_choices) or len(set(self.ratio_choices)) != len(self.ratio_choices):
            raise ValueError(f"ratio_choices: distinct ratios > 0, got {list(self.ratio_choices)}")
        if self.client_ratios and self.ratio_choices:
            raise ValueError(
                "client_ratios and ratio_choices: set one (fixed ratios, or ratios chosen by the memory budgets)"
            )
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be 'coverage' or 'average', got '{self.fusion}'")
        if self.whitening not in WHITENINGS:
            raise ValueError(f"whitening must be 'none' or 'activation', got '{self.whitening}'")
        if self.core_lr <= 0 or self.server_blocks < 1:
            raise ValueError("core_lr must be > 0 and server_blocks >= 1")


def check_compression(cfg: ExperimentConfig) -> None:
    """One compression ratio or one per client, ratio choices exactly with memory budgets, and documents as the unit.

    The server text is the documents no client uses.

    Args:
        cfg: the experiment.

    Raises:
        ValueError: naming compression.client_ratios, compression.ratio_choices,
            population.memory_mib or data.unit.
    """
    c = cfg.section("compression")
    n = len(c.client_ratios)
    if n not in (0, 1, cfg.data.num_clients):
        raise ValueError(f"compression.client_ratios: {n} ratios for data.num_clients = {cfg.data.num_clients} clients")
    budgets = bool(cfg.population.memory_mib)
    if c.ratio_choices and not budgets:
        raise ValueError(
            "compression.ratio_choices: only population.memory_mib chooses from it "
            "(without budgets give compression.client_ratios)"
        )
    if budgets and c.client_ratios:
        raise ValueError(
            "compression.client_ratios and population.memory_mib: set one (with budgets, "
            "compression.ratio_choices lists the ratios a budget chooses from)"
        )
    if budgets and not c.ratio_choices:
        raise ValueError(
            f"population.memory_mib: {cfg.strategy.name} chooses each client's compression ratio from "
            "compression.ratio_choices, which is empty; list the ratios a budget chooses from"
        )
    if cfg.data.unit != "document":
        raise ValueError(
            "data.unit: the compressed methods draw the server text from the documents no client uses "
            "(data.unit = 'document')"
        )
