"""``nestfed export``: PEFT runs the exported adapter exactly as nestfed runs it, at any rank and
for any client, where a truncated-by-hand adapter gets the wrong scale."""

import json

import pytest
import torch
from peft import PeftModel

from nestfed import methods
from nestfed.config import ModelConfig
from nestfed.errors import NestfedError
from nestfed.experiments.export import export_adapter
from nestfed.federation.aggregation import one_adapter, truncate_rank
from nestfed.methods.implementation import lora_settings
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.backbone import load_backbone
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.keys import merged_key, peft_key
from tests.tiny_federation import tiny_config, tiny_run

IDS = torch.tensor([[3, 7, 11, 15, 19, 23, 27, 31, 35, 39], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]])


def peft_logits(adapter_dir) -> torch.Tensor:
    """Logits [2, 10, vocab] of a fresh tiny Llama with the adapter loaded by PEFT itself."""
    return PeftModel.from_pretrained(load_backbone(ModelConfig(name="tiny-llama")).model, adapter_dir)(IDS).logits


def ours(mr, arrays, scale) -> torch.Tensor:
    apply_arrays(mr.trainer.model, arrays, scale)
    return lm_logits(mr.trainer.model, IDS)


@pytest.fixture(scope="module")
def prelort_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("export") / "prelort"
    cfg = tiny_config("strategy.name=prelort", "federation.rounds=2")
    state, loop, mr = tiny_run(d, cfg)
    return d, cfg, state, mr


@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_rank_export_runs_in_peft_as_a_client_of_that_rank(prelort_run, tmp_path, r):
    d, cfg, state, mr = prelort_run
    path, info = export_adapter(d, rank=r, out=tmp_path / "a")
    conf = json.loads((path / "adapter_config.json").read_text())
    s = lora_settings(cfg).scale(r)  # fixed: lora_alpha / r_max = 16 / 8
    assert (conf["r"], conf["lora_alpha"] / conf["r"], info["round"]) == (r, s, 2)
    expected = ours(mr, truncate_rank(state.arrays, r), s)
    assert (peft_logits(path) - expected).abs().max().item() == 0.0


def test_truncating_the_run_adapter_by_hand_gets_the_scale_wrong(prelort_run, tmp_path):
    """The bug the export fixes: the r_max adapter's lora_alpha with a rank-2 prefix is scale
    lora_alpha / 2, four times the client's lora_alpha / 8."""
    d, cfg, state, mr = prelort_run
    good, _ = export_adapter(d, rank=2, out=tmp_path / "good")
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    conf = json.loads((good / "adapter_config.json").read_text())
    conf["lora_alpha"] = lora_settings(cfg).scale(8) * 8  # what adapter/ (rank r_max = 8) says
    (by_hand / "adapter_config.json").write_text(json.dumps(conf))
    (by_hand / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    expected = ours(mr, truncate_rank(state.arrays, 2), lora_settings(cfg).scale(2))
    assert (peft_logits(by_hand) - expected).abs().max().item() > 1e-3
    assert (peft_logits(good) - expected).abs().max().item() == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", ["prelort", "hetlora", "flexlora", "raflora", "local_only", "fedsa_lora", "flora", "fedex_lora"]
)
def test_client_export_runs_in_peft_as_the_client_runs_it(tmp_path, method):
    """Each client's exported adapter against the client's own evaluation path: the strategy's
    deployment with the client's kept state (local-only's own adapter, FedSA-LoRA's local B).
    Plain adapters agree bit for bit; stacked ones (FLoRA, FedEx-LoRA: merged factors at scale 1)
    to float rounding."""
    cfg = tiny_config(f"strategy.name={method}", "federation.rounds=2")
    state, loop, mr = tiny_run(tmp_path / "run", cfg)
    hooks = methods.get(method).client_hooks(cfg)
    stacked = any(k.endswith("merged_A") or "merged" in k for k in mr.strategy.deploy(state, 0)[0])
    for c in mr.clients:
        path, info = export_adapter(tmp_path / "run", client=c.cid, out=tmp_path / f"c{c.cid}")
        arrays, scale = mr.strategy.deploy(state, c.cid)
        arrays = hooks.evaluation_arrays(mr.trainer.client_state.get(c.cid, {}), arrays)
        expected = ours(mr, arrays, scale)
        assert (expected - lm_logits(load_backbone(ModelConfig(name="tiny-llama")).model, IDS)).abs().max() > 1e-4
        diff = (peft_logits(path) - expected).abs().max().item()
        assert diff <= (1e-5 if stacked else 0.0), (method, c.cid, diff)


