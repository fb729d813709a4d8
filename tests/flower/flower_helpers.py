"""Helpers of the Flower tests: the experiment they run, its embedded reference, adapter comparison."""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
APP_DIR = ROOT / "flower_app"
# 3 clients with heterogeneous ranks, 2 rounds of PreLort on the tiny random Llama, one torch
# thread everywhere (the embedded run and every ClientApp process), so results can match exactly.
OVERRIDES = (
    "data.num_clients=3",
    "lora.ranks=[2,4,8]",
    "strategy.name=prelort",
    "federation.rounds=2",
    "train.threads=1",
    "output.plots=false",
)


def embedded_run(run_dir: Path, overrides=OVERRIDES) -> Path:
    """The embedded runner on the same experiment; returns the run directory."""
    from nestfed import methods
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import run_method

    n = torch.get_num_threads()
    try:
        cfg = methods.load_config(TINY, list(overrides))
        run_method(prepare(cfg), cfg, run_dir)
    finally:
        torch.set_num_threads(n)
    return run_dir


def adapter_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: Path, b: Path) -> None:
    """Both run directories hold bit-identical PEFT adapters (same keys, config and tensors)."""
    import json

    ta, tb = adapter_tensors(a), adapter_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].shape == tb[k].shape and torch.equal(ta[k], tb[k]), k
    ca = json.loads((a / "adapter" / "adapter_config.json").read_text())
    cb = json.loads((b / "adapter" / "adapter_config.json").read_text())
    assert (ca["r"], ca["lora_alpha"], ca["target_modules"]) == (cb["r"], cb["lora_alpha"], cb["target_modules"])


def expected_round_without(run_dir: Path, rnd: int, missing: set[int], overrides=OVERRIDES):
    """The global state after round ``rnd`` aggregated without ``missing`` clients, from the run's
    checkpoint of round ``rnd - 1`` (round 0 holds the initial state), computed in this process
    with the method's own strategy and trainer."""
    from nestfed import methods
    from nestfed.experiments.prepare import prepare
    from nestfed.federation.run_dir import RunDir

    n = torch.get_num_threads()
    try:
        cfg = methods.load_config(TINY, list(overrides))
        prep = prepare(cfg)
        mr = methods.get(cfg.strategy.name).build(prep, cfg)
        strategy, trainer = mr.strategy, mr.trainer
        state = RunDir(run_dir).load_checkpoint(run_dir / "checkpoints" / f"round_{rnd - 1:03d}.safetensors").state
        ins = strategy.configure(rnd, state, prep.clients)
        return strategy.aggregate(rnd, state, {c: trainer.fit(c, ins[c]) for c in ins if c not in missing})
    finally:
        torch.set_num_threads(n)
