"""The run directory, crash-consistent at every write: a failure injected at each write point of a
run (a torn temporary file, a torn metrics line), then a resume, gives the uninterrupted run's
final state bit for bit and exactly one metrics line per round. Plus: the user's umask, the
latest checkpoint by round number, torn lines, corrupted and legacy checkpoints, runs that never
aggregate."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_federation import lines, state_digest, tiny_config, tiny_prepared, with_build

from nestfed.errors import DataError, NestfedError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import GlobalState, Reply
from nestfed.federation.run_dir import RunDir
from nestfed.federation.run_files import flatten_client_state
from nestfed.io import atomic
from nestfed.nn.peft_export import export_peft_adapter

CASES = {
    "prelort": (),
    "fedala": ("strategy.name=fedala", "lora.ranks=[4]"),
    "fednl-rules": ("strategy.name=fednl", "lora.ranks=[4]", "fednl.travel=rules", "fednl.layers=[1]"),
    "prelort-clients-file": ("output.client_detail=file", "evaluation.clients=2"),  # clients.jsonl, clients.json
}


class Crash(Exception):
    pass


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def inject(monkeypatch, at: int, seen: list):
    """Make the ``at``-th write of the run fail the way a kill would leave it: a half-written
    temporary file beside the target (atomic writes), or half a metrics line (the append)."""
    real_bytes, real_append, real_dir = atomic.write_bytes, atomic.append_line, atomic.write_dir

    def write_bytes(path, data):
        seen.append(Path(path).name)
        if len(seen) == at:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            (Path(path).parent / f".{Path(path).name}-killed.tmp").write_bytes(data[: len(data) // 2])
            raise Crash(Path(path).name)
        return real_bytes(path, data)

    def append_line(path, line):
        seen.append(Path(path).name)
        if len(seen) == at:
            with open(path, "a") as f:
                f.write(line[: len(line) // 2])
            raise Crash(Path(path).name)
        return real_append(path, line)

    def write_dir(path, build):
        seen.append(Path(path).name)
        if len(seen) == at:
            raise Crash(Path(path).name)
        return real_dir(path, build)

    monkeypatch.setattr(atomic, "write_bytes", write_bytes)
    monkeypatch.setattr(atomic, "append_line", append_line)
    monkeypatch.setattr(atomic, "write_dir", write_dir)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failure_at_every_write_point_resumes_to_the_same_final_state(tmp_path, monkeypatch, case):
    cfg = tiny_config(*CASES[case], "federation.rounds=2", "output.plots=true")
    ref = tmp_path / "ref"
    seen: list[str] = []
    inject(monkeypatch, 10**9, seen)  # count the write points of an uninterrupted run
    run_method(tiny_prepared(cfg), cfg, ref)
    monkeypatch.undo()
    want = state_digest(ref)
    assert seen[0] in ("config.toml", "clients.jsonl") and seen[-1] == "summary.json" and len(seen) >= 9, seen
    for at in range(1, len(seen) + 1):
        run_dir = tmp_path / f"crash_{at}"
        inject(monkeypatch, at, [])
        with pytest.raises(Crash):
            run_method(tiny_prepared(cfg), cfg, run_dir)
        monkeypatch.undo()
        if (run_dir / "config.toml").is_file():
            run_method(tiny_prepared(cfg), cfg, run_dir, resume=True)
        else:  # it died writing config.toml: nothing to resume; the same directory takes a new run
            with pytest.raises(NestfedError, match="no config.toml"):
                RunDir.open(run_dir)
            run_method(tiny_prepared(cfg), cfg, run_dir)
        assert state_digest(run_dir) == want, (case, at, seen[at - 1])
        assert [ln["round"] for ln in lines(run_dir)] == [0, 1, 2], (case, at, seen[at - 1])
        if not RunDir(run_dir).inline:  # the per-client lines too: exactly one per round
            assert [ln["round"] for ln in RunDir(run_dir)._read_lines(run_dir / "clients.jsonl")[0]] == [0, 1, 2]
        assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2


def test_files_and_folders_take_the_users_umask(tmp_path):
    old = os.umask(0o027)
    try:
        cfg = tiny_config("federation.rounds=1", "output.plots=true")
        run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    finally:
        os.umask(old)
    rd = tmp_path / "run"
    for f in (
        "config.toml",
        "summary.json",
        "metrics.jsonl",
        "checkpoints/round_001.safetensors",
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "plots/bytes.png",
    ):
        assert (rd / f).stat().st_mode & 0o777 == 0o640, f
    for d in ("", "checkpoints", "adapter", "plots"):
        assert (rd / d).stat().st_mode & 0o777 == 0o750, d
    assert not [p for p in rd.rglob(".*")]  # no temporary file left behind


def test_the_latest_checkpoint_is_found_by_round_number(tmp_path):
    rd = RunDir.create(tmp_path / "r", "")
    for rnd in (999, 1000, 2):
        rd.save_checkpoint(rnd, GlobalState({"x": torch.tensor([float(rnd)])}, {}), {})
    assert [r for r, _ in rd.checkpoints()] == [2, 999, 1000]
    assert rd.latest_checkpoint().round == 1000 and float(rd.latest_checkpoint().state.arrays["x"]) == 1000.0
    (tmp_path / "r" / "checkpoints" / "round_1001.safetensors").write_bytes(rd.checkpoint_path(2).read_bytes())
    with pytest.raises(DataError, match="round_1001.safetensors: holds the state of round 2, not of round 1001"):
        rd.latest_checkpoint()


def test_a_torn_last_line_is_dropped_with_a_warning_and_a_torn_middle_line_is_an_error(tmp_path, caplog):
    rd = RunDir.create(tmp_path / "r", "")
    rd.save_checkpoint(0, GlobalState({}, {}), {})
    rd.append_metrics({"round": 0})
    with open(rd.metrics_path, "a") as f:
        f.write('{"round": 1, "cli')
    assert rd.read_metrics() == [{"round": 0}] and "torn last line" in caplog.text
    ck, notes = rd.resume(False)
    assert ck.round == 0 and any("torn" in n for n in notes)
    assert rd.metrics_path.read_text() == '{"round": 0}\n'  # repaired, atomically
    rd.metrics_path.write_text('{"round": 0}\n{"rou\n{"round": 1}\n')
    with pytest.raises(DataError, match="metrics.jsonl:2: malformed JSON line"):
        rd.read_metrics()


def test_corrupted_missing_and_legacy_checkpoints(tmp_path):
    rd = RunDir.create(tmp_path / "r", "")
    rd.append_metrics({"round": 0})
    rd.append_metrics({"round": 1})
    with pytest.raises(NestfedError, match="no checkpoint to resume from"):
        rd.resume(False)  # lines of round 1 exist, so this is not a crash before round 0
    (tmp_path / "r" / "checkpoints").mkdir()
    (tmp_path / "r" / "checkpoints" / "round_001.safetensors").write_bytes(b"\x00" * 32)
    with pytest.raises(DataError, match="round_001.safetensors: not a readable nestfed checkpoint"):
        rd.resume(False)
    # the format before one-file checkpoints: round_NNN plus clients_NNN beside it
    legacy = RunDir.create(tmp_path / "old", "")
    ck = tmp_path / "old" / "checkpoints" / "round_002.safetensors"
    ck.parent.mkdir()
    save_file({"a": torch.ones(2)}, str(ck), {"round": "2", "meta": json.dumps({"ranks": {"0": 4}})})
    got = legacy.load_checkpoint(ck)
    assert got.round == 2 and torch.equal(got.state.arrays["a"], torch.ones(2)) and got.client_state is None
    with pytest.raises(NestfedError, match="keeps per-client state, which this checkpoint does not hold"):
        legacy.latest_checkpoint(keeps_client_state=True)
    save_file(flatten_client_state({0: {"kept": {"k": torch.zeros(1)}}}), str(ck.with_name("clients_002.safetensors")))
    assert torch.equal(legacy.latest_checkpoint(True).client_state[0]["kept"]["k"], torch.zeros(1))


def test_a_crash_before_round_0_was_committed_starts_again_and_a_used_directory_is_refused(tmp_path):
    cfg = tiny_config("federation.rounds=1")
    rd = RunDir.create(tmp_path / "r", "")
    rd.append_metrics({"round": 0, "eval": {}})
    ck, notes = rd.resume(False)
    assert ck is None and rd.metrics_path.read_text() == "" and notes
    with pytest.raises(NestfedError, match="exists and is not empty"):
        run_method(tiny_prepared(cfg), cfg, tmp_path / "r")


def test_a_run_in_which_no_round_aggregated_exports_no_adapter(tmp_path):
    cfg = tiny_config("strategy.name=flora", "federation.rounds=2")
    prep = tiny_prepared(cfg)

    def poison(trainer):
        real = trainer.fit
        trainer.fit = lambda cid, ins: Reply({k: v * float("nan") for k, v in real(cid, ins).arrays.items()}, 6)
        return trainer

    from nestfed import methods

    build = methods.get("flora").build

    def build_poisoned(p, c):
        mr = build(p, c)
        mr.trainer = poison(mr.trainer)
        return mr

    flora = methods.REGISTRY["flora"]
    methods.REGISTRY["flora"] = with_build("flora", build_poisoned)
    try:
        summary = run_method(prep, cfg, tmp_path / "run")
    finally:
        methods.REGISTRY["flora"] = flora
    assert summary["aggregated_rounds"] == 0 and summary["adapter"] is None and summary["rejected_updates"] == 6
    assert not (tmp_path / "run" / "adapter").exists()
    with pytest.raises(ValueError, match="rank 0"):
        export_peft_adapter(
            {
                "base_model.model.m.lora_A.weight": torch.zeros(0, 2),
                "base_model.model.m.lora_B.weight": torch.zeros(2, 0),
            },
            1.0,
            tmp_path / "a",
        )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedslm", "fedmkt"])
def test_compressed_methods_resume_exactly_after_a_crash_in_a_later_round(tmp_path, monkeypatch, method):
    """FedMKT's clients keep their own models (their kept state, checkpointed with each round) and
    FedSLM's server recipe runs after the last round: both resume to the uninterrupted state."""
    from nestfed import methods
    from nestfed.experiments.prepare import prepare

    root = Path(__file__).resolve().parents[2]
    cfg = methods.load_config(
        root / "configs" / "fedslm" / "tiny.toml",
        [f"strategy.name={method}", "federation.rounds=3", "output.plots=false"],
    )
    seen: list[str] = []
    inject(monkeypatch, 10**9, seen)
    run_method(prepare(cfg), cfg, tmp_path / "ref")
    monkeypatch.undo()
    at = seen.index("round_002.safetensors") + 1  # its metrics line is written, its checkpoint is not
    inject(monkeypatch, at, [])
    with pytest.raises(Crash):
        run_method(prepare(cfg), cfg, tmp_path / "cut")
    monkeypatch.undo()
    run_method(prepare(cfg), cfg, tmp_path / "cut", resume=True)
    assert state_digest(tmp_path / "cut") == state_digest(tmp_path / "ref")
    assert [ln["round"] for ln in lines(tmp_path / "cut")] == [0, 1, 2, 3]