def test_one_adapter_stacks_merged_factors_exactly():
    """B' A' = merged_B merged_A + s B A, hand-built; rank padded to the largest layer's."""
    g = torch.Generator().manual_seed(0)
    mA, mB = torch.randn(3, 5, generator=g), torch.randn(4, 3, generator=g)
    A, B = torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g)
    A2, B2 = torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g)
    arrays = {
        merged_key("x", "A"): mA,
        merged_key("x", "B"): mB,
        peft_key("x", "lora_A"): A,
        peft_key("x", "lora_B"): B,
        peft_key("y", "lora_A"): A2,
        peft_key("y", "lora_B"): B2,
    }
    out, s = one_adapter(arrays, 0.5)
    assert s == 1.0 and out[peft_key("x", "lora_A")].shape == (5, 5) and out[peft_key("y", "lora_A")].shape == (5, 5)
    torch.testing.assert_close(out[peft_key("x", "lora_B")] @ out[peft_key("x", "lora_A")], mB @ mA + 0.5 * B @ A)
    torch.testing.assert_close(out[peft_key("y", "lora_B")] @ out[peft_key("y", "lora_A")], 0.5 * B2 @ A2)
    plain = {peft_key("y", "lora_A"): A2, peft_key("y", "lora_B"): B2}
    assert one_adapter(plain, 0.5) == (plain, 0.5)
    with pytest.raises(ValueError, match="not a LoRA factor"):
        one_adapter({"base_model.model.layers.0.self_attn.memory.beta": torch.zeros(2)}, 1.0)


def test_export_refusals_name_the_option(prelort_run, tmp_path):
    d, cfg, state, mr = prelort_run
    with pytest.raises(NestfedError, match=r"--rank: rank 9 is not an integer in \[1, r_max = 8\]"):
        export_adapter(d, rank=9)
    with pytest.raises(NestfedError, match="--client 7: .* has clients 0, 1, 2"):
        export_adapter(d, client=7)
    with pytest.raises(NestfedError, match="--rank 4: client 0 runs rank 2"):
        export_adapter(d, rank=4, client=0)
    with pytest.raises(NestfedError, match="no config.toml"):
        export_adapter(tmp_path, rank=2)
    local = tmp_path / "local"
    tiny_run(local, tiny_config("strategy.name=local_only", "federation.rounds=1"))
    with pytest.raises(NestfedError, match="--rank: .*cannot export its global adapter at a rank.*--client K"):
        export_adapter(local, rank=2)


def test_cli_export(prelort_run, cli, tmp_path):
    d, cfg, state, mr = prelort_run
    r = cli("export", d, "--rank", "2", "--out", tmp_path / "x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "rank 2, scale 2" in r.stdout and (tmp_path / "x" / "adapter_model.safetensors").is_file()
    r = cli("export", d, cwd=tmp_path)
    assert r.returncode == 2 and "give --rank R, --client K, or both" in r.stderr


def test_export_never_destroys_anything_but_an_earlier_adapter(prelort_run, tmp_path):
    """--out on the run directory, a folder above it, a file, or a folder of other files is refused
    and leaves them as they were; an earlier adapter directory is replaced."""
    d, cfg, state, mr = prelort_run
    before = sorted(p.name for p in d.iterdir())
    for target in (d, d.parent):
        with pytest.raises(NestfedError, match="the run directory or a folder above it"):
            export_adapter(d, rank=2, out=target)
    assert sorted(p.name for p in d.iterdir()) == before
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "important.txt").write_text("x")
    with pytest.raises(NestfedError, match=r"holds files that are not an adapter's \(important.txt\)"):
        export_adapter(d, rank=2, out=keep)
    (tmp_path / "afile").write_text("y")
    with pytest.raises(NestfedError, match="exists and is not an adapter directory"):
        export_adapter(d, rank=2, out=tmp_path / "afile")
    assert (keep / "important.txt").read_text() == "x" and (tmp_path / "afile").read_text() == "y"
    first, _ = export_adapter(d, rank=2, out=tmp_path / "again")
    second, info = export_adapter(d, rank=4, out=tmp_path / "again")  # an earlier adapter is replaced
    assert json.loads((second / "adapter_config.json").read_text())["r"] == 4
