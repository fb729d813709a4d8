"""RAVAN (NeurIPS 2025, arXiv 2506.05568): Delta W = sum_i s_i B_i H_i A_i with B_i, A_i frozen;
clients train H_i and s_i and send s_i H_i, averaged exactly. Hand-computed aggregation, the
exactness claim, the gated-heads layer (gates start at 1, the reply folds them), the options and
refusals, and a short run on the tiny config whose PEFT export has the deployed logits.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_federation import lines, tiny_config, tiny_prepared

from nestfed.config import ConfigError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.run_dir import RunDir
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fed_sb.frozen_factors import client_payload, frozen_heads_key
from nestfed.methods.ravan.strategy import Ravan
from nestfed.nn.arrays import apply_arrays, lora_arrays, lora_parameters
from nestfed.nn.keys import lora_core_key, merged_key, peft_key
from nestfed.nn.lora import LoraLinear

T = torch.tensor
A_KEY, B_KEY, H_KEY = peft_key("m", "lora_A"), peft_key("m", "lora_B"), lora_core_key("m", "lora_heads")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_the_server_averages_s_i_H_i_with_n_k_weights_hand_computed():
    st = Ravan(LoraSettings(r_max=4, lora_alpha=4.0), heads=2)
    clients = [ClientInfo(1, 4, 1), ClientInfo(2, 4, 3)]
    state = st.initialize({"m": (4, 5)}, clients)
    assert state.arrays[H_KEY].shape == (4, 2) and not state.arrays[H_KEY].any()  # [H_1; H_2]
    assert state.arrays[A_KEY].shape == (4, 5) and state.arrays[B_KEY].shape == (4, 4)
    ins = st.configure(1, state, clients)
    assert ins[1].expect == {H_KEY: (4, 2)}
    h1 = T([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    h2 = T([[5.0, 4.0], [0.0, 1.0], [-2.0, 6.0], [2.0, 2.0]])
    new = st.aggregate(1, state, {1: Reply({H_KEY: h1}, 1), 2: Reply({H_KEY: h2}, 3)})
    # (1 h1 + 3 h2) / 4: head 0 [[4, 3], [0, 1]], head 1 [[-1, 5], [2, 2]]
    torch.testing.assert_close(new.arrays[H_KEY], T([[4.0, 3.0], [0.0, 1.0], [-1.0, 5.0], [2.0, 2.0]]))


def test_the_aggregate_is_exactly_the_weighted_mean_of_the_clients_heads():
    st = Ravan(LoraSettings(r_max=6, lora_alpha=3.0), heads=3)  # s = 0.5, q = 2
    clients = [ClientInfo(c, 6, n) for c, n in enumerate((4, 1, 3))]
    state = st.initialize({"m": (7, 8)}, clients)
    g = torch.Generator().manual_seed(1)
    replies = {c.cid: torch.randn(6, 2, generator=g) for c in clients}  # 3 heads of [2, 2], stacked
    new = st.aggregate(1, state, {c.cid: Reply({H_KEY: replies[c.cid]}, c.num_examples) for c in clients})
    A, B = state.arrays[A_KEY].double(), state.arrays[B_KEY].double()

    def update(heads):  # s sum_i B_i H_i A_i, head by head
        return sum(
            0.5 * B[:, 2 * i : 2 * i + 2] @ heads[2 * i : 2 * i + 2].double() @ A[2 * i : 2 * i + 2] for i in range(3)
        )

    expected = sum(n * update(replies[c]) for c, n in ((0, 4), (1, 1), (2, 3))) / 8
    torch.testing.assert_close(update(new.arrays[H_KEY]), expected, rtol=1e-6, atol=1e-6)


def test_the_heads_are_mutually_orthogonal():
    st = Ravan(LoraSettings(r_max=4, lora_alpha=4.0), heads=2)
    state = st.initialize({"m": (6, 5)}, [ClientInfo(0, 4, 1)])
    A, B = state.arrays[A_KEY], state.arrays[B_KEY]
    torch.testing.assert_close(A @ A.T, torch.eye(4), atol=1e-6, rtol=0)
    torch.testing.assert_close(B.T @ B, torch.eye(4), atol=1e-6, rtol=0)


def test_the_gated_heads_layer_starts_its_gates_at_1_and_replies_s_i_H_i():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("m", LoraLinear(torch.nn.Linear(2, 2), rank=2, scaling=1.0))
    A, B = torch.eye(2), T([[1.0, 0.0], [1.0, 1.0]])
    H = T([[1.0], [4.0]])  # two heads of rank 1, stacked
    apply_arrays(model, {A_KEY: A, B_KEY: B, H_KEY: H}, 1.0)
    heads = model.m.lora_core
    torch.testing.assert_close(heads.gates.detach(), T([1.0, 1.0]))
    assert lora_parameters(model) == [heads.weight, heads.gates]
    with torch.no_grad():
        heads.gates.copy_(T([2.0, 0.5]))
    x = T([[1.0, 1.0]])
    # A x = [1, 1]; gated heads [2 * 1, 0.5 * 4] -> [2, 2]; B [2, 2] = [2, 4]
    torch.testing.assert_close(model(x) - model.m.base_layer(x), T([[2.0, 4.0]]))
    torch.testing.assert_close(lora_arrays(model)[H_KEY], T([[2.0], [2.0]]))
    apply_arrays(model, {A_KEY: A, B_KEY: B, H_KEY: H}, 1.0)  # the next round: gates back at 1
    torch.testing.assert_close(model.m.lora_core.gates.detach(), T([1.0, 1.0]))


def test_the_options_and_refusals():
    assert tiny_config("strategy.name=ravan", "lora.ranks=[4]", "ravan.heads=2").section("ravan").heads == 2
    with pytest.raises(ConfigError, match="ravan.heads: 3 heads do not divide the LoRA rank 4"):
        tiny_config("strategy.name=ravan", "lora.ranks=[4]", "ravan.heads=3")
    with pytest.raises(ConfigError, match="heads must be >= 1"):
        tiny_config("strategy.name=ravan", "lora.ranks=[4]", "ravan.heads=0")
    with pytest.raises(ConfigError, match="ravan.heads: client ranks \\[2\\] are not multiples of the head rank 4"):
        tiny_config("strategy.name=ravan", "ravan.heads=2")  # ranks 2, 4, 8: heads of rank 4
    assert tiny_config("strategy.name=ravan").lora.ranks == (2, 4, 8)  # 4 heads of rank 2


def test_a_client_of_lower_rank_runs_the_global_model_with_its_other_heads_frozen():
    """Rank 2 of 4 (heads of rank 2): it receives head 0 and, as frozen heads, head 1; it draws A
    and B from the seed and runs head 1 as its frozen residual s B_1 H_1 A_1, so its model's
    output is the global model's. Neither A nor B travels."""
    st = Ravan(LoraSettings(r_max=4, lora_alpha=8.0, init_seed=3), heads=2)  # s = 2
    clients = [ClientInfo(0, 2, 1), ClientInfo(1, 4, 1)]
    state = st.initialize({"m": (3, 5)}, clients)
    state.arrays[H_KEY] = torch.randn(4, 2, generator=torch.Generator().manual_seed(4))
    A, B, H = state.arrays[A_KEY], state.arrays[B_KEY], state.arrays[H_KEY]
    ins = st.configure(1, state, clients)
    assert set(ins[0].arrays) == {H_KEY, frozen_heads_key("m")} and set(ins[1].arrays) == {H_KEY}
    assert ins[0].expect == {H_KEY: (2, 2)} and ins[0].config["scaling"] == 2.0
    low = client_payload(ins[0].arrays, ins[0].config, {"m": (3, 5)})
    assert torch.equal(low[A_KEY], A[:2]) and torch.equal(low[B_KEY], B[:, :2])  # drawn from the seed
    torch.testing.assert_close(low[merged_key("m", "A")], A[2:])
    torch.testing.assert_close(low[merged_key("m", "B")], 2.0 * B[:, 2:] @ H[2:])  # s B_1 H_1
    full = client_payload(ins[1].arrays, ins[1].config, {"m": (3, 5)})
    assert merged_key("m", "A") not in full and torch.equal(full[A_KEY], A)
    outputs = []
    for arrays in (low, full):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("m", LoraLinear(torch.nn.Linear(5, 3), rank=4, scaling=2.0))
        apply_arrays(model, arrays, ins[0].config["scaling"])
        outputs.append(model(torch.ones(1, 5)))
        if arrays is low:
            assert lora_parameters(model) == [model.m.lora_core.weight, model.m.lora_core.gates]
    torch.testing.assert_close(outputs[0], outputs[1])


