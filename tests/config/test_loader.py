"""Configs: overrides, round trips, the registry's sections, and one line naming the key at fault."""

from pathlib import Path

import pytest

from nestfed import config, methods
from nestfed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text, name="exp.toml", raw=None):
    p = tmp_path / name
    if raw is not None:
        p.write_bytes(raw)
    else:
        p.write_text(text)
    return p


def test_load_applies_overrides_and_roundtrips(tmp_path):
    p = write(tmp_path, '[lora]\nranks = [2, 4]\n[data]\nnum_clients = 2\n[strategy]\nname = "zeropad"\n')
    cfg = methods.load_config(
        p,
        [
            "federation.rounds=5",
            "lora.lora_alpha=8",
            'lora.target_modules=["q_proj"]',
            "strategy.name=hetlora",
            "hetlora.reg=0.5",
        ],
    )
    assert cfg.federation.rounds == 5 and cfg.lora.lora_alpha == 8.0
    assert cfg.lora.ranks == (2, 4) and cfg.lora.target_modules == ("q_proj",)
    assert cfg.strategy.name == "hetlora" and cfg.section("hetlora").reg == 0.5
    again = methods.load_config(write(tmp_path, config.dumps_toml(cfg), "again.toml"))
    assert again == cfg
    assert config.r_max(cfg) == 4 and config.client_ranks(cfg) == [2, 4]
    assert config.differences(cfg, again) == []
    assert config.differences(cfg, methods.replace_config(cfg, federation={"rounds": 6})) == [
        "federation.rounds: 5 -> 6"
    ]


def test_every_methods_section_has_its_defaults_once():
    cfg = methods.load_config(None)
    assert cfg.section("compression").whitening == "activation"
    assert cfg.section("fedala").steps == 2 and cfg.section("fedssi").psm_steps == 2  # one default, everywhere
    assert cfg.section("hetlora").reg == 0.01 and cfg.section("fedprox").mu == 0.01
    assert methods.load_config(None, ["compression.whitening=none"]).section("compression").whitening == "none"
    with pytest.raises(KeyError, match="no \\[nope\\] section"):
        cfg.section("nope")


def test_scalar_rank_is_broadcast():
    cfg = methods.config_from_dict({"lora": {"ranks": 8}, "data": {"num_clients": 3}})
    assert config.client_ranks(cfg) == [8, 8, 8]


