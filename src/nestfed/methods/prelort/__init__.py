"""PreLort: prefix-nested LoRA with segment-wise aggregation (arXiv 2606.15963, sections 2.1-2.3).

Local objective (section 2.2): client k minimises the mean over its sub-ranks
R_k = {r in R_fed : r <= r_k} of the causal-LM loss with the adapter truncated to r, where R_fed
is the sorted set of distinct ranks in the federation. Aggregation (section 2.3): for each
segment [r_{l-1}, r_l) the n_k-weighted mean update of the clients with r_k >= r_l is added to
the global segment (`segment_average`).

Options: section ``[prelort]`` (`PreLortOptions`): the local objective (``nested``, the
paper's; ``sampled``, one sub-rank drawn per step, an unbiased estimate of the nested loss at the
cost of one pass; ``full_rank``, plain LoRA at r_k) and the aggregation (``segment``, the paper's;
``zeropad``). The paper's two ablations (section 4) are ``objective = "full_rank"`` ("nested
aggregation only") and ``aggregation = "zeropad"`` (the nested objective with zero-padded
aggregation). ``dilution`` (ours, beyond the paper) scales a segment's mean update by
(N_l / N)^dilution, N_l the examples of the round's clients holding it: 0 is the paper, 1 dilutes
a segment few clients hold as ZeroPad does (docs/methods.md, PreLort's top segment).
``min_holders`` (ours) leaves a segment held by fewer clients of the federation out of every
deployed and exported adapter; training and aggregation stay the paper's. ``deploy_rank =
"validated"`` (ours) has each client hold ``validation_rows`` of its training rows out of training
and run the prefix r in R_k of the global adapter with the lowest loss on them, chosen by the
client and kept on it (PreLortHooks).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

OBJECTIVES = ("nested", "sampled", "full_rank")
AGGREGATIONS = ("segment", "zeropad")
DEPLOY_RANKS = ("own", "validated")


@dataclass(frozen=True)
class PreLortOptions:
    """Options of ``[prelort]``.

    Attributes:
        objective: ``nested`` (mean loss over R_k, |R_k| passes per step; section 2.2), ``sampled``
            (one sub-rank r ~ Uniform(R_k) per step, drawn from the seed rule's stream
            ``subrank/<step>`` of (federation.seed, round, client): an unbiased estimate of the
            nested loss, one pass per step) or ``full_rank`` (plain LoRA at r_k: the ablation
            "nested aggregation only").
        aggregation: ``segment`` (section 2.3) or ``zeropad`` (ZeroPad's padded mean: the ablation
            "nested objective, zero-padded aggregation").
        dilution: the exponent of `nestfed.methods.prelort.strategy.segment_weight`, in [0,
            1] (0, the paper: every segment's mean update undiluted).
        min_holders: a segment [lo, hi) held by fewer clients of the federation (r_k >= hi) is left
            out of what any client deploys and of the exported adapter
            (`nestfed.methods.prelort.strategy.deploy_cap`; 0 or 1, the paper: every
            segment).
        deploy_rank: ``own`` (the paper: client k runs the prefix r_k) or ``validated`` (the prefix
            r in R_k with the lowest loss on ``validation_rows`` rows the client holds out of its
            training data, chosen on the global adapter it receives each round;
            `nestfed.methods.prelort.strategy.PreLortHooks`).
        validation_rows: the training rows a client holds out to choose its rank under ``deploy_rank
            = "validated"``, an integer >= 1 (unused otherwise).

    Raises:
        ValueError: naming the field for any other value.
    """

    objective: str = "nested"
    aggregation: str = "segment"
    dilution: float = 0.0
    min_holders: int = 0
    deploy_rank: str = "own"
    validation_rows: int = 4

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: unknown objective '{self.objective}' (known: {', '.join(OBJECTIVES)})")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation: unknown aggregation '{self.aggregation}' (known: {', '.join(AGGREGATIONS)})"
            )
        if isinstance(self.dilution, bool) or not 0.0 <= float(self.dilution) <= 1.0:
            raise ValueError(f"dilution: {self.dilution!r} is not in [0, 1]")
        if isinstance(self.min_holders, bool) or not isinstance(self.min_holders, int) or self.min_holders < 0:
            raise ValueError(f"min_holders: {self.min_holders!r} is not a count of clients (an integer >= 0)")
        if self.deploy_rank not in DEPLOY_RANKS:
            raise ValueError(f"deploy_rank: unknown choice '{self.deploy_rank}' (known: {', '.join(DEPLOY_RANKS)})")
        rows = self.validation_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"validation_rows: {self.validation_rows!r} is not a count of rows (an integer >= 1)")


METHOD = lora_method(
    "prelort",
    "clients train every prefix sub-rank r in R_k; the server averages each rank "
    "segment over the clients that hold it (arXiv 2606.15963)",
    "nestfed.methods.prelort.strategy",
    sections={"prelort": PreLortOptions},
    capabilities=RANK_PREFIX_CLIENTS | MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.SECURE_AGGREGATION, C.RESUME},
)