def test_heterogeneous_ranks_hand_computed_untrained_heads_count_at_the_global_value():
    st = Ravan(LoraSettings(r_max=4, lora_alpha=4.0), heads=2)  # heads of rank 2
    clients = [ClientInfo(1, 2, 1), ClientInfo(2, 4, 3)]
    state = st.initialize({"m": (4, 5)}, clients)
    state.arrays[H_KEY] = T([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    ins = st.configure(1, state, clients)
    assert ins[1].arrays[H_KEY].shape == (2, 2) and ins[1].arrays[frozen_heads_key("m")].shape == (2, 2)
    assert ins[1].expect == {H_KEY: (2, 2)} and ins[1].config["scaling"] == ins[2].config["scaling"] == 1.0
    h1 = T([[5.0, 5.0], [5.0, 5.0]])  # client 1 trained head 0 only
    h2 = T([[1.0, 1.0], [1.0, 1.0], [6.0, 6.0], [10.0, 10.0]])
    new = st.aggregate(1, state, {1: Reply({H_KEY: h1}, 1), 2: Reply({H_KEY: h2}, 3)})
    # head 0: (1 * 5 + 3 * 1) / 4 = 2; head 1: client 1 ran the global [2, 2]:
    # row 2 (1 * 2 + 3 * 6) / 4 = 5, row 3 (1 * 2 + 3 * 10) / 4 = 8
    torch.testing.assert_close(new.arrays[H_KEY], T([[2.0, 2.0], [2.0, 2.0], [5.0, 5.0], [8.0, 8.0]]))
    deployed, scale = st.deploy(new, 1)
    assert deployed[H_KEY].shape == (4, 2) and scale == 1.0  # every client runs the global model


def test_a_tiny_run_learns_and_its_peft_export_has_the_deployed_logits(tmp_path):
    from peft import PeftModel

    from nestfed.methods import get
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.frozen_prefix import lm_logits
    from nestfed.nn.lora import lora_modules

    cfg = tiny_config("strategy.name=ravan", "federation.rounds=2")  # ranks 2, 4, 8: 4 heads of rank 2
    prep = tiny_prepared(cfg)
    summary = run_method(prep, cfg, tmp_path / "run")
    assert summary["method"] == "ravan" and summary["aggregated_rounds"] == 2
    ls = lines(tmp_path / "run")
    assert ls[-1]["eval"]["0"]["loss"] < ls[0]["eval"]["0"]["loss"]
    out = tmp_path / "run" / "adapter"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    assert {ln["clients"][c]["metrics"]["rank"] for ln in ls[1:] for c in ln["clients"]} == {2.0, 4.0, 8.0}
    # the adapter the run exported is B' = B blockdiag(H_i), A' = A of its final state
    state = RunDir(tmp_path / "run").latest_checkpoint(False).state
    arrays, scale = get("ravan").server(cfg, {}).deploy(state, None)
    ours = prep.backbone.model
    apply_arrays(ours, arrays, scale)
    assert all(m.lora_core is not None for m in lora_modules(ours).values())
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = lm_logits(ours, ids)
    peft_model = PeftModel.from_pretrained(load_backbone(cfg.model).model, out)
    torch.testing.assert_close(peft_model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert not any("heads" in k for k in saved)


def test_at_heterogeneous_ranks_the_aggregate_is_exactly_the_mean_of_the_clients_models():
    """Client k trains its first r_k / q heads and runs the rest at the global values; its model's
    update is s B blockdiag(heads it ran) A; the aggregate's is their n_k-weighted mean."""
    st = Ravan(LoraSettings(r_max=6, lora_alpha=3.0), heads=3)  # s = 0.5, q = 2
    clients = [ClientInfo(0, 2, 4), ClientInfo(1, 4, 1), ClientInfo(2, 6, 3)]
    state = st.initialize({"m": (7, 8)}, clients)
    g = torch.Generator().manual_seed(2)
    state.arrays[H_KEY] = torch.randn(6, 2, generator=g)
    replies = {c.cid: torch.randn(c.rank, 2, generator=g) for c in clients}
    new = st.aggregate(1, state, {c.cid: Reply({H_KEY: replies[c.cid]}, c.num_examples) for c in clients})
    A, B, G = state.arrays[A_KEY].double(), state.arrays[B_KEY].double(), state.arrays[H_KEY].double()

    def update(heads):
        return sum(0.5 * B[:, 2 * i : 2 * i + 2] @ heads[2 * i : 2 * i + 2] @ A[2 * i : 2 * i + 2] for i in range(3))

    def ran(c):  # the heads client c ran: its trained rows, then the global ones
        return torch.cat([replies[c].double(), G[replies[c].shape[0] :]])

    expected = sum(n * update(ran(c)) for c, n in ((0, 4), (1, 1), (2, 3))) / 8
    torch.testing.assert_close(update(new.arrays[H_KEY].double()), expected, rtol=1e-6, atol=1e-6)
