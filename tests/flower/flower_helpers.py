"""Helpers of the Flower tests: the experiment they run, its embedded reference, adapter comparison."""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
APP_DIR = ROOT / "flower_app"
# 3 clients with heterogeneous ranks, 2 rounds of PreLort on the tiny random Llama, one torch
# thread everywhere (the embedded run and every ClientApp process), so results can match exactly.
OVERRIDES = ("data.num_clients=3", "lora.ranks=[2,4,8]", "strategy.name=prelort", "federation.rounds=2",
             "train.threads=1", "output.plots=false")


def embedded_run(run_dir: Path, overrides=OVERRIDES) -> Path:
    """The embedded runner on the same experiment; returns the run directory."""
    from nestfed import config as C
    from nestfed.experiment import prepare, run_experiment

    n = torch.get_num_threads()
    try:
        cfg = C.load(TINY, list(overrides))
        run_experiment(prepare(cfg), cfg, run_dir)
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
    checkpoint of round ``rnd - 1`` (the initial state for round 1), computed in this process with
    the core pieces."""
    from nestfed import config as C
    from nestfed.experiment import prepare
    from nestfed.federation.client import ClientTrainer
    from nestfed.federation.runner import load_checkpoint
    from nestfed.strategies import make_strategy

    n = torch.get_num_threads()
    try:
        cfg = C.load(TINY, list(overrides))
        prep = prepare(cfg)
        trainer = ClientTrainer(prep.backbone.model, prep.data, cfg.train)
        strategy = make_strategy(cfg)
        if rnd == 1:
            state = strategy.initialize(prep.shapes, prep.clients)
        else:
            _, state = load_checkpoint(run_dir / "checkpoints" / f"round_{rnd - 1:03d}.safetensors")
        ins = strategy.configure(rnd, state, prep.clients)
        return strategy.aggregate(rnd, state, {c: trainer.fit(c, ins[c]) for c in ins if c not in missing})
    finally:
        torch.set_num_threads(n)
