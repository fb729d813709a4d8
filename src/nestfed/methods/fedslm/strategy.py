"""FedSLM's two-stage aggregation of SVD cores (arXiv 2607.29071, steps 2 and 3; docs/methods.md section 2).

Every compressed layer l has server-side bases U_l [out, R_l], V_l [in, R_l] (one SVD, R_l the
largest group rank); group g uses the prefixes U_l[:, :r_gl], V_l[:, :r_gl] and trains a core
Sigma_gl [r_gl, r_gl]. Because all groups' bases are prefixes of the same bases (orthonormal for
plain SVD; for the default whitened SVD U is orthonormal and V has a dual basis D with D^T V = I,
nn/whitening.py), every reconstruction W_gl = U_g Sigma_gl V_g^T lies in span(U_l) x span(V_l), so the server represents
the fused weak model W_g = U_l M_l V_l^T by its core M_l [R_l, R_l] and never forms an [out, in]
matrix (`nestfed.nn.svd.reconstruct` / `nestfed.nn.svd.project` are the
dense references the tests compare with).

- Step 2, intra-group aggregation: Sigma_g = sum_{k in g} n_k Sigma_k / N_g (FedAvg).
- Step 3, cross-group fusion into W_g, weighted by group data size N_g:
  ``fusion = "average"`` (the paper's rule): W_g = sum_g N_g W_g' / sum_g N_g, i.e.
  M = sum_g N_g pad(Sigma_g) / sum_g N_g (zero-padded to R).
  ``fusion = "coverage"`` (default, our decision, see below): entry (a, b) of M is the N_g-weighted
  mean over only the groups whose rank covers it (r_g > max(a, b)); an entry no replying group
  covers keeps its previous value.
- Next round (docs/methods.md decision): Sigma_g <- U_g^T W_g V_g, which for nested bases is exactly
  the leading block M[:r_g, :r_g].

Why ``coverage`` is the default: under ``average`` a coordinate that only large groups hold is
multiplied by their data share every round. With untrained cores M = diag(S) the projection
returns S_k * (sum of N_g over groups with r_g > k) / N, so the extra singular directions of the
largest group decay geometrically round after round (tested: after t rounds by share^t) even when
no client learns anything. ``coverage`` treats a coordinate a group does not hold as unobserved
rather than zero (the same argument as PreLort's segment-wise average against ZeroPad): untrained
cores are a fixed point, equal ranks reduce both rules to FedAvg, and the weak model is still a
data-size weighted fusion of the groups' reconstructions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nestfed.federation.aggregation import weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply
from nestfed.federation.strategy import copy_state
from nestfed.methods.compressed.options import FUSIONS
from nestfed.nn.svd import core_key


def pad_core(core: torch.Tensor, R: int) -> torch.Tensor:
    """A core zero-padded to [R, R].

    Args:
        core: [r, r].
        R: the padded size.

    Returns:
        [R, R].

    Raises:
        ValueError: when r > R or the core is not square.
    """
    r = core.shape[0]
    if core.dim() != 2 or core.shape[1] != r or r > R:
        raise ValueError(f"core of shape {tuple(core.shape)} cannot be padded to ({R}, {R})")
    out = core.new_zeros(R, R)
    out[:r, :r] = core
    return out


def fuse_cores(
    previous: torch.Tensor, cores: Sequence[torch.Tensor], weights: Sequence[float], fusion: str = "coverage"
) -> torch.Tensor:
    """Cross-group fusion of one layer (FedSLM step 3) in the shared SVD basis.

    Args:
        previous: M [R, R] of the last round (kept where no group covers an entry under
            ``coverage``).
        cores: the group-averaged Sigma_g [r_g, r_g], r_g <= R.
        weights: N_g (group data size, examples), one per core.
        fusion: ``coverage`` or ``average`` (module docstring).

    Returns:
        The new M [R, R], W_g = U M V^T.

    Raises:
        ValueError: for an unknown fusion, no groups, non-positive weights, or a core larger than R.
    """
    if fusion not in FUSIONS:
        raise ValueError(f"unknown fusion {fusion!r} (known: {', '.join(FUSIONS)})")
    if not cores:
        raise ValueError("no group cores to fuse")
    w = [float(x) for x in weights]
    if len(w) != len(cores) or any(x <= 0 for x in w):
        raise ValueError(f"group weights must be positive, one per core, got {w}")
    R = previous.shape[0]
    num = torch.zeros_like(previous)
    den = torch.zeros_like(previous)
    for core, wg in zip(cores, w):
        r = core.shape[0]
        num += wg * pad_core(core.to(previous.dtype), R)
        den[:r, :r] += wg
    if fusion == "average":
        return num / sum(w)
    return torch.where(den > 0, num / den.clamp_min(1e-30), previous)


def intra_group_mean(cores: Sequence[torch.Tensor], examples: Sequence[float]) -> torch.Tensor:
    """FedSLM step 2: the n_k-weighted mean of the cores of one group's clients.

    Args:
        cores: [r, r] each.
        examples: the n_k.

    Returns:
        The mean core [r, r].
    """
    return weighted_mean(list(cores), list(examples))


@dataclass
class SLMGroups:
    """The groups of a FedSLM federation.

    Attributes:
        ratios: ratios[g] is group g's compression ratio rho_g.
        ranks: ranks[g] is {module path: r_gl} of the layers whose cores train and travel.
        client_group: {cid: g}.
        singular_values: {module path: S_l [R_l]} with R_l = max_g r_gl (the initial cores are
            diag(S[:r])).
    """

    ratios: list[float]
    ranks: list[dict[str, int]]
    client_group: dict[int, int]
    singular_values: dict[str, torch.Tensor] = field(default_factory=dict)

    def max_rank(self, module: str) -> int:
        """R_l: the largest rank any group uses at ``module``.

        Args:
            module: the module path.

        Returns:
            R_l.
        """
        return max(r[module] for r in self.ranks)


class FedSLM:
    """The FedSLM strategy: configure sends each client its group's projected cores, aggregate runs steps 2 and 3.

    Pure: tensors and numbers only.

    Args:
        groups: the federation's groups.
        fusion: ``coverage`` (default) or ``average`` (module docstring).
        seed: recorded in each instruction for the client's batch order.

    Raises:
        ValueError: naming compression.fusion for an unknown fusion.
    """

    name = "fedslm"

    def __init__(self, groups: SLMGroups, fusion: str = "coverage", seed: int = 0):
        if fusion not in FUSIONS:
            raise ValueError(f"compression.fusion: unknown fusion {fusion!r} (known: {', '.join(FUSIONS)})")
        self.groups = groups
        self.fusion = fusion
        self.seed = seed

    # -- state ---------------------------------------------------------------------------------
    def initialize(self, shapes: dict[str, tuple[int, int]] | None, clients: list[ClientInfo]) -> GlobalState:
        """M_l = diag(S_l[:R_l]) for every trained layer.

        Args:
            shapes: unused (the cores' shapes come from the groups).
            clients: the federation's clients.

        Returns:
            The round-0 state, its meta holding the groups, ratios and fusion.

        Raises:
            ValueError: for a client without a group or a layer without singular values.
        """
        for c in clients:
            if c.cid not in self.groups.client_group:
                raise ValueError(f"client {c.cid}: no FedSLM group (compression ratio) assigned")
        arrays = {}
        for module in sorted(self.groups.ranks[0]):
            if module not in self.groups.singular_values:
                raise ValueError(f"{module}: no singular values to initialise its core")
            R = self.groups.max_rank(module)
            arrays[core_key(module)] = torch.diag(self.groups.singular_values[module][:R].float())
        meta = {
            "groups": {str(c): g for c, g in self.groups.client_group.items()},
            "ratios": list(self.groups.ratios),
            "fusion": self.fusion,
        }
        return GlobalState(arrays, meta)

    def group_cores(self, state: GlobalState, g: int) -> Arrays:
        """Group g's cores for the next round: Sigma_gl = U_gl^T W_g V_gl = M_l[:r_gl, :r_gl].

        Args:
            state: the global state.
            g: the group.

        Returns:
            {core key: [r_gl, r_gl]} (copies).
        """
        out = {}
        for module, r in self.groups.ranks[g].items():
            out[core_key(module)] = state.arrays[core_key(module)][:r, :r].clone()
        return out

    # -- configure -----------------------------------------------------------------------------
    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """One instruction per client: its group's cores, at scale 1.

        Args:
            rnd: the round (1-based).
            state: the global state.
            clients: the sampled clients.

        Returns:
            {cid: instruction}.
        """
        out = {}
        for c in clients:
            g = self.groups.client_group[c.cid]
            sent = self.group_cores(state, g)
            config: dict[str, Any] = {
                "scaling": 1.0,
                "round": rnd,
                "seed": self.seed,
                "group": g,
                "ratio": self.groups.ratios[g],
            }
            out[c.cid] = Instruction(sent, config, {k: tuple(v.shape) for k, v in sent.items()})
        return out

    # -- aggregate -----------------------------------------------------------------------------
    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Step 2 (FedAvg of cores inside each group), then step 3 (fusion across groups).

        Args:
            rnd: the round.
            state: the global state.
            replies: {cid: reply}.

        Returns:
            The new state, its meta's ``group_examples`` the round's N_g.
        """
        new = copy_state(state)
        members: dict[int, list[int]] = {}
        for cid in sorted(replies):
            members.setdefault(self.groups.client_group[cid], []).append(cid)
        sizes = {g: float(sum(replies[c].num_examples for c in cids)) for g, cids in members.items()}
        for key in state.arrays:
            cores, weights = [], []
            for g, cids in sorted(members.items()):
                cores.append(
                    intra_group_mean([replies[c].arrays[key] for c in cids], [replies[c].num_examples for c in cids])
                )
                weights.append(sizes[g])
            new.arrays[key] = fuse_cores(state.arrays[key], cores, weights, self.fusion)
        new.meta["group_examples"] = {str(g): n for g, n in sorted(sizes.items())}
        return new

    # -- deploy / export -----------------------------------------------------------------------
    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """A client's cores (its group's block of M), or the weak model's full cores M.

        Args:
            state: the global state.
            cid: the client; None for the weak model.

        Returns:
            The cores and the scale 1.
        """
        if cid is None:
            return {k: v.clone() for k, v in state.arrays.items()}, 1.0
        return self.group_cores(state, self.groups.client_group[cid]), 1.0

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The weak global model's cores {core key: M_l [R_l, R_l]} (scale 1, unused).

        Args:
            state: the global state.

        Returns:
            The cores and the scale 1.
        """
        return self.deploy(state, None)
