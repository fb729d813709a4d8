"""TensorBoard and MLflow hold the same per-round values as metrics.jsonl, read back through each
library's own reader, also across a crash and a resume, and a failing sink never stops a run."""

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nestfed.errors import ConfigError
from nestfed.federation import tracking
from nestfed.federation.tracking import scalars
from tests.tiny_federation import Interrupt, crash_at, lines, tiny_config, tiny_run


def tracked(tmp_path, *extra):
    return tiny_config(
        "strategy.name=prelort",
        "tracking.tensorboard=true",
        "tracking.mlflow=true",
        f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.mlflow_experiment=t",
        f"output.dir={tmp_path}",
        *extra,
    )


def tensorboard_values(run_dir) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def python_loader_steps(run_dir, tag: str) -> list[int]:
    """The steps ``tensorboard --load_fast=false`` shows (its plugin event accumulator)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator

    ea = plugin_event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    return [e.step for e in ea.Tensors(tag)]


def mlflow_values(tmp_path, run_dir) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    return {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics
    }


def expected(run_dir, as_float32=False) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for line in lines(run_dir):
        for k, v in scalars(line).items():
            out.setdefault(k, []).append((line["round"], float(np.float32(v)) if as_float32 else v))
    return out


def test_scalars_flattens_a_line_by_hand():
    line = {
        "round": 2,
        "aggregated": True,
        "sampled": [0, 1],
        "eval": {"0": {"ppl": 4.0, "loss": 1.0}, "1": {"ppl": 6.0, "loss": float("nan")}},
        "clients": {"1": {"bytes_up": 10, "status": "accepted", "metrics": {"train_loss": 0.5}}},
        "time_s": 1.5,
    }
    assert scalars(line) == {
        "round": 2.0,
        "eval/0/ppl": 4.0,
        "eval/0/loss": 1.0,
        "eval/1/ppl": 6.0,
        "clients/1/bytes_up": 10.0,
        "clients/1/metrics/train_loss": 0.5,
        "time_s": 1.5,
        "eval/mean/ppl": 5.0,
        "eval/mean/loss": 1.0,
    }


@pytest.mark.slow
def test_both_sinks_hold_what_metrics_jsonl_holds(tmp_path):
    cfg = tracked(tmp_path)
    tiny_run(tmp_path / "run", cfg)
    want = expected(tmp_path / "run")
    assert len(want["eval/mean/ppl"]) == 4 and "clients/2/metrics/train_loss" in want  # rounds 0..3
    assert mlflow_values(tmp_path, tmp_path / "run") == want
    assert tensorboard_values(tmp_path / "run") == expected(tmp_path / "run", as_float32=True)
    rounds = [ln["round"] for ln in lines(tmp_path / "run")]
    assert python_loader_steps(tmp_path / "run", "eval/mean/ppl") == rounds  # the Python loader purges too
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((tmp_path / "run" / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["strategy.name"] == "prelort" and run.data.params["lora.ranks"] == "[2, 4, 8]"
    assert client.get_experiment(run.info.experiment_id).name == "t"


@pytest.mark.slow
def test_a_crash_and_resume_leaves_every_round_once(tmp_path):
    """Killed in round 2 (rounds 0 and 1 committed and tracked), resumed: each sink holds each
    round exactly once, the values of the resumed metrics.jsonl."""
    cfg = tracked(tmp_path)
    with pytest.raises(Interrupt):
        tiny_run(tmp_path / "run", cfg, wrap=crash_at(2, 1))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    assert client.get_run(run_id).info.status == "KILLED"
    assert [s for s, _ in tensorboard_values(tmp_path / "run")["eval/mean/ppl"]] == [0, 1]
    tiny_run(tmp_path / "run", cfg, resume=True)
    assert (tmp_path / "run" / "mlflow_run_id").read_text().strip() == run_id
    assert mlflow_values(tmp_path, tmp_path / "run") == expected(tmp_path / "run")
    assert tensorboard_values(tmp_path / "run") == expected(tmp_path / "run", as_float32=True)


@pytest.mark.slow
def test_a_sink_added_on_resume_is_caught_up(tmp_path):
    cfg = tiny_config("strategy.name=prelort", f"output.dir={tmp_path}")
    with pytest.raises(Interrupt):
        tiny_run(tmp_path / "run", cfg, wrap=crash_at(3, 0))
    tiny_run(tmp_path / "run", tracked(tmp_path), resume=True)
    assert mlflow_values(tmp_path, tmp_path / "run") == expected(tmp_path / "run")
    assert len(expected(tmp_path / "run")["round"]) == 4


class Failing:
    name = "failing"

    def open(self, lines):
        pass

    def log(self, line):
        if line["round"] == 1:
            raise OSError("disk full")

    def close(self, finished):
        pass


@pytest.mark.slow
def test_a_failing_sink_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    real = tracking.sinks
    monkeypatch.setattr(tracking, "sinks", lambda *a: real(*a) + [Failing()])
    state, loop, mr = tiny_run(tmp_path / "run", tracked(tmp_path))
    assert [ln["round"] for ln in lines(tmp_path / "run")] == [0, 1, 2, 3]
    assert any("tracking sink failing failed (OSError: disk full)" in m for m in loop.log)
    assert mlflow_values(tmp_path, tmp_path / "run") == expected(tmp_path / "run")


def test_missing_packages_and_bad_uris_are_one_line(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tracking(name, *a, **kw):
        if name.startswith(("mlflow", "torch.utils.tensorboard")):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tracking)
    with pytest.raises(ConfigError, match=r"tracking.tensorboard = true needs the tensorboard package"):
        tracking.TensorBoardSink(tmp_path)
    with pytest.raises(ConfigError, match=r"tracking.mlflow = true needs the mlflow package"):
        tracking.MlflowSink("sqlite:///x.db", "e", "r", tmp_path / "id")
    monkeypatch.setattr(builtins, "__import__", real_import)
    with pytest.raises(Exception, match=r"tracking.mlflow_uri: 'runs/mlflow.db' is not a URI"):
        tiny_config("tracking.mlflow=true", "tracking.mlflow_uri=runs/mlflow.db")
