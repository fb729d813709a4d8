"""Every aggregation rule against arrays computed by hand (one layer, out = in = 2, r_max = 2).

Client 1: rank 1, n = 1, A1 = [[1, 2]], B1 = [[1], [3]].
Client 2: rank 2, n = 3, A2 = [[3, 4], [5, 6]], B2 = [[1, 2], [3, 4]].
Global before the round: A0 = [[1, 1], [1, 1]], B0 = 0. lora_alpha = 2, r_max = 2, so s = 1.
"""

import math

import pytest
import torch

from nestfed.federation.aggregation import lowrank_norm
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.ffa_lora.strategy import FFALoRA
from nestfed.methods.flora.strategy import FLoRA
from nestfed.methods.hetlora import HetLoRAOptions
from nestfed.methods.hetlora.strategy import HetLoRA
from nestfed.methods.prelort.strategy import PreLort, segment_average, segments
from nestfed.methods.zeropad.strategy import ZeroPad
from nestfed.nn.keys import merged_key

CLASSES = {
    "fedavg": FedAvg,
    "ffa_lora": FFALoRA,
    "flora": FLoRA,
    "hetlora": HetLoRA,
    "prelort": PreLort,
    "zeropad": ZeroPad,
}


def make(name, settings, **options):
    """The strategy ``name`` with its options dataclass (HetLoRA's), as its home builds it."""
    if name == "hetlora":
        return HetLoRA(settings, HetLoRAOptions(**options))
    return CLASSES[name](settings)


A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
T = torch.tensor
A1, B1 = T([[1.0, 2.0]]), T([[1.0], [3.0]])
A2, B2 = T([[3.0, 4.0], [5.0, 6.0]]), T([[1.0, 2.0], [3.0, 4.0]])
CLIENTS = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]


def strategy(name, **options):
    return make(name, LoraSettings(r_max=2, lora_alpha=2.0), **options)


def start_state(name, **options):
    st = strategy(name, **options)
    state = st.initialize({"m": (2, 2)}, CLIENTS)
    if name != "flora":
        state.arrays[A_KEY] = T([[1.0, 1.0], [1.0, 1.0]])
    return st, state


def replies(b_only=False):
    r1 = {B_KEY: B1} if b_only else {A_KEY: A1, B_KEY: B1}
    r2 = {B_KEY: B2} if b_only else {A_KEY: A2, B_KEY: B2}
    return {1: Reply(r1, 1), 2: Reply(r2, 3)}


def test_zeropad_hand_computed():
    st, state = start_state("zeropad")
    new = st.aggregate(1, state, replies())
    torch.testing.assert_close(new.arrays[A_KEY], T([[2.5, 3.5], [3.75, 4.5]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0, 1.5], [3.0, 3.0]]))
    assert torch.equal(state.arrays[A_KEY], T([[1.0, 1.0], [1.0, 1.0]])), "aggregate must not mutate its input"


def test_prelort_segmentwise_hand_computed():
    st, state = start_state("prelort")
    assert st.federation_ranks(state) == [1, 2]
    ins = st.configure(1, state, CLIENTS)
    assert ins[1].config["subranks"] == [1] and ins[2].config["subranks"] == [1, 2]
    assert ins[1].arrays[A_KEY].shape == (1, 2) and ins[2].arrays[B_KEY].shape == (2, 2)
    new = st.aggregate(1, state, replies())
    # segment [0,1): both clients, updates [0,1] and [2,3] -> (1*[0,1] + 3*[2,3]) / 4 = [1.5, 2.5]
    # segment [1,2): client 2 only, update [4, 5]
    torch.testing.assert_close(new.arrays[A_KEY], T([[2.5, 3.5], [5.0, 6.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0, 2.0], [3.0, 4.0]]))


