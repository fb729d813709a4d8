"""The population's per-round draws through the real round loop on the tiny federation: who is online,
who drops out after sampling, and elastic ranks, for every method that accepts them; PreLort's
segments at an elastic rank by hand."""

import pytest
import torch
from tiny_federation import lines, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.errors import ConfigError
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.population import Population, read_trace
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.prelort.strategy import PreLort

EIGHT = ("data.num_clients=8", "lora.ranks=[2,2,4,4,8,8,8,8]", "federation.fraction=0.5", "federation.rounds=2")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def clients(ranks):
    return [ClientInfo(c, r, 4) for c, r in enumerate(ranks)]


def test_online_clients_are_a_seeded_draw_and_the_sample_comes_from_them():
    pop = Population(availability=0.5, seed=3)
    everyone = clients([2] * 1000)
    up = pop.online(1, everyone)
    assert 430 < len(up) < 570 and pop.online(1, everyone) == up and pop.online(2, everyone) != up
    assert Population().online(1, everyone) == everyone  # availability 1: everyone, nothing drawn


def test_dropouts_get_no_instruction_and_the_round_aggregates_the_others(tmp_path):
    cfg = tiny_config(*EIGHT, "population.dropout=0.5")
    trained = []

    def record(trainer):
        real = trainer.fit

        def fit(cid, ins):
            trained.append((ins.config["round"], cid))
            return real(cid, ins)

        trainer.fit = fit
        return trainer

    _, loop, _ = tiny_run(tmp_path, cfg, prep=tiny_prepared(cfg, (4,) * 8), wrap=record)
    total = 0
    for ln in lines(tmp_path)[1:]:
        gone = {c for c, why in ln["dropped"].items() if "population.dropout = 0.5" in why}
        total += len(gone)
        assert set(ln["sampled"]) >= {int(c) for c in gone} and len(ln["sampled"]) == 4
        assert {c for r, c in trained if r == ln["round"]} == {c for c in ln["sampled"] if str(c) not in gone}
        assert all(ln["clients"][c]["status"] == "dropped" and ln["clients"][c]["bytes_down"] == 0 for c in gone)
        assert ln["aggregated"] is True
    assert total == 3  # round 2 of federation.seed 1 loses clients 0, 2 and 5


def test_a_round_most_of_whose_clients_dropped_says_so(tmp_path):
    cfg = tiny_config(*EIGHT, "population.dropout=0.9", "federation.rounds=1", "federation.seed=5")
    _, loop, _ = tiny_run(tmp_path, cfg, prep=tiny_prepared(cfg, (4,) * 8))
    ln = lines(tmp_path)[1]
    assert 2 * len(ln["dropped"]) > len(ln["sampled"])
    assert any(
        f"round 1: WARNING {len(ln['dropped'])} of the {len(ln['sampled'])} sampled clients dropped out" in m
        for m in loop.log
    )


def test_elastic_uniform_ranks_stay_in_the_federations_ranks_up_to_each_clients_own():
    pop = Population(elastic="uniform", ranks=[2, 4, 8], seed=0)
    cs = clients([2, 4, 8, 8, 8, 8])
    drawn = [c.round_rank or c.rank for r in range(1, 20) for c in pop.this_round(r, cs)]
    own = [c.rank for _ in range(1, 20) for c in cs]
    assert all(d <= o and d in (2, 4, 8) for d, o in zip(drawn, own))
    assert {d for d, o in zip(drawn, own) if o == 8} == {2, 4, 8}  # every lower rank occurs


def test_the_trace_is_read_with_one_line_naming_the_file_and_line(tmp_path):
    ok = tmp_path / "t.csv"
    ok.write_text("round,client,rank\n1,0,2\n2,1,4\n")
    own = {0: 8, 1: 4, 2: 2}
    assert read_trace(ok, own) == {(1, 0): 2, (2, 1): 4}
    for body, message in [
        ("round,client\n1,0\n", "missing column\\(s\\) rank"),
        ("round,client,rank\n1,0,x\n", "t.csv:2: round, client and rank must be integers"),
        ("round,client,rank\n1,5,2\n", "t.csv:2: client 5 is not in the federation"),
        ("round,client,rank\n1,1,8\n", "t.csv:2: rank 8 is above client 1's own rank 4"),
        ("round,client,rank\n1,0,3\n", "t.csv:2: rank 3 is not one of the federation's ranks \\[2, 4, 8\\]"),
        ("round,client,rank\n1,0,2\n1,0,2\n", "t.csv:3: round 1, client 0 is given twice"),
    ]:
        ok.write_text(body)
        with pytest.raises(ConfigError, match=message):
            read_trace(ok, own)


