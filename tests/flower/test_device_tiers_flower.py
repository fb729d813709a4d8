"""Device tiers on Flower: each node prepares the experiment it is sent, draws the same budgets and
so the same tier for its partition as the embedded runner, trains on that tier's backbone (nf4 or
float32) and reports its precision in QUERY; the run ends on the embedded runner's adapter."""

import json

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("bitsandbytes")

from flower_helpers import OVERRIDES, TINY, assert_same_adapter, embedded_run  # noqa: E402

from nestfed import config, methods  # noqa: E402
from nestfed.flower import client_app as CA  # noqa: E402
from nestfed.flower.server_app import run_on_grid  # noqa: E402
from nestfed.nn.footprint import Footprint  # noqa: E402
from nestfed.nn.lora import lora_modules  # noqa: E402
from nestfed.nn.quantization import is_quantized  # noqa: E402
from nestfed.testing.local_grid import LocalGrid  # noqa: E402

MIB = 2**20


def fake_measure(cls, model, *args, **kw):
    """bytes(r) = W - 1 + 2 r MiB, W = 100 MiB in float32 and 40 MiB in nf4."""
    quantised = any(is_quantized(m) for m in model.modules())
    return Footprint(weights=(40 if quantised else 100) * MIB, per_rank=MIB // 16, saved_at_1=0, saved_slope=MIB)


#: 56 MiB: nf4 at rank 8 (55); 108 MiB: float32 at rank 4 (107)
TIERS = (
    OVERRIDES[:1]
    + (
        "lora.ranks=[8]",
        "population.memory_mib={56=0.4,108=0.6}",
        "population.rank_choices=[2,4,8]",
        'population.precisions=["none","nf4"]',
        "train.client_cache=off",
    )
    + OVERRIDES[2:]
)


@pytest.mark.slow
def test_each_node_trains_on_its_partitions_tier(tmp_path, keep_threads, monkeypatch):
    monkeypatch.setattr(Footprint, "measure", classmethod(fake_measure))
    emb = embedded_run(tmp_path / "embedded", TIERS)
    expected = json.loads((emb / "summary.json").read_text())["client_precisions"]
    assert sorted(expected.values()) == ["nf4", "none", "none"]
    nodes = {101: {"partition-id": 0}, 102: {"partition-id": 1}, 103: {"partition-id": 2}}
    rc = {
        "experiment": str(TINY),
        "overrides": ";".join(TIERS),
        "run-dir": str(tmp_path / "flower"),
        "round-timeout-s": 5.0,
        "poll-interval-s": 0.01,
    }
    summary = run_on_grid(LocalGrid(CA.app, nodes), rc)
    first = json.loads((tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()[0])
    assert {c: n["precision"] for c, n in first["nodes"].items()} == expected
    assert summary["client_precisions"] == expected
    assert_same_adapter(emb, tmp_path / "flower")
    text = config.dumps_toml(methods.load_config(TINY, list(TIERS)))  # what the server sends its nodes
    for cid, q in expected.items():  # the node's trainer runs its partition on its tier's backbone
        nc = CA.node_client(text, {"partition-id": int(cid), "client-cache": "off"})
        modules = lora_modules(nc.trainer.model_of(int(cid))).values()
        assert all(is_quantized(m.base_layer) == (q == "nf4") for m in modules)
        assert all(m.lora_A.weight.dtype == torch.float32 for m in modules)