def test_hetlora_norm_weighted_hand_computed():
    st, state = start_state("hetlora")
    new = st.aggregate(1, state, replies())
    w1, w2 = math.sqrt(50.0), math.sqrt(2562.0)  # ||B1 A1||_F, ||B2 A2||_F
    p1, p2 = w1 / (w1 + w2), w2 / (w1 + w2)
    expected_A = T([[p1 * 1 + p2 * 3, p1 * 2 + p2 * 4], [p2 * 5, p2 * 6]])
    expected_B = T([[p1 * 1 + p2 * 1, p2 * 2], [p1 * 3 + p2 * 3, p2 * 4]])
    torch.testing.assert_close(new.arrays[A_KEY], expected_A)
    torch.testing.assert_close(new.arrays[B_KEY], expected_B)


def test_hetlora_remembers_pruned_rank_and_truncates():
    st, state = start_state("hetlora")
    pruned = {
        1: Reply({A_KEY: A1, B_KEY: B1}, 1, {"tail_norm": 0.5}),
        2: Reply({A_KEY: A2[:1], B_KEY: B2[:, :1]}, 3, {"tail_norm": 0.1}),
    }
    new = st.aggregate(1, state, pruned)
    assert new.meta["ranks"] == {"1": 1, "2": 1}
    assert new.meta["tail_norms"] == {"1": 0.5, "2": 0.1}
    ins = st.configure(2, new, CLIENTS)
    assert ins[2].arrays[A_KEY].shape == (1, 2)
    assert ins[2].config["hetlora_prev_tail"] == pytest.approx(0.1)
    assert ins[2].may_shrink_rank


def test_flora_stacking_is_exact_sum_hand_computed():
    st, state = start_state("flora")
    assert state.arrays[merged_key("m", "A")].shape == (0, 2)
    ins = st.configure(1, state, CLIENTS)
    assert ins[1].expect == {A_KEY: (1, 2), B_KEY: (2, 1)}
    new = st.aggregate(1, state, replies())
    torch.testing.assert_close(new.arrays[merged_key("m", "A")], T([[0.25, 0.5], [2.25, 3.0], [3.75, 4.5]]))
    torch.testing.assert_close(new.arrays[merged_key("m", "B")], T([[1.0, 1.0, 2.0], [3.0, 3.0, 4.0]]))
    merged = new.arrays[merged_key("m", "B")] @ new.arrays[merged_key("m", "A")]
    torch.testing.assert_close(merged, T([[10.0, 12.5], [22.5, 28.5]]))  # 0.25 B1A1 + 0.75 B2A2
    # the next round stacks on top of the first
    newer = st.aggregate(2, new, replies())
    torch.testing.assert_close(newer.arrays[merged_key("m", "B")] @ newer.arrays[merged_key("m", "A")], 2 * merged)
    exported, scale = st.export(newer)
    assert scale == 1.0 and exported[A_KEY].shape == (6, 2)


def test_flora_uses_each_clients_own_scale():
    st = FLoRA(LoraSettings(r_max=2, lora_alpha=2.0, scaling="rank"))
    state = st.initialize({"m": (2, 2)}, CLIENTS)
    new = st.aggregate(1, state, replies())
    # s_1 = 2 / 1 = 2, s_2 = 2 / 2 = 1: 0.25 * 2 * B1A1 + 0.75 * 1 * B2A2
    expected = 0.5 * B1 @ A1 + 0.75 * B2 @ A2
    torch.testing.assert_close(new.arrays[merged_key("m", "B")] @ new.arrays[merged_key("m", "A")], expected)


def test_ffa_lora_averages_b_only_and_keeps_a():
    st, state = start_state("ffa_lora")
    ins = st.configure(1, state, CLIENTS)
    assert set(ins[2].expect) == {B_KEY}
    new = st.aggregate(1, state, replies(b_only=True))
    torch.testing.assert_close(new.arrays[A_KEY], T([[1.0, 1.0], [1.0, 1.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0, 1.5], [3.0, 3.0]]))


