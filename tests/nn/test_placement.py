"""The device and dtype policy (nestfed.nn.placement) on the CPU: names resolve or are refused in
one line, and the half-precision policy (bf16 frozen weights, float32 trainables, autocast)
computes what the float32 model computes up to bf16 rounding and trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.federation.training import Batch
from nestfed.nn.backbone import load_backbone
from nestfed.nn.frozen_prefix import lm_logits, prefix_features
from nestfed.nn.lora import inject_lora, lora_modules
from nestfed.nn.placement import autocast, resolve_device, resolve_dtype, trainable_dtype

ROOT = Path(__file__).resolve().parents[2]


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want
    with pytest.raises(ConfigError, match=r"model.device = 'cuda:7': this machine has \d+ CUDA device"):
        resolve_device("cuda:7" if torch.cuda.device_count() < 8 else "cuda:99")
    with pytest.raises(ConfigError, match="model.device: 'tpu' is not auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")


def test_dtype_policy():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ConfigError, match="model.dtype: unknown dtype 'int8'"):
        resolve_dtype("int8", cpu)
    assert trainable_dtype(torch.bfloat16) == trainable_dtype(torch.float16) == torch.float32
    assert trainable_dtype(torch.float64) == torch.float64


def test_config_refuses_a_bad_device(cli, tmp_path):
    res = cli("run", str(ROOT / "configs" / "tiny.toml"), "--set", "model.device=gpu0", cwd=tmp_path)
    assert res.returncode != 0 and "model.device: 'gpu0' is not auto, cpu, cuda or cuda:N" in res.stderr
    assert "Traceback" not in res.stderr


def _pair():
    full = load_backbone(ModelConfig(name="tiny-llama", device="cpu"))
    half = load_backbone(ModelConfig(name="tiny-llama", device="cpu", dtype="bfloat16"))
    for bb in (full, half):
        inject_lora(bb.model, ("q_proj", "v_proj"), 4, 2.0, layers=(-1,))
    return full.model, half.model


def test_bf16_frozen_weights_float32_adapters():
    full, half = _pair()
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    for m in lora_modules(half).values():
        assert m.base_layer.weight.dtype == torch.bfloat16
        assert m.lora_A.weight.dtype == m.lora_B.weight.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = lm_logits(full, ids), lm_logits(half, ids)
    assert b.dtype == torch.bfloat16  # the forward ran under bf16 autocast
    err = (a - b.float()).abs().max() / a.abs().max()
    assert 0 < err < 0.05  # bf16 rounding, not another computation
    # a zero-initialised LoRA leaves the bf16 model's outputs unchanged, bit for bit
    for m in lora_modules(half).values():
        m.active_rank = 0
    with torch.no_grad():
        assert torch.equal(lm_logits(half, ids), b)


@pytest.mark.slow
def test_bf16_policy_trains_float32_parameters():
    _, half = _pair()
    params = [p for m in lora_modules(half).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    hidden = prefix_features(half, ids, 1)  # the frozen layer 0 cached, in bf16, in host memory
    assert hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu"
    batch = Batch(ids.clone(), hidden=hidden, start=1)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = batch.loss(half)
        assert loss.dtype == torch.float32
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in params)
        opt.step()
        losses.append(loss.item())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert losses[-1] < losses[0] - 0.1


def test_autocast_is_a_no_op_in_float32():
    full, _ = _pair()
    with autocast(full):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.cuda
def test_cuda_placement_trains_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    bb = load_backbone(ModelConfig(name="tiny-llama", device="cuda"))
    inject_lora(bb.model, ("q_proj", "v_proj"), 4, 2.0)
    assert bb.model.model.embed_tokens.weight.dtype == torch.bfloat16
    m = next(iter(lora_modules(bb.model).values()))
    assert m.lora_A.weight.is_cuda and m.lora_A.weight.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 16))
    loss = Batch(ids.clone(), input_ids=ids).loss(bb.model)
    m.lora_A.weight.requires_grad_(True)
    m.lora_B.weight.requires_grad_(True)
    loss.backward()
    assert loss.is_cuda and torch.isfinite(loss) and m.lora_B.weight.grad.abs().sum() > 0
