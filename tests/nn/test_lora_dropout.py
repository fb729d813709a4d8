"""``lora.lora_dropout``: PEFT's dropout on the LoRA path's input, in training only; the exported
adapter records it; a run with it is reproducible (the seed rule)."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from nestfed.nn.lora import LoraLinear


def layer(p: float) -> LoraLinear:
    torch.manual_seed(0)
    lin = LoraLinear(nn.Linear(16, 8), rank=4, scaling=2.0, dropout=p)
    with torch.no_grad():
        lin.lora_B.weight.normal_()
    return lin


def test_dropout_changes_training_passes_only_and_matches_peft_in_evaluation():
    from peft import LoraConfig, get_peft_model

    x = torch.randn(3, 16)
    drop, plain = layer(0.5), layer(0.0)
    drop.train()
    assert not torch.equal(drop(x), drop(x))  # two training passes draw two masks
    drop.eval()
    assert torch.equal(drop(x), plain.eval()(x))  # evaluation: the path without dropout
    # PEFT's LoRA layer with the same weights and lora_dropout, in eval mode, gives the same output
    base = nn.Sequential(nn.Linear(16, 8))
    base[0].load_state_dict(drop.base_layer.state_dict())
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.5, target_modules=["0"]))
    m = peft.base_model.model[0]
    m.lora_A["default"].weight.data.copy_(drop.lora_A.weight)
    m.lora_B["default"].weight.data.copy_(drop.lora_B.weight)
    peft.eval()
    torch.testing.assert_close(peft(x), drop(x))


def test_a_training_pass_drops_the_lora_inputs_as_dropout_does():
    lin = layer(0.5).train()
    x = torch.randn(2, 16)
    torch.manual_seed(7)
    got = lin(x)
    torch.manual_seed(7)
    xd = nn.functional.dropout(x, 0.5, training=True)
    want = lin.base_layer(x) + (xd @ lin.lora_A.weight.T) @ lin.lora_B.weight.T * 2.0
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_a_run_with_lora_dropout_is_reproducible_and_its_adapter_records_it(tmp_path, cli):
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    sets = ["federation.rounds=1", "data.num_clients=2", "lora.ranks=[2,4]"]
    sets += ["output.plots=false", "train.threads=1"]
    for name, p in (("a", 0.1), ("b", 0.1), ("c", 0.0)):
        args = [x for s in [*sets, f"output.dir={tmp_path / name}", f"lora.lora_dropout={p}"] for x in ("--set", s)]
        assert cli("run", tiny, *args, cwd=tmp_path).returncode == 0
    a, b, c = (next((tmp_path / n).iterdir()) / "adapter" for n in ("a", "b", "c"))
    weights = [(d / "adapter_model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]  # the same masks run to run; dropout did train differently
    assert json.loads((a / "adapter_config.json").read_text())["lora_dropout"] == pytest.approx(0.1)


@pytest.mark.slow
def test_a_whole_model_computes_what_peft_computes_with_dropout():
    """Our injected model and PEFT's with the same LoRA weights and lora_dropout: equal logits in
    evaluation, and in training from equal random draws (the same masks on the same inputs)."""
    from peft import LoraConfig, get_peft_model

    from nestfed.config import ModelConfig
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.frozen_prefix import lm_logits
    from nestfed.nn.lora import get_adapter_state, inject_lora, set_adapter_state

    ours = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(ours, ("q_proj", "v_proj"), rank=4, scaling=0.75, dropout=0.3)
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(ours).items()}
    set_adapter_state(ours, state)
    config = LoraConfig(r=4, lora_alpha=3.0, target_modules=["q_proj", "v_proj"], lora_dropout=0.3)
    theirs = get_peft_model(load_backbone(ModelConfig(name="tiny-llama")).model, config)
    loaded = theirs.load_state_dict(
        {k.replace(".weight", ".default.weight"): v for k, v in state.items()}, strict=False
    )
    assert not loaded.unexpected_keys
    ids = torch.randint(0, 258, (2, 10))
    ours.eval(), theirs.eval()
    expected = lm_logits(ours, ids)
    torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-5, atol=1e-5)
    ours.train(), theirs.train()
    torch.manual_seed(5)
    dropped = lm_logits(ours, ids)
    torch.manual_seed(5)
    torch.testing.assert_close(theirs(ids).logits, dropped, rtol=1e-5, atol=1e-5)
    assert (dropped - expected).abs().max() > 1e-3  # the dropout acted in training
