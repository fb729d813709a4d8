import pytest

from nestfed import config as C
from nestfed.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


def test_load_applies_overrides_and_roundtrips(tmp_path):
    p = write(tmp_path, '[lora]\nranks = [2, 4]\n[data]\nnum_clients = 2\n[strategy]\nname = "zeropad"\n')
    cfg = C.load(p, ["federation.rounds=5", "lora.lora_alpha=8", "lora.target_modules=[\"q_proj\"]",
                     "strategy.name=hetlora"])
    assert cfg.federation.rounds == 5 and cfg.lora.lora_alpha == 8.0
    assert cfg.lora.ranks == (2, 4) and cfg.lora.target_modules == ("q_proj",)
    assert cfg.strategy.name == "hetlora"
    again = C.load(write(tmp_path, C.dumps_toml(cfg)))
    assert again == cfg
    assert C.r_max(cfg) == 4 and C.client_ranks(cfg) == [2, 4]


def test_compression_whitening_defaults_to_activation_and_accepts_none():
    assert C.from_dict({}).compression.whitening == "activation"
    assert C.load(None, ["compression.whitening=none"]).compression.whitening == "none"


def test_scalar_rank_is_broadcast():
    cfg = C.from_dict({"lora": {"ranks": 8}, "data": {"num_clients": 3}})
    assert C.client_ranks(cfg) == [8, 8, 8]


@pytest.mark.parametrize("data,message", [
    ({"strategy": {"name": "fedsgd"}}, "strategy.name: unknown method 'fedsgd'"),
    ({"lora": {"rankz": [1]}}, "unknown key 'lora.rankz'"),
    ({"lorra": {}}, "unknown section '[lorra]'"),
    ({"lora": {"ranks": [2, 0, 4]}, "data": {"num_clients": 3}}, "lora.ranks: every rank must be a positive"),
    ({"lora": {"ranks": [2, 4]}, "data": {"num_clients": 3}}, "lora.ranks: 2 ranks for data.num_clients = 3"),
    ({"lora": {"ranks": [2, 32], "r_max": 16}, "data": {"num_clients": 2}}, "above the global maximum lora.r_max = 16"),
    ({"lora": {"ranks": [2, 4]}, "data": {"num_clients": 2}, "strategy": {"name": "fedavg"}}, "fedavg needs equal ranks"),
    ({"train": {"lr": "fast"}}, "train.lr: expected a number"),
    ({"federation": {"fraction": 1.5}}, "federation.fraction"),
    ({"data": {"dirichlet_alpha": 0}}, "Dirichlet concentration"),
    ({"compression": {"whitening": "pca"}}, "compression.whitening must be 'none' or 'activation', got 'pca'"),
    ({"compression": {"whitening": 1}}, "compression.whitening: expected a string"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError) as exc:
        C.from_dict(data, "exp.toml")
    assert message in str(exc.value) and str(exc.value).startswith("exp.toml")


def test_missing_file_and_bad_toml_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml: config file not found"):
        C.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="exp.toml: invalid TOML"):
        C.load(write(tmp_path, "[lora\nranks=1"))
    with pytest.raises(ConfigError, match="expected section.key=value"):
        C.load(None, ["rounds"])


def test_every_shipped_config_loads():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.rglob("*.toml"))
    assert len(files) >= 8
    names = {C.load(f).strategy.name for f in files}
    assert names >= set(C.STRATEGIES)
    hl = C.load(root / "methods" / "hetlora.toml")
    assert hl.strategy.hetlora_weighting == "norm" and hl.lora.ranks == (2, 4, 4, 8, 16)
    assert C.load(root / "methods" / "fedavg.toml").lora.ranks == (8,)


def test_extends_merges_over_the_base_and_detects_loops(tmp_path):
    (tmp_path / "base.toml").write_text('[lora]\nranks = [2, 4]\nlora_alpha = 4.0\n[data]\nnum_clients = 2\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[lora]\nlora_alpha = 8.0\n')
    cfg = C.load(tmp_path / "child.toml")
    assert cfg.lora.ranks == (2, 4) and cfg.lora.lora_alpha == 8.0
    (tmp_path / "loop.toml").write_text('extends = "loop.toml"\n')
    with pytest.raises(ConfigError, match="loops back"):
        C.load(tmp_path / "loop.toml")
