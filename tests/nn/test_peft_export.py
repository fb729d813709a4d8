import json

import pytest
import torch

from nestfed.config import ModelConfig
from nestfed.nn.backbone import load_backbone
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.lora import get_adapter_state, inject_lora, set_adapter_state
from nestfed.nn.peft_export import export_peft_adapter


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
def test_peft_loads_exported_adapter_with_same_logits(tmp_path, family):
    from peft import PeftModel

    ours = load_backbone(ModelConfig(name=family)).model
    inject_lora(ours, ("q_proj", "v_proj", "o_proj"), rank=4, scaling=0.75, layers=(-1,))
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(ours).items()}
    set_adapter_state(ours, state)
    out = export_peft_adapter(state, 0.75, tmp_path / "adapter")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == pytest.approx(3.0)
    ids = torch.randint(0, 258, (2, 10))
    expected = lm_logits(ours, ids)
    peft_model = PeftModel.from_pretrained(load_backbone(ModelConfig(name=family)).model, out)
    got = peft_model(ids).logits
    assert (expected - load_backbone(ModelConfig(name=family)).model(ids).logits).abs().max() > 1e-3
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_export_rejects_mixed_ranks(tmp_path):
    state = {
        "base_model.model.a.lora_A.weight": torch.zeros(2, 3),
        "base_model.model.a.lora_B.weight": torch.zeros(3, 2),
        "base_model.model.b.lora_A.weight": torch.zeros(4, 3),
        "base_model.model.b.lora_B.weight": torch.zeros(3, 4),
    }
    with pytest.raises(ValueError, match="one rank"):
        export_peft_adapter(state, 1.0, tmp_path / "x")
    assert not (tmp_path / "x").exists()
