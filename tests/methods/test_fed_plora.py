"""Fed-PLoRA (Zhang, Hu and Xu, ICLR 2026, arXiv 2602.16936): R parallel rank-1 modules, each
client trains r_k of them and folds the rest into its frozen weights, each module averaged over the
clients that trained it. Hand-computed payloads and aggregates, the selection's determinism and
uniformity, the fold against its two other forms (the modules kept in the LoRA with their
gradients masked; the modules added into the dense weight), the degenerate case (every client at
r_max is FedAvg bit for bit), the options, refusals and an end-to-end tiny run."""

import copy
import dataclasses

import pytest
import torch
from tiny_federation import lines, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import ConfigError, PrivacyConfig, RobustConfig
from nestfed.config.capabilities import Capability
from nestfed.experiments.run import run_method
from nestfed.federation.client import ClientTrainer
from nestfed.federation.hooks import ClientHooks
from nestfed.federation.messages import ClientInfo, Instruction, Reply
from nestfed.federation.robust import BlockRule
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fed_plora import FedPLoRAOptions
from nestfed.methods.fed_plora.strategy import (
    MODULES,
    FedPLoRA,
    ModuleMean,
    fold_payload,
    module_groups,
    selection,
)
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.keys import merged_key
from nestfed.nn.lora import lora_modules

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
MA_KEY, MB_KEY = merged_key("m", "A"), merged_key("m", "B")
T = torch.tensor


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# -- the selection ---------------------------------------------------------------------------------


def test_the_selection_is_a_deterministic_sorted_draw_of_rank_modules():
    got = selection(1, 3, 7, 8, 3)
    assert got == selection(1, 3, 7, 8, 3)  # the same seed, round and client: the same modules (resume)
    assert got == sorted(set(got)) and len(got) == 3 and all(0 <= j < 8 for j in got)
    draws = {tuple(selection(1, rnd, 7, 8, 3)) for rnd in range(1, 21)}
    assert len(draws) > 10  # fresh every round (56 possible sets)
    assert len({tuple(selection(1, 3, c, 8, 3)) for c in range(20)}) > 10  # and per client
    assert any(selection(2, rnd, 7, 8, 3) != selection(1, rnd, 7, 8, 3) for rnd in range(1, 6))  # and per seed
    assert selection(1, 3, 7, 8, 8) == list(range(8))  # r_k = R: every module
    assert selection(1, 3, 7, 8, 3, "prefix") == [0, 1, 2]
    for bad in (0, 9):
        with pytest.raises(ValueError, match=rf"^rank {bad} is not an integer in \[1, r_max = 8\]$"):
            selection(1, 3, 7, 8, bad)
    with pytest.raises(ValueError, match="unknown selection rule"):
        selection(1, 3, 7, 8, 3, "first")


def test_every_module_is_drawn_with_probability_rank_over_r():
    counts = torch.zeros(8)
    n = 4000
    for rnd in range(1, n + 1):
        counts[selection(0, rnd, 3, 8, 3)] += 1
    # 3/8 each; the binomial's standard deviation over 4000 draws is 0.0077
    assert float((counts / n - 3 / 8).abs().max()) < 0.03


# -- the fold and the aggregate, by hand -----------------------------------------------------------

