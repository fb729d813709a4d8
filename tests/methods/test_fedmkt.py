"""FedMKT's rounds around a fake server learner: what travels, what stays, in which order."""

import pytest
import torch

from nestfed.federation.messages import ClientInfo, Reply
from nestfed.methods.compressed.groups import GroupedTrainer
from nestfed.methods.fedmkt.distillation import CE, INDICES, VALUES
from nestfed.methods.fedmkt.strategy import FedMKT

A, B = "base_model.model.l.lora_A.weight", "base_model.model.l.lora_B.weight"


def know(v):
    return {
        VALUES: torch.full((2, 3, 1), float(v), dtype=torch.float16),
        INDICES: torch.full((2, 3, 1), v, dtype=torch.int32),
        CE: torch.full((2,), float(v)),
    }


class FakeServer:
    scaling = 2.0

    def __init__(self):
        self.calls = []

    def knowledge(self, adapter):
        return know(int(adapter[B].sum()))

    def distill(self, adapter, teachers, rnd):
        self.calls.append([int(t[CE][0]) for t in teachers])
        return {A: adapter[A], B: adapter[B] + 1}, {"server_teacher_share": 1.0}


def test_only_knowledge_travels_and_the_server_distils_from_clients_in_id_order():
    server = FakeServer()
    st = FedMKT(server, {A: torch.ones(1, 2), B: torch.zeros(2, 1)}, {0: 0, 1: 1, 2: 1}, [0.3, 0.7])
    clients = [ClientInfo(c, 0, 4) for c in range(3)]
    state = st.initialize(None, clients)
    ins = st.configure(1, state, clients)
    assert set(ins[0].arrays) == {VALUES, INDICES, CE}  # the server's LoRA never travels
    assert ins[2].config["ratio"] == 0.7 and ins[2].expect[VALUES] == (2, 3, 1)
    replies = {2: Reply(know(7), 4), 0: Reply(know(5), 4), 1: Reply(know(6), 4)}
    new = st.aggregate(1, state, replies)
    assert server.calls == [[5, 6, 7]]
    assert torch.equal(new.arrays[B], torch.ones(2, 1))  # the server's adapter moved
    assert int(new.arrays[CE][0]) == 2  # the new knowledge is the trained server's (sum of B)
    assert st.deploy(new, 1) == ({}, 1.0)  # a client's model stays on the client
    arrays, s = st.deploy(new, None)
    assert set(arrays) == {A, B} and s == 2.0
    with pytest.raises(ValueError, match="client 5"):
        st.initialize(None, clients + [ClientInfo(5, 0, 1)])


class Recorder:
    def __init__(self, name):
        self.name, self.seen = name, []

    def fit(self, cid, ins):
        self.seen.append(cid)
        return Reply({}, 1)

    def evaluate(self, cid, arrays, scaling):
        return {"loss": float(len(arrays)), "who": self.name}


def test_grouped_trainer_routes_by_client_and_uses_initial_arrays_for_empty_payloads():
    t0, t1 = Recorder("g0"), Recorder("g1")
    gt = GroupedTrainer({0: t0, 1: t1}, {0: 0, 1: 1, 2: 1}, {1: {"x": torch.zeros(1), "y": torch.zeros(1)}})
    gt.fit(2, None)
    gt.fit(0, None)
    assert t0.seen == [0] and t1.seen == [2]
    assert gt.evaluate(1, {}, 1.0) == {"loss": 2.0, "who": "g1"}  # the group's initial arrays
    assert gt.evaluate(1, {"z": torch.zeros(1)}, 1.0)["loss"] == 1.0
    with pytest.raises(KeyError, match="client 9"):
        gt.fit(9, None)


def test_grouped_trainer_merges_and_splits_the_clients_kept_state():
    class Holder:
        def __init__(self, state):
            self.client_state = state

    x, y, z = ({"own": {"k": torch.full((1,), float(v))}} for v in (1, 2, 3))
    g0, g1 = Holder({0: x}), Holder({2: z})
    gt = GroupedTrainer({0: g0, 1: g1}, {0: 0, 1: 1, 2: 1})
    assert gt.client_state == {0: x, 2: z}
    gt.client_state = {0: x, 1: y, 2: z}  # what a resumed checkpoint hands back
    assert g0.client_state == {0: x} and g1.client_state == {1: y, 2: z}
