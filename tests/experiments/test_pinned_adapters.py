"""Behaviour pins: the sha256 of every method's final exported state on the tiny config.

Measured before the spine redesign (issue 10) and kept bit-identical through it; a change that
moves numbers on purpose updates these pins in its own commit and says why. The digest covers
the PEFT adapter (tensors, rank, lora_alpha), FedNL's memory rules and FedSLM's fused cores.

Bit-identity holds for one kind of CPU kernel: the pins were taken with one torch thread on an
x86_64 machine whose torch CPU capability is AVX2 (these machines). Elsewhere the test skips
with the reason; the exact-resume and Flower-equals-embedded tests still compare runs bit for
bit on any machine.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nestfed.cli import app
from tiny_federation import state_digest

ROOT = Path(__file__).resolve().parents[2]
PINNED_ON = ("x86_64", "AVX2")
EQUAL = ["--set", "lora.ranks=[8]"]
QKV = ["--set", 'lora.target_modules=["q_proj","k_proj","v_proj"]']
CASES = {  # name: (config, method, extra overrides, sha256)
    "prelort": ("configs/tiny.toml", "prelort", [], "30a10291b2d4c41e04486b5bb53b2840c8d78e4a5e392652f72a0d6488c1ba92"),
    "zeropad": ("configs/tiny.toml", "zeropad", [], "117c2a15c660cc37a180d76106f34bd39cfce2a85967f7f5b7a54cc11c68a7ad"),
    "hetlora": ("configs/tiny.toml", "hetlora", [], "016450cd23dc8b811d72c971656a946672e7082ecdb1ff797646a34ffb776fb9"),
    "flora": ("configs/tiny.toml", "flora", [], "99652de97e3ac179285e8ce601a74c64a11b9e7b7073d2f324b698f294e90905"),
    "ffa_lora": ("configs/tiny.toml", "ffa_lora", [], "c7775c166ef02c2ec972a0fb60bb70aa3d953ab4de11fa43693bd4a0c082dedb"),
    "fedavg": ("configs/tiny.toml", "fedavg", EQUAL, "91a0ba47f4dc348f8bfbae8da04f9c0b563b5a49890ea9378518e82bac61860d"),
    "fedprox": ("configs/tiny.toml", "fedprox", EQUAL, "64011274e4e4f5ea39f9aa9c94e0f5278d6f0265b4e39fb819654c4edbef2b35"),
    "fedala": ("configs/tiny.toml", "fedala", EQUAL, "b60228dd380a28bb9dfee16510f6c210e97cc7c6f116137fd87892c77b4a089d"),
    "fedssi": ("configs/tiny.toml", "fedssi", EQUAL, "a05847811a2cec0f74b4693afa4e6f628988c4f72ae82e903b494c29fab3a819"),
    "fednl": ("configs/tiny.toml", "fednl", EQUAL + QKV, "c9a78d8afd1f71c3096dc2470cbe2fafe1845f59db095989032dcac3e3023d74"),
    "fednl-rules": ("configs/tiny.toml", "fednl", EQUAL + QKV + ["--set", "fednl.travel=rules"],
                    "4d9a1f2421f1e39f7ddd28e3a839d2d9d2d56ddbbc60b74b15a4b5ce6a612c41"),
    "fedslm": ("configs/fedslm/tiny.toml", "fedslm", [], "f8eb2dbfbac5632083be5255128823e981a65f58f0405e12e508695f2995991b"),
    "fedmkt": ("configs/fedslm/tiny.toml", "fedmkt", [], "ace568b71de3cfffb6d1a88b64692a5e318f99ded1b73dca4594bcd6bf63838e"),
}


@pytest.fixture
def single_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("case", sorted(CASES))
def test_final_state_is_pinned(case, tmp_path, monkeypatch, single_thread):
    here = (platform.machine(), torch.backends.cpu.get_cpu_capability())
    if here != PINNED_ON:
        pytest.skip(f"pins were taken on {PINNED_ON}, this machine is {here}")
    config, method, extra, want = CASES[case]
    monkeypatch.chdir(ROOT)
    out = tmp_path / "runs"
    res = CliRunner().invoke(app, ["run", config, "--set", f"strategy.name={method}", "--set", "federation.rounds=3",
                                   "--set", f"output.dir={out}", "--set", "train.threads=1",
                                   "--set", "output.plots=false", *extra])
    assert res.exit_code == 0, res.output
    run_dir = next(p.parent for p in out.rglob("summary.json"))
    assert state_digest(run_dir) == want
