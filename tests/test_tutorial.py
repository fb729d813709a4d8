"""docs/tutorial.md's method, run exactly as the page writes it: its home (the page's Python block)
registered with one line, one round on the tiny model equal to the equal-weight mean of the
clients' padded replies computed by hand, and equal to ZeroPad's when every n_k is equal."""

import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from nestfed import methods

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def page_overrides() -> list[str]:
    """The ``--set`` overrides of the page's tiny-model run command, as the page writes them."""
    page = (ROOT / "docs" / "tutorial.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in page.splitlines() if "nestfed run configs/tiny.toml" in ln)
    words = shlex.split(line)
    return [words[i + 1] for i, w in enumerate(words) if w == "--set"]


# the page's command, made one round on one thread without plots
OVERRIDES = [*page_overrides(), "federation.rounds=1", "train.threads=1", "output.plots=false"]


@pytest.fixture
def tutorial_method(tmp_path, monkeypatch):
    """The page's home as module ``uniform_pad``, and the registry line the page asks for."""
    page = (ROOT / "docs" / "tutorial.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 1, "the tutorial has one Python block: the whole home"
    (tmp_path / "uniform_pad.py").write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "uniform_pad", raising=False)
    home = importlib.import_module("uniform_pad")
    monkeypatch.setitem(methods.REGISTRY, home.METHOD.name, home.METHOD)
    return home


def test_the_tutorials_method_runs_and_aggregates_as_the_page_says(tmp_path, tutorial_method):
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import run_method
    from nestfed.federation.run_dir import RunDir
    from nestfed.methods.implementation import lora_settings
    from nestfed.methods.zeropad.strategy import ZeroPad
    from nestfed.nn.keys import rank_dim

    n = torch.get_num_threads()
    try:
        cfg = methods.load_config(TINY, OVERRIDES)
        prep = prepare(cfg)
        run_method(prep, cfg, tmp_path / "run")
        mr = methods.get("uniform_pad").build(prep, cfg)
        rd = RunDir(tmp_path / "run")
        start = rd.load_checkpoint(tmp_path / "run" / "checkpoints" / "round_000.safetensors").state
        got = rd.load_checkpoint(tmp_path / "run" / "checkpoints" / "round_001.safetensors").state
        ins = mr.strategy.configure(1, start, prep.clients)
        replies = {c: mr.trainer.fit(c, ins[c]) for c in ins}
    finally:
        torch.set_num_threads(n)
    assert sorted(replies) == [0, 1, 2]

    def by_hand(key):  # zeros of the global shape with each client's rows (A) or columns (B) copied in, mean
        padded = []
        for c in sorted(replies):
            a = replies[c].arrays[key]
            z = torch.zeros_like(start.arrays[key])
            z.narrow(rank_dim(key), 0, a.shape[rank_dim(key)]).copy_(a)
            padded.append(z)
        return (padded[0] + padded[1] + padded[2]) / 3

    for key in start.arrays:  # the run's round equals the rule by hand
        assert start.arrays[key].shape[rank_dim(key)] == 8
        assert torch.allclose(got.arrays[key], by_hand(key), rtol=1e-6, atol=1e-8), key
    # every n_k is 8 blocks here, so ZeroPad's n_k weights are equal too and the two agree ...
    assert len({r.num_examples for r in replies.values()}) == 1
    zp = ZeroPad(lora_settings(cfg)).aggregate(1, start, replies)
    assert all(torch.allclose(got.arrays[k], zp.arrays[k], rtol=1e-6, atol=1e-8) for k in zp.arrays)
    # ... while with unequal n_k UniformPad still weighs each client once and ZeroPad does not
    for c, n_k in zip(sorted(replies), (1, 5, 50)):
        replies[c].num_examples = n_k
    up = mr.strategy.aggregate(1, start, replies)
    zp = ZeroPad(lora_settings(cfg)).aggregate(1, start, replies)
    for key in start.arrays:
        assert torch.allclose(up.arrays[key], by_hand(key), rtol=1e-6, atol=1e-8), key
    assert any(not torch.allclose(up.arrays[k], zp.arrays[k], rtol=1e-4, atol=1e-7) for k in zp.arrays)
    with pytest.raises(methods.ConfigError, match="uniform_pad cannot aggregate robustly"):
        methods.load_config(TINY, OVERRIDES + ["robust.rule=median"])