A0 = T([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
B0 = T([[1.0, 0.0, 2.0], [0.0, 1.0, 3.0]])


def test_the_payload_holds_the_selected_modules_and_the_rest_folded_by_hand():
    out = fold_payload({A_KEY: A0, B_KEY: B0}, [0, 2], 2.0)
    assert torch.equal(out[A_KEY], T([[1.0, 2.0], [5.0, 6.0]])) and torch.equal(out[B_KEY], T([[1.0, 2.0], [0.0, 3.0]]))
    assert torch.equal(out[MA_KEY], T([[3.0, 4.0]])) and torch.equal(out[MB_KEY], T([[0.0], [2.0]]))  # s B[:, 1]
    # W0 + merged_B merged_A + s B_K A_K is the global W0 + s B A
    torch.testing.assert_close(out[MB_KEY] @ out[MA_KEY] + 2.0 * out[B_KEY] @ out[A_KEY], 2.0 * B0 @ A0)
    every = fold_payload({A_KEY: A0, B_KEY: B0}, [0, 1, 2], 2.0)
    assert set(every) == {A_KEY, B_KEY} and torch.equal(every[A_KEY], A0) and torch.equal(every[B_KEY], B0)


def test_module_groups_by_hand():
    assert module_groups([[0, 2], [2]], 3) == [([0], [0], [[0]]), ([0, 1], [2], [[1], [0]])]
    assert module_groups([[0, 1], [0, 1]], 2) == [([0, 1], [0, 1], [[0, 1], [0, 1]])]
    assert module_groups([[1, 3], [0, 1, 3]], 4) == [([1], [0], [[0]]), ([0, 1], [1, 3], [[0, 1], [1, 2]])]


@pytest.mark.parametrize(
    "weights,a2,b2",
    # module 2: clients 1 (n 1, its row 0) and 2 (n 3, its row 1); uniform: the plain mean
    [([1.0, 3.0], [25.0, 35.0], [4.75, 6.5]), ([1.0, 1.0], [20.0, 30.0], [3.5, 5.0])],
)
def test_each_module_is_the_mean_over_the_clients_that_trained_it_by_hand(weights, a2, b2):
    """R = 3. Client 1 trained module 2: A1 = [[10, 20]], B1 = [[1], [2]]. Client 2 trained modules
    0 and 2: A2 = [[4, 8], [30, 40]], B2 = [[5, 6], [7, 8]]. Module 0: client 2 alone; module 1:
    nobody (keeps its values); module 2: both."""
    sels = [[2], [0, 2]]
    A1, B1 = T([[10.0, 20.0]]), T([[1.0], [2.0]])
    A2, B2 = T([[4.0, 8.0], [30.0, 40.0]]), T([[5.0, 6.0], [7.0, 8.0]])
    mean = ModuleMean(sels, weights, 3)
    A, B = mean(A0, [A1, A2], 0), mean(B0, [B1, B2], 1)
    torch.testing.assert_close(A, T([[4.0, 8.0], [3.0, 4.0], a2]))
    torch.testing.assert_close(B, T([[5.0, 0.0, b2[0]], [7.0, 1.0, b2[1]]]))
    assert torch.equal(A0, T([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])), "the mean must not mutate the global"


def test_the_mean_equals_a_naive_loop_over_modules_and_clients():
    """Seven clients of random ranks and random selections at R = 8 (several groups: the mixing
    matrix), against the definition written as loops, for A (dim 0) and B (dim 1)."""
    g = torch.Generator().manual_seed(4)
    ranks = [1, 2, 3, 3, 5, 6, 8]
    sels = [selection(9, 2, c, 8, r) for c, r in enumerate(ranks)]
    weights = [float(w) for w in torch.randint(1, 9, (7,), generator=g)]
    for dim, shape in ((0, (8, 5)), (1, (4, 8))):
        glob = torch.randn(shape, generator=g)
        reps = [torch.randn(*(r if d == dim else n for d, n in enumerate(shape)), generator=g) for r in ranks]
        expected = glob.clone()
        for j in range(8):
            num, den = 0.0, 0.0
            for k, sel in enumerate(sels):
                if j in sel:
                    num = num + weights[k] * reps[k].select(dim, sel.index(j))
                    den += weights[k]
            if den:
                expected.select(dim, j).copy_(num / den)
        mean = ModuleMean(sels, weights, 8)
        assert mean.mixing is not None
        torch.testing.assert_close(mean(glob, reps, dim), expected)


def hand_strategy(weighting="examples"):
    """The strategy of the hand-computed round (s = 2), its selections fixed to client 1: [2],
    client 2: [0, 2], and its state (A0, B0)."""
    st = FedPLoRA(LoraSettings(r_max=3, lora_alpha=6.0), FedPLoRAOptions(weighting=weighting))
    st.modules = lambda rnd, cid, rank: {1: [2], 2: [0, 2]}[cid]
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]
    state = st.initialize({"m": (2, 2)}, clients)
    state.arrays[A_KEY], state.arrays[B_KEY] = A0.clone(), B0.clone()
    return st, state, clients


def test_one_round_of_the_strategy_by_hand():
    st, state, clients = hand_strategy()
    ins = st.configure(1, state, clients)
    assert ins[1].config[MODULES] == [2] and ins[2].config[MODULES] == [0, 2]
    assert ins[1].config["scaling"] == ins[2].config["scaling"] == 2.0  # the global s for every rank
    assert ins[1].expect == {A_KEY: (1, 2), B_KEY: (2, 1)}
    assert torch.equal(ins[1].arrays[A_KEY], T([[5.0, 6.0]])) and torch.equal(ins[1].arrays[MA_KEY], A0[:2])
    assert torch.equal(ins[1].arrays[MB_KEY], 2.0 * B0[:, :2])
    replies = {
        1: Reply({A_KEY: T([[10.0, 20.0]]), B_KEY: T([[1.0], [2.0]])}, 1),
        2: Reply({A_KEY: T([[4.0, 8.0], [30.0, 40.0]]), B_KEY: T([[5.0, 6.0], [7.0, 8.0]])}, 3),
    }
    new = st.aggregate(1, state, replies)
    torch.testing.assert_close(new.arrays[A_KEY], T([[4.0, 8.0], [3.0, 4.0], [25.0, 35.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[5.0, 0.0, 4.75], [7.0, 1.0, 6.5]]))
    # the mean rule over the module blocks is the same aggregate (docs/trust.md), under both weightings
    for weighting in ("examples", "uniform"):
        st, state, _ = hand_strategy(weighting)
        rule = BlockRule(RobustConfig(rule="mean"), PrivacyConfig())
        rule.start_round(1)
        own, blocks = st.aggregate(1, state, replies), st.robust_aggregate(1, state, replies, rule)
        for k in own.arrays:
            torch.testing.assert_close(blocks.arrays[k], own.arrays[k])
        assert sorted(rule.notes) == ["modules 0", "modules 2"]  # module 1 has no member


def test_central_dps_denominator_counts_the_expected_holders_of_a_module():
    """Ranks 2, 4, 8 at R = 8: under ``random`` client k holds a module with probability r_k / 8, so
    14 / 8 clients hold it in expectation; under ``prefix`` module 3 is held by the ranks 4 and 8."""
    clients = [ClientInfo(0, 2, 1), ClientInfo(1, 4, 1), ClientInfo(2, 8, 1)]
    for rule, expected in (("random", [1.75, 1.75]), ("prefix", [3.0, 2.0])):
        st = FedPLoRA(LoraSettings(r_max=8, lora_alpha=8.0), FedPLoRAOptions(selection=rule))
        state = st.initialize({"m": (2, 2)}, clients)
        assert [st.expected_holders(state, j) for j in (1, 3)] == expected


def test_module_blocks_split_where_the_federation_holds_modules_differently():
    """``prefix`` selection, R = 4, federation ranks 1, 2, 3; the rank-2 client sits the round out.
    The replies of ranks 1 and 3 make modules 1 and 2 one group (client 3 alone), but the federation
    holds module 1 twice (ranks 2, 3) and module 2 once: two blocks, whose central-DP denominators
    (sampling rate 1) are those holder counts; module 3 has no member and no block."""
    st = FedPLoRA(LoraSettings(r_max=4, lora_alpha=4.0), FedPLoRAOptions(selection="prefix"))
    clients = [ClientInfo(1, 1, 2), ClientInfo(2, 2, 2), ClientInfo(3, 3, 1)]
    state = st.initialize({"m": (2, 3)}, clients)
    g = torch.Generator().manual_seed(0)
    replies = {
        c: Reply({A_KEY: torch.randn(r, 3, generator=g), B_KEY: torch.randn(2, r, generator=g)}, n)
        for c, r, n in ((1, 1, 2), (3, 3, 1))
    }
    mean = BlockRule(RobustConfig(rule="mean"), PrivacyConfig())
    mean.start_round(1)
    own, blocks = st.aggregate(1, state, replies), st.robust_aggregate(1, state, replies, mean)
    for k in own.arrays:
        torch.testing.assert_close(blocks.arrays[k], own.arrays[k])
    assert torch.equal(own.arrays[A_KEY][3], state.arrays[A_KEY][3])  # module 3: nobody trained it
    dp = BlockRule(RobustConfig(), PrivacyConfig(mode="central", clip_norm=1.0, noise_multiplier=0.0))
    dp.start_round(1)
    st.robust_aggregate(1, state, replies, dp)
    assert {name: note["denominator"] for name, note in dp.notes.items()} == {
        "modules 0": 3.0,
        "modules 1": 2.0,
        "modules 2": 1.0,
    }


def test_the_server_recomputes_the_modules_it_sent_also_at_an_elastic_rank():
    st = FedPLoRA(LoraSettings(r_max=8, lora_alpha=8.0, seed=5))
    clients = [ClientInfo(0, 2, 1), ClientInfo(1, 8, 1, round_rank=4), ClientInfo(2, 8, 1)]
    state = st.initialize({"m": (3, 2)}, clients)
    ins = st.configure(4, state, clients)
    assert [len(ins[c].config[MODULES]) for c in range(3)] == [2, 4, 8]
    assert ins[1].arrays[A_KEY].shape == (4, 2) and ins[1].arrays[MA_KEY].shape == (4, 2)
    assert MA_KEY not in ins[2].arrays  # r_k = R: nothing folded
    replies = {c: Reply({k: torch.randn(s) for k, s in ins[c].expect.items()}, 1) for c in ins}
    assert st.selections(4, [0, 1, 2], replies) == [ins[c].config[MODULES] for c in range(3)]


# -- the degenerate case: every client trains every module ---------------------------------------


@pytest.mark.parametrize("rule", ["random", "prefix"])
def test_every_client_at_r_max_is_fedavg_bit_for_bit(rule):
    torch.manual_seed(3)
    clients = [ClientInfo(i, 4, n) for i, n in enumerate([5, 1, 7])]
    shapes = {"a": (6, 5), "b": (3, 6)}
    settings = LoraSettings(r_max=4, lora_alpha=8.0)
    ref, st = FedAvg(settings), FedPLoRA(settings, FedPLoRAOptions(selection=rule))
    state = ref.initialize(shapes, clients)
    state.arrays = {k: torch.randn_like(v) for k, v in state.arrays.items()}
    sent, ours = ref.configure(1, state, clients), st.configure(1, state, clients)
    for c in sent:
        assert same_arrays(ours[c].arrays, sent[c].arrays) and ours[c].expect == sent[c].expect
    reps = {
        c.cid: Reply({k: v + torch.randn_like(v) for k, v in state.arrays.items()}, c.num_examples) for c in clients
    }
    assert same_arrays(st.aggregate(1, state, reps).arrays, ref.aggregate(1, state, reps).arrays)


@pytest.mark.slow
def test_equal_ranks_run_fedavg_bit_for_bit_end_to_end(tmp_path):
    cfg = tiny_config("lora.ranks=[8]", "federation.rounds=2")
    prep = tiny_prepared(cfg)
    ref, _, _ = tiny_run(tmp_path / "fedavg", methods.with_method(cfg, "fedavg"), prep)
    ours, _, _ = tiny_run(tmp_path / "fed_plora", methods.with_method(cfg, "fed_plora"), prep)
    assert same_arrays(ours.arrays, ref.arrays)


# -- the fold against the freeze and the dense merge ------------------------------------------------


def folded_client():
    """The tiny federation (ranks 2, 4, 8; s = 2) with a random global adapter (B != 0), and client
    1's round-1 instruction (rank 4: four modules trained, four folded)."""
    cfg = tiny_config("strategy.name=fed_plora")
    prep = tiny_prepared(cfg)
    mr = methods.get("fed_plora").build(prep, cfg)
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    g = torch.Generator().manual_seed(0)
    state.arrays = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in state.arrays.items()}
    ins = mr.strategy.configure(1, state, mr.clients)[1]
    return cfg, prep, mr, state, ins


def logits_and_grads(model, arrays, scale, ids):
    apply_arrays(model, arrays, scale)
    for m in lora_modules(model).values():
        m.lora_A.weight.requires_grad_(True)
        m.lora_B.weight.requires_grad_(True)
    logits = lm_logits(model, ids)
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: (m.lora_A.weight.grad.clone(), m.lora_B.weight.grad.clone()) for n, m in lora_modules(model).items()}
    return logits.detach(), grads


