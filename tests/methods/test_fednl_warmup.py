"""FedNL's memory warm-up (attention transfer before round 1): the fit brings every memory layer
closer to full attention than its window alone, the federation starts from the warmed rules, the
run records the cost and the starting rules, and the cache is found again, keyed and repaired."""

import pytest
import torch
from tiny_federation import same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import ModelConfig
from nestfed.nn.attention_transfer import full_attention, record_layers, transfer_memory
from nestfed.nn.backbone import load_backbone
from nestfed.nn.memory import MemorySettings, install_memory, memory_rules, set_memory_enabled

RULE = "base_model.model.model.layers.1.self_attn.memory."


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.slow
def test_attention_transfer_fits_the_memory_to_full_attention():
    """On a tiny model whose every layer sees 4 tokens, 60 steps take each layer's relative error
    against full attention below what the window alone gives (what lies past the window is read
    from the memory); the teacher is full attention whatever the deployment's bound, and the
    bounds come back afterwards."""
    model = load_backbone(ModelConfig(name="tiny-llama", attention_window=4)).model
    install_memory(model, MemorySettings())
    set_memory_enabled(model, True)
    ids = torch.randint(0, 250, (16, 32), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, [0, 1], ids, 8)
    with full_attention(model):
        ref = model(ids[:2]).logits
    set_memory_enabled(model, False)
    with torch.no_grad():  # the recorded target is the full-attention layer's own output
        assert not torch.allclose(model(ids[:2]).logits, ref, atol=1e-3)  # the window alone differs
    assert all(b.window == 4 and b.fixed for b in (a.bounds for a in (model.model.layers[i].self_attn for i in (0, 1))))
    set_memory_enabled(model, True)
    facts = transfer_memory(model, records, steps=60, lr=3e-2, batch=8)
    assert facts.tokens == 16 * 32 and facts.steps == 60
    for i, e in facts.rel_mse.items():
        assert e["end"] < 0.6 * e["window"] and e["end"] < e["start"], (i, e)


def warm_cfg(tmp_path, *extra):
    return tiny_config(
        "strategy.name=fednl",
        "lora.ranks=[4]",
        'lora.target_modules=["q_proj","k_proj","v_proj"]',
        "model.attention_window=8",
        f"model.cache_dir={tmp_path / 'cache'}",
        "fednl.warmup_steps=20",
        "fednl.warmup_rows=8",
        "fednl.warmup_length=48",
        "fednl.warmup_corpus=wikipedia",
        "federation.rounds=1",
        *extra,
    )


@pytest.mark.slow
def test_the_federation_starts_from_the_warmed_rules_and_the_cache_is_found(tmp_path):
    cfg = warm_cfg(tmp_path)
    cold = warm_cfg(tmp_path, "fednl.warmup_steps=0")
    fresh = methods.get("fednl").build(tiny_prepared(cold), cold).strategy.memory_init
    state, _, mr = tiny_run(tmp_path / "run", cfg)
    warmed = mr.strategy.memory_init
    assert warmed.keys() == fresh.keys() and not same_arrays(warmed, fresh)
    start = mr.strategy.initialize(mr.shapes, mr.clients)
    assert all(torch.equal(start.arrays[k], warmed[k]) for k in warmed)  # round 0 is the warmed state
    exports = mr.finish(state)
    assert same_arrays(exports.files["memory_warmup.safetensors"], warmed)
    facts = exports.summary["fednl_warmup"]
    assert facts["steps"] == 20 and facts["tokens"] == 8 * 48 and not facts["found_in_cache"]
    assert all(e["end"] < e["window"] for e in facts["rel_mse"].values())

    again = methods.get("fednl").build(tiny_prepared(cfg), cfg)  # a resumed run, a second node
    assert same_arrays(again.strategy.memory_init, warmed)
    assert again.finish(state).summary["fednl_warmup"]["found_in_cache"]
    (cache,) = (tmp_path / "cache" / "fednl_warmup").glob("*.safetensors")
    cache.write_bytes(b"torn")  # a damaged cache is fitted again, to the same rules (seeded)
    repaired = methods.get("fednl").build(tiny_prepared(cfg), cfg)
    assert same_arrays(repaired.strategy.memory_init, warmed)
    assert not repaired.finish(state).summary["fednl_warmup"]["found_in_cache"]
    other = warm_cfg(tmp_path, "fednl.warmup_lr=0.05")  # another fit is another key
    methods.get("fednl").build(tiny_prepared(other), other)
    assert len(list((tmp_path / "cache" / "fednl_warmup").glob("*.safetensors"))) == 2
    assert memory_rules(mr.trainer.model)  # the memory stays installed
