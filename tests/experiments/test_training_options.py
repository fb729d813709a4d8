"""The Hugging Face training options on whole runs and on the client trainer: a schedule and
lora_dropout resume exactly, a resume cannot stretch a schedule over other rounds, FedNL's rules
follow the schedule at their own rate, dropout masks come from the seed rule alone and act even
after a before_steps hook that evaluates."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nestfed.config import ModelConfig, TrainConfig
from nestfed.data.clients import ClientData
from nestfed.federation.client import ClientTrainer
from nestfed.federation.hooks import ClientHooks
from nestfed.federation.messages import Instruction
from nestfed.nn.backbone import load_backbone
from nestfed.nn.lora import get_adapter_state, inject_lora, lora_modules
from tests.interruption import interrupted_in_round

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
OPTIONS = ["--set", "lora.lora_dropout=0.2", "--set", "train.lr_schedule=cosine", "--set", "train.warmup_steps=1"]
OPTIONS += ["--set", "train.lr_schedule_scope=federation"]


def run_args(runs: Path, name: str, *extra: str) -> list[str]:
    sets = [f"output.dir={runs}", f"output.name={name}", "federation.rounds=2", "data.num_clients=2"]
    sets += ["lora.ranks=[2,4]", "output.plots=false", "train.threads=1"]
    return ["run", str(TINY), *[x for s in sets for x in ("--set", s)], *extra]


@pytest.mark.slow
def test_dropout_and_a_federation_schedule_resume_exactly(tmp_path, cli):
    runs = tmp_path / "runs"
    for name, extra in (("full", OPTIONS), ("cut", OPTIONS), ("plain", [])):
        r = cli(*run_args(runs, name, *extra), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    full, cut, plain = (sorted(runs.glob(f"{n}-*"))[0] for n in ("full", "cut", "plain"))
    interrupted_in_round(cut, 2)  # "cut" as a crash during round 2 leaves it
    r = cli("run", "--resume", str(cut), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    adapter = "adapter/adapter_model.safetensors"
    assert (full / adapter).read_bytes() == (cut / adapter).read_bytes()
    a, b = load_file(full / adapter), load_file(plain / adapter)
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-6  # the options changed the training
    assert json.loads((full / "adapter" / "adapter_config.json").read_text())["lora_dropout"] == pytest.approx(0.2)


def test_a_resume_cannot_change_the_rounds_a_schedule_spans(tmp_path, cli):
    runs = tmp_path / "runs"
    sets = ["--set", "train.lr_schedule=linear", "--set", "train.lr_schedule_scope=federation"]
    r = cli(*run_args(runs, "linear", *sets), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir = next(runs.iterdir())
    r = cli("run", "--resume", str(run_dir), "--set", "federation.rounds=3", cwd=tmp_path)
    assert r.returncode == 2 and "federation.rounds: 2 -> 3 under train.lr_schedule = 'linear'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_fednl_rules_follow_the_schedule_at_their_own_rate(tmp_path, cli, monkeypatch):
    """FedNL trains its memory rules in their own group at fednl.rule_lr: every step scales both
    groups by one factor (linear per round over 2 steps: 1, then 1/2)."""
    seen = []
    step = torch.optim.AdamW.step

    def recording(self, *a, **kw):
        seen.append([g["lr"] for g in self.param_groups])
        return step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    sets = ["strategy.name=fednl", "lora.ranks=[4]", "fednl.rule_lr=0.01", "train.lr_schedule=linear"]
    sets += ['lora.target_modules=["q_proj","k_proj","v_proj"]', "federation.rounds=1"]
    r = cli(*run_args(tmp_path / "runs", "fednl", *[x for s in sets for x in ("--set", s)]), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [lrs for lrs in seen if len(lrs) == 2]  # the clients' local steps (2 clients x 2 steps)
    assert steps == [pytest.approx([1e-3, 1e-2]), pytest.approx([5e-4, 5e-3])] * 2


class Evaluates(ClientHooks):
    """A before_steps that leaves the model in evaluation mode (as a validation pass does)."""

    def before_steps(self, ctx, params):
        ctx.model.eval()
        return {}


def test_dropout_masks_come_from_the_seed_rule_and_act_after_an_evaluating_hook(one_thread):
    m = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(m, ("q_proj", "v_proj"), rank=2, scaling=1.0, dropout=0.5)
    ids = torch.randint(0, 258, (4, 12))
    data = {0: ClientData(ids, ids.clone(), ids[:1], ids[:1].clone())}
    trainer = ClientTrainer(m, data, TrainConfig(local_steps=2, batch_size=2), Evaluates())
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(m).items()}
    instruction = Instruction(state, {"rank": 2, "scaling": 1.0, "round": 1})
    before = torch.random.get_rng_state()
    one = trainer.fit(0, instruction).arrays
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's generator as it was
    torch.rand(3)  # the caller's own draws do not reach the client's masks
    two = trainer.fit(0, instruction).arrays
    assert all(torch.equal(one[k], two[k]) for k in one)
    for layer in lora_modules(m).values():
        layer.lora_dropout.p = 0.0
    plain = trainer.fit(0, instruction).arrays
    assert any(not torch.equal(one[k], plain[k]) for k in one)  # the masks acted in training mode
