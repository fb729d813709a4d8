"""Adding a method is one new home plus one registry line: a toy method defined here, registered,
is validated, listed, run by the round loop and resumed, with no other edit."""

from dataclasses import dataclass

import pytest
from tiny_federation import lines, tiny_config, tiny_prepared

from nestfed import methods
from nestfed.config import ConfigError, ExperimentConfig
from nestfed.config.capabilities import Capability
from nestfed.experiments.run import run_method
from nestfed.federation.aggregation import pad_rank
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, lora_keys
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.methods.method import lora_method
from nestfed.nn.keys import rank_dim


@dataclass(frozen=True)
class ToyOptions:
    """step: the server's step size on the mean zero-padded update, in (0, 1]."""

    step: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.step <= 1:
            raise ValueError(f"step must be in (0, 1], got {self.step}")


class Toy(LoraStrategy):
    """ZeroPad's mean update, applied with a server step size (a FedAvgM-like toy)."""

    name = "toy"

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        new = copy_state(state)
        for key in lora_keys(state.arrays):
            d = rank_dim(key)
            updates = [pad_rank(r.arrays[key], d, self.s.r_max) - state.arrays[key] for r in replies.values()]
            new.arrays[key] = state.arrays[key] + self.options.step * sum(updates) / len(updates)
        return new


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> Toy:
    return Toy(lora_settings(cfg), cfg.section("toy"))


TOY = lora_method(
    "toy",
    "a toy: ZeroPad's mean update with a server step",
    lora_implementation(_strategy),
    sections={"toy": ToyOptions},
    capabilities=frozenset({Capability.HETEROGENEOUS_RANKS, Capability.RESUME}),
)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(methods.REGISTRY, "toy", TOY)


def test_a_new_home_plus_one_registry_line_runs_everywhere(tmp_path, registered, one_thread):
    cfg = tiny_config("strategy.name=toy", "toy.step=0.25", "federation.rounds=2")
    assert cfg.section("toy").step == 0.25 and "toy" in methods.schema().methods
    with pytest.raises(ConfigError, match="toy.step must be in \\(0, 1\\], got 2.0"):
        tiny_config("strategy.name=toy", "toy.step=2.0")
    summary = run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    assert summary["method"] == "toy" and summary["aggregated_rounds"] == 2
    ls = lines(tmp_path / "run")
    assert ls[-1]["eval"]["0"]["loss"] < ls[0]["eval"]["0"]["loss"]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert "[toy]\nstep = 0.25" in (tmp_path / "run" / "config.toml").read_text()


def test_an_unregistered_name_is_refused_with_the_registrys_list():
    with pytest.raises(ConfigError, match="strategy.name: unknown method 'toy' \\(known: prelort, zeropad"):
        tiny_config("strategy.name=toy")