@pytest.mark.parametrize(
    "data,message",
    [
        ({"strategy": {"name": "fedsgd"}}, "strategy.name: unknown method 'fedsgd'"),
        ({"lora": {"rankz": [1]}}, "unknown key 'lora.rankz'"),
        ({"lorra": {}}, "unknown section '[lorra]'"),
        ({"federaton": {}}, "unknown section '[federaton]' (known: model, lora, data, train, strategy, federation"),
        ({"federaton": {}}, "did you mean 'federation'?"),
        ({"strategy": {"hetlora_reg": 0.1}}, "these options live in their own section: [hetlora] reg"),
        ({"lora": {"ranks": [2, 0, 4]}, "data": {"num_clients": 3}}, "lora.ranks: every rank must be a positive"),
        ({"lora": {"ranks": [2, 4]}, "data": {"num_clients": 3}}, "lora.ranks: 2 ranks for data.num_clients = 3"),
        (
            {"lora": {"ranks": [2, 32], "r_max": 16}, "data": {"num_clients": 2}},
            "above the global maximum lora.r_max = 16",
        ),
        (
            {"lora": {"ranks": [2, 4]}, "data": {"num_clients": 2}, "strategy": {"name": "fedavg"}},
            "fedavg cannot take clients of different ranks: it needs equal ranks",
        ),
        (
            {"lora": {"ranks": [2, 4]}, "data": {"num_clients": 2}, "strategy": {"name": "fedala"}},
            "fedala cannot take clients of different ranks: it needs equal ranks",
        ),
        ({"train": {"lr": "fast"}}, "train.lr: expected a number"),
        ({"federation": {"fraction": 1.5}}, "federation.fraction"),
        ({"federation": {"min_clients": 6}}, "federation.min_clients = 6 is above the 5 clients sampled per round"),
        ({"federation": {"min_clients": 3, "fraction": 0.4}}, "above the 2 clients sampled per round"),
        ({"data": {"dirichlet_alpha": 0}}, "Dirichlet concentration"),
        ({"compression": {"whitening": "pca"}}, "compression.whitening must be 'none' or 'activation', got 'pca'"),
        ({"compression": {"whitening": 1}}, "compression.whitening: expected a string"),
        (
            {"compression": {"client_ratios": [0.5, 0.5]}, "strategy": {"name": "fedslm"}},
            "compression.client_ratios: 2 ratios",
        ),
        ({"hetlora": {"weighting": "loss"}}, "hetlora.weighting must be 'norm' or 'examples'"),
        ({"fedssi": {"psm_lambda": 0.0}}, "fedssi.psm_lambda must be in (0, 1]"),
        ({"fednl": {"travel": "some"}}, "fednl.travel: unknown value 'some' (known: all, rules, none)"),
        ({"fedmkt": {"topk": 0}}, "fedmkt.topk >= 1"),
        ({"elicitation": {"alpha": 2.0}}, "elicitation.alpha / compare_alphas must be in [0, 1]"),
        ({"fednl": {"gate": "open"}}, "fednl.gate: unknown value 'open'"),
        ({"fednl": {"rule_lr": 0}}, "fednl.rule_lr must be > 0, got 0"),
        (
            {"data": {"template": "vicuna"}},
            "data.template: unknown template 'vicuna' (known: alpaca, chat, flowertune)",
        ),
        ({"generation": {"rows": 3}}, "generation.rows: a generated evaluation answers instruction prompts"),
        (
            {"generation": {"top_p": 0.0}, "data": {"task": "instruction", "source": "bbc_tasks"}},
            "generation.temperature must be >= 0 and top_p in (0, 1]",
        ),
        ({"fednl": {"window_dropout": 1.0}}, "fednl.window_dropout must be in [0, 1), got 1.0"),
        ({"fednl": {"beta_source": "values"}}, "fednl.beta_source: unknown value 'values'"),
        ({"mqar": {"queries": 9}}, "mqar.queries: must be in 1..pairs (4), got 9"),
        ({"fednl": {"window": -1}}, "fednl.window must be >= 0, got -1"),
        ({"fednl": {"alpha_warmup_steps": -1}}, "fednl.alpha_warmup_steps must be >= 0, got -1"),
        ({"memory": {"window": 256}}, "[memory] is now part of [fednl]: move its keys there (fednl.<key>)"),
        ({"train": {"eval_stream_window": -2}}, "train.eval_stream_window"),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError) as exc:
        methods.config_from_dict(data, "exp.toml")
    assert message in str(exc.value) and str(exc.value).startswith("exp.toml")


def test_missing_unreadable_and_bad_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml: config file not found"):
        methods.load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="exp.toml: invalid TOML"):
        methods.load_config(write(tmp_path, "[lora\nranks=1"))
    with pytest.raises(ConfigError, match="latin.toml: not UTF-8 text"):
        methods.load_config(write(tmp_path, "", "latin.toml", raw="[data]\nsource = 'caf\xe9'\n".encode("latin-1")))
    with pytest.raises(ConfigError, match="expected section.key=value"):
        methods.load_config(None, ["rounds"])
    with pytest.raises(ConfigError, match=r"lora.ranks\[0\]: expected an integer, got '\[a,b\]'"):
        methods.load_config(None, ["lora.ranks=[a,b]"])


def test_every_shipped_config_loads():
    files = sorted((ROOT / "configs").rglob("*.toml"))
    assert len(files) >= 8
    names = {methods.load_config(f).strategy.name for f in files}
    assert names >= set(methods.REGISTRY)
    hl = methods.load_config(ROOT / "configs" / "methods" / "hetlora.toml")
    assert hl.section("hetlora").weighting == "norm" and hl.lora.ranks == (2, 4, 4, 8, 16)
    assert methods.load_config(ROOT / "configs" / "methods" / "fedavg.toml").lora.ranks == (8,)
    assert methods.load_config(ROOT / "configs" / "fednl" / "mmlu_rules_only.toml").section("fednl").travel == "rules"