def test_a_trace_of_memory_budgets_gives_the_largest_rank_that_fits_or_sits_the_round_out(tmp_path):
    trace = tmp_path / "budgets.csv"
    trace.write_text("round,client,memory_mib\n1,0,3\n1,1,1\n2,0,100\n")
    mib = 2**20
    got = read_trace(trace, {0: 8, 1: 8, 2: 2}, {2: 1 * mib, 8: 4 * mib}.__getitem__)
    assert got == {(1, 0): 2, (1, 1): 2, (2, 0): 8}
    got = read_trace(trace, {0: 8, 1: 8, 2: 2}, {2: 2 * mib, 8: 4 * mib}.__getitem__)
    assert got[(1, 1)] == 0  # 1 MiB holds no rank: client 1 sits round 1 out
    pop = Population(elastic="trace", ranks=[2, 8], trace=got)
    sampled = [ClientInfo(0, 8, 4), ClientInfo(1, 8, 4)]
    assert "holds no rank" in pop.dropouts(1, sampled)[1] and 0 not in pop.dropouts(1, sampled)
    assert [c.round_rank for c in pop.this_round(1, sampled)] == [2, 0]
    with pytest.raises(ConfigError, match="memory budgets become ranks through the backbone's footprint"):
        read_trace(trace, {0: 8, 1: 8, 2: 2})


def test_prelort_aggregates_an_elastic_reply_into_the_segments_it_trained():
    """R_fed = {2, 4}; client 1 (rank 4) trained at rank 2 this round, so segment [2, 4) has no member
    and keeps its values; segment [0, 2) is the n_k mean update of both (by hand)."""
    key_a, key_b = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"
    st = PreLort(LoraSettings(r_max=4, lora_alpha=4.0))
    state = st.initialize({"m": (1, 2)}, [ClientInfo(0, 2, 1), ClientInfo(1, 4, 1)])
    state.arrays[key_a] = torch.ones(4, 2)
    ins = st.configure(1, state, [ClientInfo(0, 2, 1), ClientInfo(1, 4, 1, round_rank=2)])
    assert ins[1].config["rank"] == 2 and ins[1].config["subranks"] == [2] and ins[1].arrays[key_a].shape == (2, 2)
    r0 = Reply({key_a: torch.full((2, 2), 3.0), key_b: torch.zeros(1, 2)}, 1)
    r1 = Reply({key_a: torch.full((2, 2), 5.0), key_b: torch.zeros(1, 2)}, 1)
    new = st.aggregate(1, state, {0: r0, 1: r1})
    assert torch.equal(new.arrays[key_a], torch.tensor([[4.0, 4.0], [4.0, 4.0], [1.0, 1.0], [1.0, 1.0]]))


ELASTIC = methods.declaring(methods.Capability.ELASTIC_RANKS)


@pytest.mark.parametrize("name", ELASTIC)
def test_every_method_that_serves_elastic_ranks_trains_below_its_clients_ranks(tmp_path, name):
    """Two rounds at elastic ranks: every reply is accepted, every client trains at most its own rank,
    what a client keeps is never above its own rank (local-only's adapter: exactly it; FedSA-LoRA's B
    may hold only the columns trained so far, the rest being B's zero start), and every client's
    final evaluation ran (the loop evaluates all of them after the last round)."""
    cfg = tiny_config(f"strategy.name={name}", "population.elastic=uniform", "federation.rounds=2")
    _, loop, mr = tiny_run(tmp_path, cfg)
    own = {c.cid: c.rank for c in mr.clients}
    below = 0
    for ln in lines(tmp_path)[1:]:
        for cid, info in ln["clients"].items():
            assert info["status"] == "accepted", (cid, info)
            assert info["metrics"]["rank"] <= own[int(cid)]  # the rank it trained
            below += info["metrics"]["rank"] < own[int(cid)]
    assert below  # some client trained below its own rank
    for cid, groups in mr.trainer.client_state.items():
        for arrays in groups.values():
            for k, t in arrays.items():
                if k.endswith("lora_B.weight"):
                    assert t.shape[1] <= own[cid] and (name != "local_only" or t.shape[1] == own[cid]), (cid, k)
    assert sorted(lines(tmp_path)[-1]["eval"], key=int) == [str(c) for c in own]


def test_hetlora_never_prunes_a_clients_own_rank_in_a_round_at_an_elastic_rank():
    """Client 1 (rank 8) trains at rank 4: no pruning is asked for even with a tail norm measured at
    rank 4 before, and a reply below 4 leaves its own rank 8; at its own rank it prunes as before."""
    from nestfed.methods.hetlora import HetLoRAOptions
    from nestfed.methods.hetlora.strategy import HetLoRA

    key_a, key_b = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"
    st = HetLoRA(LoraSettings(r_max=8, lora_alpha=8.0), HetLoRAOptions())
    state = st.initialize({"m": (2, 2)}, [ClientInfo(0, 8, 1), ClientInfo(1, 8, 1)])
    state.meta["tail_norms"], state.meta["tail_ranks"] = {"1": 0.5, "0": 0.5}, {"1": 4, "0": 8}
    ins = st.configure(1, state, [ClientInfo(0, 8, 1), ClientInfo(1, 8, 1, round_rank=4)])
    assert ins[1].config["rank"] == 4 and ins[1].config["hetlora_prev_tail"] == -1.0
    assert ins[0].config["hetlora_prev_tail"] == 0.5
    reply = {
        c: Reply({key_a: torch.ones(r, 2), key_b: torch.ones(2, r)}, 1, {"tail_norm": 0.1}) for c, r in ((0, 7), (1, 3))
    }
    new = st.aggregate(1, state, reply)
    assert new.meta["ranks"] == {"0": 7, "1": 8}  # client 0 pruned at its own rank; client 1 keeps 8
