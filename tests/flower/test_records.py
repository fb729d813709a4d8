"""nestfed payloads and configs <-> Flower records: bit-exact round trips, heterogeneous shapes."""

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402

from nestfed.federation.aggregation import truncate_rank  # noqa: E402
from nestfed.federation.messages import Reply  # noqa: E402
from nestfed.flower.records import (  # noqa: E402
    JSON_KEY,
    array_to_tensor,
    arrays_to_record,
    config_to_record,
    content_to_reply,
    record_to_arrays,
    record_to_config,
    reply_to_content,
    tensor_to_array,
)


def adapter(rank, shapes=(("q_proj", 16, 8), ("v_proj", 4, 8)), dtype=torch.float32):
    g = torch.Generator().manual_seed(rank)
    out = {}
    for name, o, i in shapes:
        key = f"base_model.model.model.layers.0.self_attn.{name}"
        out[f"{key}.lora_A.weight"] = torch.randn(rank, i, generator=g).to(dtype)
        out[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=g).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_tensor_round_trip_is_bit_exact(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    back = array_to_tensor(tensor_to_array(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    back += 1  # writable, owns its memory
    assert not torch.equal(back, t)


def test_special_values_and_empty_and_non_contiguous_tensors_survive():
    t = torch.tensor([[float("nan"), float("inf")], [-float("inf"), -0.0]])
    back = array_to_tensor(tensor_to_array(t))
    assert torch.equal(torch.isnan(back), torch.isnan(t)) and back[0, 1] == float("inf")
    assert torch.signbit(back[1, 1])
    assert array_to_tensor(tensor_to_array(torch.zeros(0, 7))).shape == (0, 7)
    nc = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(array_to_tensor(tensor_to_array(nc)), nc)


def test_heterogeneous_ranks_each_node_its_own_shapes():
    full = adapter(8)
    per_node = {node: truncate_rank(full, r) for node, r in ((11, 2), (12, 4), (13, 8))}
    for arrays in per_node.values():
        rec = arrays_to_record(arrays)
        assert list(rec) == list(arrays)  # keys and order kept
        back = record_to_arrays(rec)
        for k, v in arrays.items():
            assert back[k].shape == v.shape and torch.equal(back[k], v)
    assert record_to_arrays(arrays_to_record(per_node[11]))[next(iter(full))].shape[0] == 2


def test_arrays_survive_a_message_serialisation():
    arrays = adapter(4, dtype=torch.bfloat16)
    rec = arrays_to_record(arrays)
    content = RecordDict({"arrays": rec, "config": config_to_record({"rank": 4})})
    inflated = RecordDict.inflate(content.deflate(), children={k: v for k, v in content.children.items()})
    back = record_to_arrays(inflated.array_records["arrays"])
    assert all(torch.equal(back[k], arrays[k]) for k in arrays)
    assert isinstance(inflated.array_records["arrays"], ArrayRecord)


def test_config_round_trip_keeps_types_and_falls_back_to_json():
    cfg = {
        "rank": 4,
        "scaling": 2.0,
        "objective": "nested",
        "train": "AB",
        "round": 3,
        "seed": 0,
        "subranks": [2, 4],
        "flag": True,
        "blob": b"\x00\x01",
        "weights": [0.5, 0.25],
        "empty": [],
        "none": None,
        "nested": {"a": [1, 2]},
        "mixed": [1, "x"],
        "tuple": (1, 2),
    }
    rec = config_to_record(cfg)
    assert isinstance(rec, ConfigRecord) and JSON_KEY in rec and "rank" in rec
    back = record_to_config(rec)
    expected = dict(cfg, tuple=[1, 2])
    assert back == expected
    assert type(back["rank"]) is int and type(back["scaling"]) is float and type(back["flag"]) is bool
    assert record_to_config(config_to_record({"rank": 2})) == {"rank": 2}
    with pytest.raises(ValueError):
        config_to_record({JSON_KEY: 1})


def test_reply_round_trip_and_bad_num_examples_survive_to_validation():
    reply = Reply(adapter(2), 17, {"train_loss": 1.5, "rank": 2.0})
    content = reply_to_content(reply)
    back = content_to_reply(content)
    assert back.num_examples == 17 and isinstance(back.num_examples, int)
    assert back.metrics == {"train_loss": 1.5, "rank": 2.0}
    assert all(torch.equal(back.arrays[k], reply.arrays[k]) for k in reply.arrays)
    with pytest.raises(KeyError):
        content_to_reply(RecordDict({"arrays": ArrayRecord()}))


def test_a_reply_message_carries_the_records():
    from nestfed.testing.local_grid import LocalGrid  # sets the task identity messages need  # noqa: F401

    LocalGrid(None, {})
    msg = Message(RecordDict({"config": config_to_record({"rank": 2})}), dst_node_id=5, message_type="train")
    msg.metadata.__dict__["_message_id"] = msg.object_id
    reply = Message(reply_to_content(Reply(adapter(2), 3)), reply_to=msg)
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert content_to_reply(reply.content).num_examples == 3


def test_run_config_values_survive_flwrs_command_line_parser():
    """``flwr run --run-config`` reads a quoted value up to the next quote of its kind: overrides
    holding double quotes travel in single quotes; a string with both kinds is refused."""
    from flwr.common.config import parse_config_args

    from nestfed.testing.flower_deployment import toml_value

    rc = {
        "overrides": 'train.threads=1;lora.target_modules=["q_proj","v_proj"]',
        "run-dir": "/tmp/a b",
        "evaluate": True,
        "round-timeout-s": 2.5,
        "min-clients": 2,
    }
    line = " ".join(f"{k}={toml_value(v)}" for k, v in rc.items())
    assert parse_config_args([line]) == rc
    with pytest.raises(ValueError, match="both"):
        toml_value("""a'b"c""")
