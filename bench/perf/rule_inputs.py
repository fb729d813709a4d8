"""What the aggregation-rule benchmarks share: a server strategy as its home builds it, and
SmolLM2-135M's attention projection shapes.

Imported by ``bench/perf/aggregation.py`` and ``bench/perf/bytes.py`` (run as scripts, so this
folder is on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Iterable

from nestfed import methods

# SmolLM2-135M: hidden 576, 3 KV heads x 64; [out_features, in_features].
SMOLLM2_ATTENTION = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576)}


def strategy(name: str, ranks: list[int], lora_alpha: float, *overrides: str, initial=None):
    """The server strategy of ``name`` as its home builds it, for these client ranks."""
    cfg = methods.load_config(
        None,
        [
            f"strategy.name={name}",
            f"data.num_clients={len(ranks)}",
            f"lora.ranks={list(ranks)}",
            f"lora.lora_alpha={lora_alpha}",
            *overrides,
        ],
    )
    return methods.get(name).server(cfg, initial or {})


def smollm2_shapes(layers: Iterable[int]) -> dict[str, tuple[int, int]]:
    """{module name: [out, in]} of q, k, v, o on each of ``layers``."""
    return {f"model.layers.{i}.self_attn.{name}": shape for i in layers for name, shape in SMOLLM2_ATTENTION.items()}
