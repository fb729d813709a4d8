"""``model.quantization`` for every registered method: a method declaring ``QUANTIZED_BACKBONE``
trains over an nf4 backbone (its LoRA, and a merged residual where it keeps one, in float32 beside
the packed weights), close to but not equal to its float32 run; the others are refused at config
load in one line naming why."""

import re

import pytest
import torch
from tiny_federation import lines, tiny_run

pytest.importorskip("bitsandbytes")

from test_capabilities import config, declaring  # noqa: E402

from nestfed import methods  # noqa: E402
from nestfed.config import ConfigError  # noqa: E402
from nestfed.config.capabilities import Capability  # noqa: E402
from nestfed.nn.lora import lora_modules  # noqa: E402
from nestfed.nn.quantization import is_quantized  # noqa: E402

C = Capability


@pytest.mark.parametrize("name", declaring(C.QUANTIZED_BACKBONE))
def test_a_declaring_method_trains_over_an_nf4_backbone(tmp_path, name, one_thread):
    cfg = config(name, "federation.rounds=1", "model.quantization=nf4")
    state, _, mr = tiny_run(tmp_path / "nf4", cfg)
    full, _, _ = tiny_run(tmp_path / "fp32", config(name, "federation.rounds=1"))
    assert state.arrays.keys() == full.arrays.keys()
    for k, v in state.arrays.items():  # what travels keeps its dtype and shape
        assert v.dtype == full.arrays[k].dtype and v.shape == full.arrays[k].shape, k
        assert not v.is_floating_point() or torch.isfinite(v).all(), k
    losses = {}
    for run in ("nf4", "fp32"):
        clients = lines(tmp_path / run)[1]["clients"]
        assert all(c["status"] == "accepted" for c in clients.values())
        losses[run] = [clients[c]["metrics"]["train_loss"] for c in sorted(clients)]
    assert losses["nf4"] != losses["fp32"]  # the clients trained over the quantised weights
    assert losses["nf4"] == pytest.approx(losses["fp32"], rel=0.1)  # by quantisation's error, not a broken layer
    modules = lora_modules(mr.trainer.model) if hasattr(mr.trainer, "model") else {}
    assert all(is_quantized(m.base_layer) and m.lora_A.weight.dtype == torch.float32 for m in modules.values())


@pytest.mark.parametrize("name", [n for n in methods.REGISTRY if n not in declaring(C.QUANTIZED_BACKBONE)])
def test_the_others_are_refused_in_one_line_naming_why(name):
    with pytest.raises(ConfigError) as err:
        config(name, "model.quantization=nf4")
    line = str(err.value)
    assert "\n" not in line
    assert re.search(rf"model\.quantization: {name} cannot train over a quantised backbone: .*SVD", line), line


def test_a_missing_bitsandbytes_is_named_with_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(ConfigError, match=r"model.quantization: 'int8' needs bitsandbytes.*scripts/setup.sh"):
        config("fedavg", "model.quantization=int8")


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ConfigError, match=r"model.quantization: unknown 'fp8' \(known: none, int8, nf4\)"):
        config("fedavg", "model.quantization=fp8")


def card_config(readme: str) -> dict:
    """The BitsAndBytesConfig keyword arguments a model card records (PEFT's ``- key: value`` lines)."""
    from nestfed.nn.peft_export import QUANTIZATION_PREFIX

    lines = readme.split(QUANTIZATION_PREFIX, 1)[1].strip().splitlines()
    out = {}
    for line in lines:
        if not line.startswith("- "):
            break
        key, value = line[2:].split(": ", 1)
        out[key] = {"True": True, "False": False}.get(value, value)
    return out


def test_the_export_records_its_quantised_base_and_loads_on_it_in_peft(tmp_path, one_thread):
    """PreLort over nf4, exported at r_max: the README.md model card records the bitsandbytes config
    as PEFT does; PEFT loads the adapter onto the base that config loads, with the logits nestfed
    deploys (train mode: the same kernels; in eval mode bitsandbytes computes nf4 in bfloat16 on
    AVX512-BF16 CPUs, within bfloat16's rounding)."""
    from peft import PeftModel
    from tiny_federation import tiny_prepared
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from nestfed.config import r_max
    from nestfed.experiments.export import export_adapter
    from nestfed.nn.arrays import apply_arrays
    from nestfed.nn.backbone import tiny_dir
    from nestfed.nn.frozen_prefix import lm_logits

    cfg = config("prelort", "federation.rounds=1", "model.quantization=nf4", "model.device=cpu")
    prep = tiny_prepared(cfg)
    state, _, mr = tiny_run(tmp_path / "run", cfg, prep)
    out, _ = export_adapter(tmp_path / "run", rank=r_max(cfg), out=tmp_path / "peft")
    recorded = card_config((out / "README.md").read_text())
    assert recorded == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "float32",
    }
    arrays, scale = mr.strategy.deploy(state, None)
    ours = prep.backbone.model
    apply_arrays(ours, arrays, scale)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = lm_logits(ours, ids)
    base = AutoModelForCausalLM.from_pretrained(
        tiny_dir("tiny-llama", 0), quantization_config=BitsAndBytesConfig(**recorded), device_map="cpu"
    )
    theirs = PeftModel.from_pretrained(base, out).train()
    torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        evaluated = theirs.eval()(ids).logits
    torch.testing.assert_close(evaluated, expected, rtol=0.05, atol=0.05)