def test_the_fold_is_the_global_model_with_the_unselected_modules_frozen():
    """Zero initialisation noise: the folded client computes the global model's logits, and the
    gradient of its trained modules is the global adapter's gradient of those modules (the fold is
    the freeze); the unselected modules' gradients are not zero, so freezing them is a choice."""
    _, prep, mr, state, ins = folded_client()
    K = ins.config[MODULES]
    rest = [j for j in range(8) if j not in K]
    model, s = prep.backbone.model, ins.config["scaling"]
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    full, g_full = logits_and_grads(model, state.arrays, s, ids)
    fold, g_fold = logits_and_grads(model, ins.arrays, s, ids)
    torch.testing.assert_close(fold, full, rtol=1e-5, atol=1e-5)
    for name, (gA, gB) in g_full.items():
        torch.testing.assert_close(g_fold[name][0], gA[K], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g_fold[name][1], gB[:, K], rtol=1e-4, atol=1e-6)
        assert float(gA[rest].abs().max()) > 0
    # the third form: the unselected modules added into the dense frozen weight W0
    dense = copy.deepcopy(model)
    lora_only = {k: v for k, v in ins.arrays.items() if ".merged_" not in k}
    for name, m in lora_modules(dense).items():
        with torch.no_grad():
            m.base_layer.weight += ins.arrays[merged_key(name, "B")] @ ins.arrays[merged_key(name, "A")]
    apply_arrays(dense, lora_only, s)
    torch.testing.assert_close(lm_logits(dense, ids).detach(), full, rtol=1e-5, atol=1e-5)