def test_extends_merges_over_the_base_and_detects_loops(tmp_path):
    (tmp_path / "base.toml").write_text("[lora]\nranks = [2, 4]\nlora_alpha = 4.0\n[data]\nnum_clients = 2\n")
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[lora]\nlora_alpha = 8.0\n')
    cfg = methods.load_config(tmp_path / "child.toml")
    assert cfg.lora.ranks == (2, 4) and cfg.lora.lora_alpha == 8.0
    (tmp_path / "loop.toml").write_text('extends = "loop.toml"\n')
    with pytest.raises(ConfigError, match="loops back"):
        methods.load_config(tmp_path / "loop.toml")


def test_a_run_directory_from_before_the_reference_memory_runs_the_memory_it_trained(tmp_path):
    """A resolved [fednl] written before issue 32 (no conv_size, rule_lr, ...) is read back with the
    layer and training it ran with (no convolution, beta from the keys, one gate per layer, the
    rules at the LoRA's lr), so its checkpoints load, resume and export; a new config, written by
    a user or resolved now, gets the reference recipe."""
    path = tmp_path / "config.toml"
    path.write_text(
        "[strategy]\nname = 'fednl'\n[lora]\ntarget_modules = ['q_proj', 'v_proj']\n[train]\nlr = 3e-4\n"
        "[fednl]\ntravel = 'all'\ngate = 'learned'\nalpha_init = 0.05\n"
    )
    old = methods.load_run_config(path).section("fednl")
    assert (old.conv_size, old.beta_source, old.gate_scope, old.norm_weight, old.rule_lr) == (
        0,
        "keys",
        "layer",
        False,
        3e-4,
    )
    assert (old.warmup_steps, old.window_dropout, old.alpha_init) == (0, 0.0, 0.05)
    new = methods.load_config(path).section("fednl")  # a user's config: today's defaults
    assert (new.conv_size, new.beta_source, new.gate_scope, new.rule_lr) == (4, "hidden", "head", 1e-2)
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(config.dumps_toml(methods.load_config(path)))  # what a run writes now: every key
    assert methods.load_run_config(resolved).section("fednl") == new


def test_a_run_directorys_config_from_before_the_move_still_loads(tmp_path):
    """A resolved config written before FedNL's memory options and NIAH's settings got their own
    sections: a run directory's config.toml is migrated (so it resumes, exports and compares),
    a user's own config gets the pointer."""
    old = {
        "strategy": {"name": "fednl"},
        "lora": {"target_modules": ["q_proj", "v_proj"]},
        "data": {"source": "bbc_news", "niah_train_length": 256, "niah_depths": [0.5]},
        "memory": {"window": 64, "sink_tokens": 2},
        "fednl": {"travel": "rules"},
    }
    path = tmp_path / "config.toml"
    path.write_text(
        "[strategy]\nname = 'fednl'\n[lora]\ntarget_modules = ['q_proj', 'v_proj']\n"
        "[data]\nsource = 'bbc_news'\nniah_train_length = 256\nniah_depths = [0.5]\n"
        "[memory]\nwindow = 64\nsink_tokens = 2\n[fednl]\ntravel = 'rules'\n"
    )
    for cfg in (methods.load_run_config(path), methods.config_from_dict(old, "recorded", stored=True)):
        fednl = cfg.section("fednl")
        assert (fednl.window, fednl.sink_tokens, fednl.travel) == (64, 2, "rules")
        assert (cfg.section("niah").train_length, cfg.section("niah").depths) == (256, (0.5,))
    with pytest.raises(ConfigError, match=r"\[niah\] train_length"):  # a user's config: the pointers
        methods.load_config(path)
    path.write_text(path.read_text().replace("niah_train_length = 256\nniah_depths = [0.5]\n", ""))
    with pytest.raises(ConfigError, match=r"\[memory\] is now part of \[fednl\]"):
        methods.load_config(path)
