"""FedSLM, FedMKT and the LoRA baselines end to end on a tiny model with real BBC News, via the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "fedslm" / "tiny.toml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedslm")
    env = dict(os.environ, COLUMNS="200")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nestfed.cli",
            "run",
            str(TINY),
            "--methods",
            "fedslm,fedmkt,fedavg,hetlora",  # a method with compressed clients: the compressed comparison
            "--set",
            f"output.dir={tmp / 'runs'}",
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (parent,) = list((tmp / "runs").iterdir())
    return parent, r.stdout


def summary(parent, method):
    return json.loads((parent / method / "summary.json").read_text())


@pytest.mark.slow
def test_every_method_writes_a_run_directory_and_the_comparison(run):
    parent, stdout = run
    for method in ("fedslm", "fedmkt", "fedavg", "hetlora"):
        d = parent / method
        assert (d / "summary.json").is_file() and (d / "metrics.jsonl").is_file() and (d / "config.toml").is_file()
        assert (d / "adapter" / "adapter_model.safetensors").is_file()
        assert list((d / "checkpoints").glob("round_*.safetensors"))
    rows = json.loads((parent / "comparison.json").read_text())
    assert [r["method"] for r in rows] == [
        "fedslm (none)",
        "fedslm (alpha=0)",
        "fedslm (alpha=0.5)",
        "fedmkt",
        "fedavg",
        "hetlora",
    ]
    assert "fedslm (alpha=0.5)" in stdout


def test_memory_compressed_clients_are_smaller_and_lora_clients_larger(run):
    parent, _ = run
    slm = summary(parent, "fedslm")["client_memory"]
    ratios = [slm["groups"][g]["ratio_to_full"] for g in ("0", "1", "2")]
    assert ratios == sorted(ratios) and 0.2 < ratios[0] and ratios[-1] < 1.0
    assert summary(parent, "fedavg")["client_memory"]["mean_ratio_to_full"] > 1.0


def test_fedslm_payloads_are_the_groups_cores(run):
    parent, _ = run
    s = summary(parent, "fedslm")
    line = [json.loads(x) for x in (parent / "fedslm" / "metrics.jsonl").read_text().splitlines()][1]
    cores = load_file(str(parent / "fedslm" / "weak_model_cores.safetensors"))
    assert len(cores) == 7 and all(k.endswith(".sigma") for k in cores)  # the top layer's 7 projections
    R = {k: v.shape[0] for k, v in cores.items()}
    # client 3 (rho 0.7, the largest group) receives and returns the full R x R cores
    assert line["clients"]["3"]["params_down"] == sum(r * r for r in R.values()) == line["clients"]["3"]["params_up"]
    assert line["clients"]["0"]["params_up"] < line["clients"]["1"]["params_up"] < line["clients"]["3"]["params_up"]
    assert s["prefix_shared_with_backbone"] is False  # lower layers are compressed too: cached per group


def test_no_elicitation_is_the_pretrained_model_and_elicitation_changes_it(run):
    parent, _ = run
    s = summary(parent, "fedslm")
    hetlora_round0 = summary(parent, "hetlora")["initial"]  # the backbone alone
    none = s["server_eval_variants"]["none"]
    for cid, ev in hetlora_round0.items():
        assert none[cid]["loss"] == pytest.approx(ev["loss"], rel=1e-6)
    assert s["server_eval_variants"]["alpha=0.5"] != none
    assert s["elicitation"]["alpha=0"]["steps"] == 2.0


def test_fedmkt_exchanges_topk_knowledge_on_the_server_text(run):
    parent, _ = run
    s = summary(parent, "fedmkt")
    line = [json.loads(x) for x in (parent / "fedmkt" / "metrics.jsonl").read_text().splitlines()][1]
    n, T, k = s["public_blocks"], 32, 10
    assert line["clients"]["0"]["params_down"] == n * T * k * 2 + n == line["clients"]["0"]["params_up"]
    assert 0.0 <= line["clients"]["0"]["metrics"]["server_share"] <= 1.0


def _prepared(overrides):
    from nestfed import methods
    from nestfed.experiments.prepare import prepare
    from nestfed.methods.compressed.setup import prepare_compressed

    cfg = methods.load_config(TINY, overrides)
    prep = prepare(cfg)
    return cfg, prep, prepare_compressed(prep, cfg)


@pytest.mark.slow
def test_weak_model_fuses_the_frozen_layers_by_the_chosen_rule():
    """Frozen compressed layers of W_g: coverage keeps diag(S[:R]); average scales coordinate k by
    the data share of the groups holding it (nestfed.methods.fedslm.strategy)."""
    import torch

    from nestfed.methods.fedslm.weak_model import weak_model
    from nestfed.nn.svd import core_key

    cfg, prep, setup = _prepared([])
    assert setup.client_group == {0: 0, 1: 1, 2: 1, 3: 2, 4: 2}
    fused = {core_key(n): torch.diag(setup.bases[n].S[: setup.ranks(2)[n]]) for n in setup.trained}
    name = "model.layers.0.mlp.down_proj"  # compressed, not trained: [64, 128]
    f = setup.bases[name]
    r = [setup.models[g].get_submodule(name).rank for g in range(3)]
    n = setup.group_examples()
    cov = weak_model(setup, prep, fused, "coverage").get_submodule(name).sigma
    assert torch.allclose(cov, torch.diag(f.S[: r[2]]))
    avg = weak_model(setup, prep, fused, "average").get_submodule(name).sigma
    share = torch.tensor([sum(n[g] for g in range(3) if r[g] > k) for k in range(r[2])]) / sum(n.values())
    assert torch.allclose(torch.diag(avg), f.S[: r[2]] * share, atol=1e-6)
    assert float(share[-1]) == pytest.approx(n[2] / sum(n.values())) and float(share[-1]) < 1.0


def test_top_layer_compression_shares_the_backbones_cached_prefix():
    cfg, prep, setup = _prepared(["compression.target='(.*\\.)?layers\\.1\\..*_proj'"])
    assert setup.shared_prefix and setup.start == 1
    d, nd = prep.data[3], setup.data[2][3]
    assert nd.train_hidden is d.train_hidden  # no recomputation per group
    assert setup.public[0] is setup.public["strong"]
    assert setup.bytes[0] < setup.bytes[2] < setup.bytes["full"]


def test_whitened_bases_are_cached_per_calibration_text(tmp_path):
    """The cache key holds the whitening mode and the calibration tokens' hash; plain SVD keeps the
    key of earlier versions; a second call with the same server text reads the cache."""
    import hashlib

    import torch

    from nestfed import methods
    from nestfed.methods.compressed.setup import bases_cache_key, cached_bases
    from nestfed.nn.backbone import load_backbone

    cfg = methods.load_config(TINY, [f"model.cache_dir={tmp_path}"])
    plain = methods.load_config(TINY, [f"model.cache_dir={tmp_path}", "compression.whitening=none"])
    model = load_backbone(cfg.model).model
    a = torch.randint(0, 200, (5, 32))
    b = a.clone()
    b[0, 0] += 1
    legacy = hashlib.sha256(f"src|{cfg.section('compression').target}|0.7|float32".encode()).hexdigest()[:16]
    assert bases_cache_key("src", plain) == legacy == bases_cache_key("src", plain, a)
    assert len({legacy, bases_cache_key("src", cfg, a), bases_cache_key("src", cfg, b)}) == 3
    said = []
    first = cached_bases(model, cfg, "src", said.append, a)
    assert any("whitened SVD" in s for s in said)
    assert (tmp_path / "svd" / f"{bases_cache_key('src', cfg, a)}.safetensors").is_file()
    said.clear()
    again = cached_bases(model, cfg, "src", said.append, a)
    assert not said and all(torch.equal(again[n].D, first[n].D) for n in first)
    other = cached_bases(model, cfg, "src", said.append, b)
    assert said and not all(torch.equal(other[n].V, first[n].V) for n in first)
    assert all(f.D is None for f in cached_bases(model, plain, "src", said.append).values())


def test_too_little_calibration_text_names_compression_server_blocks():
    """tiny.toml: blocks of 32 tokens, widest compressed input 128 (down_proj): 1 block is too few."""
    from nestfed.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"compression\.server_blocks: .* 32 tokens, fewer than the 128 inputs.*"
        r"server_blocks >= 4",
    ):
        _prepared(["compression.server_blocks=1"])
    _, _, setup = _prepared(["compression.server_blocks=4", "compression.whitening=none"])
    assert all(f.D is None for f in setup.bases.values())
