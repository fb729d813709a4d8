"""nestfed on Flower's simulation engine: ``flwr run flower_app <federation>`` against a SuperLink in
simulation mode, 12 virtual SuperNodes on the Ray backend (``flwr[simulation]``) of which a round
samples 3, the same ServerApp and ClientApp as the deployment engine. The ClientApp runs inside Ray's
actors (no worker per virtual node: the worker directory stays empty), no client is dropped, and the
final adapter equals the embedded runner's bit for bit (same seed, one torch thread everywhere)."""

import json

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from flower_helpers import APP_DIR, TINY, assert_same_adapter, embedded_run  # noqa: E402

from nestfed.testing.flower_deployment import LocalDeployment  # noqa: E402

pytestmark = pytest.mark.flower

TWELVE = (
    "data.num_clients=12",
    "data.partition=iid",
    "lora.ranks=[2]",
    "population.rank_shares={2=0.5,4=0.25,8=0.25}",
    "federation.fraction=0.25",
    "strategy.name=prelort",
    "federation.rounds=2",
    "train.threads=1",
    "output.plots=false",
    "output.client_detail=inline",
    "train.client_cache=off",
)


def test_twelve_virtual_clients_on_ray_actors_match_the_embedded_runner_bit_for_bit(tmp_path):
    reference = embedded_run(tmp_path / "embedded", TWELVE)
    run_dir = tmp_path / "sim"
    with LocalDeployment(tmp_path / "flower", simulation=True) as d:
        d.start_superlink()
        run_id = d.submit(
            APP_DIR,
            {
                "experiment": str(TINY),
                "overrides": ";".join(TWELVE),
                "run-dir": str(run_dir),
                "connect-timeout-s": 240.0,
                "round-timeout-s": 300.0,
            },
            {"num-supernodes": 12, "client-resources-num-cpus": 1, "client-resources-num-gpus": 0.0},
        )
        status = d.wait_run(run_id, 420)
        assert status["status"] == "finished:completed", (status, d.logs(run_id)[-4000:])
        assert list(d.worker_dir.iterdir()) == []  # no worker per virtual node: the actors ran the ClientApp
    assert_same_adapter(reference, run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (tmp_path / "embedded" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [0, 1, 2] and len(lines[0]["nodes"]) == 12
    for ln, ref in zip(lines[1:], want[1:]):
        assert ln["sampled"] == ref["sampled"] and len(ln["sampled"]) == 3
        assert ln["dropped"] == {} and all(c["status"] == "accepted" for c in ln["clients"].values())
    assert json.loads((run_dir / "summary.json").read_text())["engine"] == "flower"
