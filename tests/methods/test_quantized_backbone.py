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