def test_fedavg_hand_computed_equal_ranks():
    st = FedAvg(LoraSettings(r_max=1, lora_alpha=1.0))
    state = st.initialize({"m": (2, 2)}, [ClientInfo(1, 1, 1), ClientInfo(2, 1, 3)])
    new = st.aggregate(
        1,
        state,
        {
            1: Reply({A_KEY: T([[1.0, 2.0]]), B_KEY: T([[4.0], [0.0]])}, 1),
            2: Reply({A_KEY: T([[5.0, 6.0]]), B_KEY: T([[0.0], [8.0]])}, 3),
        },
    )
    torch.testing.assert_close(new.arrays[A_KEY], T([[4.0, 5.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0], [6.0]]))


def test_rank_above_global_maximum_is_refused():
    with pytest.raises(ValueError, match=r"^client 1: rank 3 is not an integer in \[1, r_max = 2\]$"):
        strategy("prelort").initialize({"m": (2, 2)}, [ClientInfo(1, 3, 1)])


@pytest.mark.parametrize(
    "name,options", [("zeropad", {}), ("prelort", {}), ("hetlora", {"weighting": "examples", "pruning": False})]
)
def test_equal_ranks_make_heterogeneous_rules_equal_fedavg(name, options):
    torch.manual_seed(3)
    clients = [ClientInfo(i, 4, n) for i, n in enumerate([5, 1, 7])]
    shapes = {"a": (6, 5), "b": (3, 6)}
    settings = LoraSettings(r_max=4, lora_alpha=8.0)
    ref = FedAvg(settings)
    other = make(name, settings, **options)
    state = ref.initialize(shapes, clients)
    state.arrays = {k: torch.randn_like(v) for k, v in state.arrays.items()}
    reps = {
        c.cid: Reply({k: v + torch.randn_like(v) for k, v in state.arrays.items()}, c.num_examples) for c in clients
    }
    expected = ref.aggregate(1, state, reps)
    got = other.aggregate(1, state, reps)
    for k in expected.arrays:
        torch.testing.assert_close(got.arrays[k], expected.arrays[k], rtol=1e-5, atol=1e-6)


def test_hetlora_norm_weighting_equals_mean_when_norms_equal():
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 1, 9)]
    st = HetLoRA(LoraSettings(r_max=1, lora_alpha=1.0))
    state = st.initialize({"m": (2, 2)}, clients)
    reps = {
        1: Reply({A_KEY: T([[1.0, 0.0]]), B_KEY: T([[1.0], [0.0]])}, 1),
        2: Reply({A_KEY: T([[0.0, 1.0]]), B_KEY: T([[0.0], [1.0]])}, 9),
    }
    new = st.aggregate(1, state, reps)  # both updates have norm 1: plain mean, n_k ignored
    torch.testing.assert_close(new.arrays[A_KEY], T([[0.5, 0.5]]))


def test_lowrank_norm_equals_the_dense_frobenius_norm():
    torch.manual_seed(0)
    B, A = torch.randn(7, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    assert float(lowrank_norm(B, A)) == pytest.approx(float((B @ A).norm()), rel=1e-12)
    assert float(lowrank_norm(B1, A1)) == pytest.approx(math.sqrt(50.0))


def test_lowrank_norm_has_a_finite_gradient_at_zero():
    B = torch.zeros(4, 2, requires_grad=True)
    A = torch.randn(2, 3, requires_grad=True)
    lowrank_norm(B, A).backward()
    assert torch.isfinite(B.grad).all() and torch.isfinite(A.grad).all()


def test_segments_and_segment_average_hand_computed():
    assert segments([4, 2, 8, 4]) == [(0, 2), (2, 4), (4, 8)]
    g = torch.zeros(3, 1)
    # clients of rank 1 (n 1) and 3 (n 3): rows 0 by both, rows 1..2 by the rank-3 client only
    got = segment_average(g, [T([[4.0]]), T([[8.0], [2.0], [6.0]])], [1, 3], [1.0, 3.0], 0, segments([1, 3]))
    torch.testing.assert_close(got, T([[7.0], [2.0], [6.0]]))
    # a segment no participating client reaches keeps the global rows
    kept = segment_average(T([[1.0], [5.0]]), [T([[3.0]])], [1], [1.0], 0, segments([1, 2]))
    torch.testing.assert_close(kept, T([[3.0], [5.0]]))
