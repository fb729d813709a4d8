"""The frozen factors A and B of Fed-SB and RAVAN: drawn once from the seed rule, never sent.

The server and every client draw the same A [r, in] and B [out, r] for each layer from the run's
LoRA seed (`frozen_factors`), so a payload carries only the core (the paper's "the server
distributes frozen adapters B and A", done once, by the seed): the client hooks (`CoreHooks`)
rebuild A and B before loading. A client of rank r_k below r receives its core prefix [r_k, q] and
the other heads [r - r_k, q] (``frozen_heads`` key), which it runs as its frozen residual
s B[:, r_k:] blockdiag(heads) A[r_k:] (`client_payload`), so it computes the global model.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays
from nestfed.nn.keys import PEFT_PREFIX, merged_key, module_of, peft_key
from nestfed.nn.lora import module_shapes
from nestfed.nn.lora_core import CORE_KINDS, core_matrix
from nestfed.seeds import stream_seed

#: instruction config keys the client hooks read: the LoRA seed, r, and the seed rule's stream
SEED, RANK, STREAM = "core_seed", "core_rank", "core_stream"


def frozen_heads_key(module: str) -> str:
    """Instruction key of the heads a client runs frozen: ``base_model.model.<module>.frozen_heads``.

    The array is [r - r_k, q]; it is never loaded as it is (`client_payload` turns it into the
    residual).

    Args:
        module: the layer's module path.

    Returns:
        The key.
    """
    return f"{PEFT_PREFIX}{module}.frozen_heads"


def orthonormal(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """A matrix with orthonormal columns (rows >= cols) or orthonormal rows (rows < cols).

    The Q factor of a standard Gaussian draw (Householder QR), each direction signed so that R's
    diagonal is positive (Q is then unique for the draw).

    Args:
        rows: the matrix's rows.
        cols: its columns.
        g: the random stream.

    Returns:
        [rows, cols] float32.
    """
    tall = rows >= cols
    gauss = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss if tall else gauss.T)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
    return (q if tall else q.T).to(torch.float32)


@lru_cache(maxsize=4096)
def _drawn(out_f: int, in_f: int, rank: int, seed: int, module: str, stream: str) -> tuple:
    g = torch.Generator().manual_seed(stream_seed(seed, 0, 0, f"{stream}/{module}"))
    return orthonormal(rank, in_f, g), orthonormal(out_f, rank, g)


def frozen_factors(out_f: int, in_f: int, rank: int, seed: int, module: str, stream: str) -> tuple:
    """The frozen A and B of one layer, the same on the server and every client.

    Orthonormal rows of A and columns of B (where the shape allows), drawn from the seed rule's
    stream ``<stream>/<module>`` of ``seed`` (nestfed.seeds: round 0, client 0); copies of a cached
    draw.

    Args:
        out_f: the layer's output features.
        in_f: its input features.
        rank: r.
        seed: the LoRA seed.
        module: the layer's module path.
        stream: the stream's name (``fed_sb_init``, ``ravan_init``).

    Returns:
        A [rank, in] and B [out, rank].
    """
    A, B = _drawn(out_f, in_f, rank, seed, module, stream)
    return A.clone(), B.clone()


def client_payload(arrays: Arrays, config: dict, shapes: dict[str, tuple[int, int]]) -> Arrays:
    """What a client loads from what it received.

    Per layer with a core (``lora_core`` / ``lora_heads`` [r_k, q]): the frozen A[:r_k] ([r_k, in])
    and B[:, :r_k] ([out, r_k]) drawn from the config's seed (`frozen_factors`), and, when
    ``frozen_heads`` [r - r_k, q] came too, the residual ``merged_A`` = A[r_k:] ([r - r_k, in]),
    ``merged_B`` = s B[:, r_k:] blockdiag(heads) ([out, r - r_k]) at the config's scale s. Other
    arrays pass as they are.

    Args:
        arrays: the received payload.
        config: the instruction's config (``core_seed``, ``core_rank``, ``core_stream``,
            ``scaling``).
        shapes: {module: (out, in)}.

    Returns:
        The arrays to load.

    Raises:
        KeyError: for a core of a module the model does not adapt.
    """
    r, seed, stream = int(config[RANK]), int(config[SEED]), str(config[STREAM])
    out = {}
    for key, v in arrays.items():
        if key.endswith(".frozen_heads"):
            continue
        out[key] = v
        try:
            module, kind = module_of(key)
        except KeyError:
            continue
        if kind not in CORE_KINDS:
            continue
        A, B = frozen_factors(*shapes[module], r, seed, module, stream)
        rank = v.shape[0]
        out[peft_key(module, "lora_A")], out[peft_key(module, "lora_B")] = A[:rank], B[:, :rank]
        heads = arrays.get(frozen_heads_key(module))
        if heads is not None and heads.shape[0]:
            out[merged_key(module, "A")] = A[rank:]
            out[merged_key(module, "B")] = float(config["scaling"]) * B[:, rank:] @ core_matrix(heads)
    return out


class CoreHooks(ClientHooks):
    """The clients of Fed-SB and RAVAN: rebuild the frozen factors before loading.

    A lower rank's frozen heads are rebuilt too (`client_payload`); the core variant the
    payload installs then trains only the core and replies with it (nestfed.nn.arrays).

    Args:
        lr: the cores' own AdamW learning rate (the method's ``lr`` option; 0: ``train.lr``).
    """

    def __init__(self, lr: float = 0.0):
        self.lr = float(lr)

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """The received cores with the frozen factors (and residual) drawn from the seed (`client_payload`)."""
        return client_payload(arrays, ctx.config, module_shapes(ctx.model))

    def param_groups(self, ctx: FitContext, params: list) -> list[dict]:
        """One group, at the method's own learning rate when it sets one."""
        return [{"params": params, "lr": self.lr}] if self.lr > 0 else [{"params": params}]