class MaskedHooks(ClientHooks):
    """The freeze form of Select-N-Fold: the whole adapter in the LoRA, the gradients of the
    modules outside ``modules`` zeroed after every backward."""

    def __init__(self, modules):
        self.modules = modules

    def step_loss(self, ctx, batch):
        value = super().step_loss(ctx, batch)
        rest = [j for j in range(8) if j not in self.modules]
        for m in lora_modules(ctx.model).values():
            m.lora_A.weight.grad[rest] = 0
            m.lora_B.weight.grad[:, rest] = 0
        return value


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_training_with_the_fold_equals_training_with_the_gradients_masked(weight_decay):
    """Two local steps of client 1: with the fold, and with the whole adapter and a gradient mask.
    Without weight decay the trained modules agree and the masked ones never move; AdamW's decoupled
    weight decay shrinks the masked modules too (a zero gradient is still a gradient), so there the
    mask is no longer the fold (and the trained modules then see another model in the second step)."""
    cfg, prep, mr, state, ins = folded_client()
    K = ins.config[MODULES]
    train = dataclasses.replace(cfg.train, weight_decay=weight_decay)
    folded = ClientTrainer(prep.backbone.model, prep.data, train).fit(1, ins)
    whole = Instruction(dict(state.arrays), dict(ins.config), {})
    masked = ClientTrainer(prep.backbone.model, prep.data, train, MaskedHooks(K)).fit(1, whole)
    rest = [j for j in range(8) if j not in K]
    moved = 0.0
    for k, v in folded.arrays.items():
        d = 0 if k.endswith("lora_A.weight") else 1
        if weight_decay == 0.0:
            torch.testing.assert_close(masked.arrays[k].index_select(d, torch.tensor(K)), v, rtol=1e-4, atol=1e-5)
        frozen = masked.arrays[k].index_select(d, torch.tensor(rest))
        moved = max(moved, float((frozen - state.arrays[k].index_select(d, torch.tensor(rest))).abs().max()))
    assert (moved == 0.0) == (weight_decay == 0.0)
    assert folded.metrics["rank"] == 4.0 and masked.metrics["rank"] == 8.0


