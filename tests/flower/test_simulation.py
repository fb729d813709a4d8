"""nestfed on Flower's simulation engine: ``flwr run flower_app <federation>`` against a SuperLink in
simulation mode, 5 virtual SuperNodes on the Ray backend (``flwr[simulation]``), the same
ServerApp and ClientApp as the deployment engine. The final adapter equals the embedded runner's
bit for bit (same seed, one torch thread everywhere)."""

import json

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from flower_helpers import APP_DIR, TINY, assert_same_adapter, embedded_run  # noqa: E402

from nestfed.flower.deploy import LocalDeployment  # noqa: E402

pytestmark = pytest.mark.flower

FIVE = ("data.num_clients=5", "lora.ranks=[2,4,4,8,16]", "strategy.name=prelort", "federation.rounds=2",
        "train.threads=1", "output.plots=false")


def test_five_virtual_clients_on_ray_match_the_embedded_runner_bit_for_bit(tmp_path):
    reference = embedded_run(tmp_path / "embedded", FIVE)
    run_dir = tmp_path / "sim"
    with LocalDeployment(tmp_path / "flower", simulation=True) as d:
        d.start_superlink()
        run_id = d.submit(APP_DIR, {"experiment": str(TINY), "overrides": ";".join(FIVE), "run-dir": str(run_dir),
                                    "connect-timeout-s": 240.0, "round-timeout-s": 300.0},
                          {"num-supernodes": 5, "client-resources-num-cpus": 1, "client-resources-num-gpus": 0.0})
        status = d.wait_run(run_id, 420)
        assert status["status"] == "finished:completed", (status, d.logs(run_id)[-4000:])
    assert_same_adapter(reference, run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [0, 1, 2]
    assert sorted(lines[1]["clients"]) == ["0", "1", "2", "3", "4"]
    assert {c["rank_sent"] for c in lines[1]["clients"].values()} == {2, 4, 8, 16}
    assert json.loads((run_dir / "summary.json").read_text())["engine"] == "flower"
