"""FedNL's bytes per client per round on SmolLM2-135M's shapes, for both things that can travel
(fednl.travel): ``all`` (LoRA on q, k, v plus the memory rules) and ``rules`` (beta
projections and gates only), beside FedAvg's LoRA and the whole model.

Counted exactly as the runner counts them: the safetensors serialisation of the payload
(federation/payload.py), built from the real modules (a SmolLM2-shaped Llama with random
weights: the shapes are what matter) by the real code paths (inject_lora, install_memory,
fresh_rule_arrays, FedNL.initialize). Seconds; no model download.

    .venv/bin/python bench/perf/fednl_bytes.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def smollm2_shaped(layers: int = 30):
    """A randomly initialised Llama with SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        shell = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in shell.parameters())
    torch.manual_seed(0)
    cfg.vocab_size = 8  # the embedding's size does not enter any payload; keep the model small
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, n_params


def account(rank: int, lora_layers: tuple[int, ...], gate: str) -> dict:
    from nestfed import methods
    from nestfed.federation.messages import ClientInfo
    from nestfed.federation.payload import payload_stats
    from nestfed.nn.lora import inject_lora, module_shapes
    from nestfed.nn.memory import MemorySettings, fresh_rule_arrays, install_memory

    model, n_params = smollm2_shaped()
    inject_lora(model, ("q_proj", "k_proj", "v_proj"), rank, 2.0, lora_layers)
    layers = install_memory(model, MemorySettings(gate=gate), lora_layers)
    rules = fresh_rule_arrays(model, layers)
    shapes = module_shapes(model)
    out = {"rank": rank, "layers": len(layers), "gate": gate}
    clients = [ClientInfo(0, rank, 1)]
    base = [
        "data.num_clients=1",
        f"lora.ranks=[{rank}]",
        f"lora.lora_alpha={2.0 * rank}",
        f"fednl.gate={gate}",
        'lora.target_modules=["q_proj","k_proj","v_proj"]',
    ]
    for travel in ("all", "rules"):
        cfg = methods.load_config(None, base + ["strategy.name=fednl", f"fednl.travel={travel}"])
        st = methods.get("fednl").server(cfg, rules)
        sent = st.configure(1, st.initialize(shapes, clients), clients)[0].arrays
        out[f"fednl_{travel}"] = payload_stats(sent)
    avg = methods.get("fedavg").server(methods.load_config(None, base + ["strategy.name=fedavg"]), {})
    out["fedavg_lora"] = payload_stats(avg.configure(1, avg.initialize(shapes, clients), clients)[0].arrays)
    out["full_model_fp32_bytes"] = 4 * n_params
    out["full_model_params"] = n_params
    r = out["fednl_rules"]["bytes"]
    out["ratio_all_over_rules"] = round(out["fednl_all"]["bytes"] / r, 1)
    out["ratio_full_model_over_rules"] = round(out["full_model_fp32_bytes"] / r, 1)
    return out


def main() -> None:
    torch.set_num_threads(1)
    rows = [
        account(16, (), "learned"),
        account(32, (-4, -3, -2, -1), "learned"),
        account(16, (), "dynamic"),
        account(16, (), "constant"),
    ]
    res = {
        "bench": "fednl_bytes",
        "model_shapes": "SmolLM2-135M (30 layers, hidden 576, 9 heads / 3 KV heads)",
        "unit": "bytes per client per round, one direction (down = up for FedNL)",
        "rows": rows,
    }
    out = Path(__file__).parents[1] / "results" / "fednl_bytes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