def test_a_zero_adapter_leaves_the_backbone_unchanged():
    """Round 1 from the initial state (B = 0): every client's folded model is the backbone."""
    cfg = tiny_config("strategy.name=fed_plora")
    prep = tiny_prepared(cfg)
    mr = methods.get("fed_plora").build(prep, cfg)
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    model = prep.backbone.model
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    apply_arrays(model, {}, 1.0)  # no adapter at all
    backbone = lm_logits(model, ids)
    for c, ins in mr.strategy.configure(1, state, mr.clients).items():
        apply_arrays(model, ins.arrays, ins.config["scaling"])
        assert torch.equal(lm_logits(model, ids), backbone), c


# -- options, refusals, an end-to-end run ------------------------------------------------------------


def test_options_and_refusals():
    assert tiny_config("strategy.name=fed_plora").section("fed_plora") == FedPLoRAOptions()
    assert tiny_config("strategy.name=fed_plora", "fed_plora.selection=prefix").section("fed_plora").selection == (
        "prefix"
    )
    with pytest.raises(ConfigError, match="selection: unknown selection 'first'"):
        tiny_config("strategy.name=fed_plora", "fed_plora.selection=first")
    with pytest.raises(ConfigError, match="weighting: unknown weighting 'n'"):
        tiny_config("strategy.name=fed_plora", "fed_plora.weighting=n")
    tiny_config("strategy.name=fed_plora", "robust.rule=median", "population.elastic=uniform")  # accepted
    m = methods.get("fed_plora")
    line = m.refusal({Capability.SECURE_AGGREGATION: "run config: secure-aggregation"})
    assert line is not None and "fed_plora cannot aggregate from secure sums alone: a client's reply" in line


def test_end_to_end_tiny_run(tmp_path):
    cfg = tiny_config("strategy.name=fed_plora")
    summary = run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3
    assert sum(v["loss"] for v in ls[-1]["eval"].values()) < sum(v["loss"] for v in ls[0]["eval"].values())
    for ln in ls[1:]:
        assert [ln["clients"][c]["metrics"]["rank"] for c in ("0", "1", "2")] == [2.0, 4.0, 8.0]
