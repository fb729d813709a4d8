"""Fed-SB (arXiv 2502.15436): frozen A and B, a trained core R between them, R averaged exactly.
Hand-computed aggregation, the exactness claim (the aggregated B R A is the weighted mean of the
clients' B R_k A), the layer variant (s B R A, only R trains, plain layers untouched), the PEFT
export (B' = B R loads with the same logits) and a short run on the tiny config.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tiny_federation import lines, tiny_config, tiny_prepared, tiny_run

from nestfed.config import ConfigError
from nestfed.errors import NestfedError
from nestfed.experiments.export import export_adapter
from nestfed.experiments.run import run_method
from nestfed.federation.aggregation import fold_cores, one_adapter
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fed_sb.frozen_factors import orthonormal
from nestfed.methods.fed_sb.strategy import FedSB
from nestfed.nn.arrays import apply_arrays, lora_arrays, lora_parameters
from nestfed.nn.keys import lora_core_key, peft_key
from nestfed.nn.lora import LoraLinear

T = torch.tensor
A_KEY, B_KEY, R_KEY = peft_key("m", "lora_A"), peft_key("m", "lora_B"), lora_core_key("m", "lora_core")
CLIENTS = [ClientInfo(1, 2, 1), ClientInfo(2, 2, 3)]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_the_server_averages_R_with_n_k_weights_hand_computed():
    st = FedSB(LoraSettings(r_max=2, lora_alpha=2.0))
    state = st.initialize({"m": (3, 2)}, CLIENTS)
    assert state.arrays[R_KEY].shape == (2, 2) and not state.arrays[R_KEY].any()
    ins = st.configure(1, state, CLIENTS)
    assert set(ins[1].arrays) == {R_KEY} and ins[1].expect == {R_KEY: (2, 2)}  # only R travels, both ways
    r1, r2 = T([[1.0, 2.0], [3.0, 4.0]]), T([[5.0, 6.0], [7.0, 8.0]])
    new = st.aggregate(1, state, {1: Reply({R_KEY: r1}, 1), 2: Reply({R_KEY: r2}, 3)})
    # (1 r1 + 3 r2) / 4 = [[4, 5], [6, 7]]
    torch.testing.assert_close(new.arrays[R_KEY], T([[4.0, 5.0], [6.0, 7.0]]))
    assert torch.equal(new.arrays[A_KEY], state.arrays[A_KEY]) and torch.equal(new.arrays[B_KEY], state.arrays[B_KEY])


def test_the_aggregate_is_exactly_the_weighted_mean_of_the_clients_updates():
    st = FedSB(LoraSettings(r_max=3, lora_alpha=6.0))  # s = 2
    clients = [ClientInfo(c, 3, n) for c, n in enumerate((2, 5, 1))]
    state = st.initialize({"m": (5, 4)}, clients)
    g = torch.Generator().manual_seed(3)
    cores = {c.cid: torch.randn(3, 3, generator=g, dtype=torch.float64).float() for c in clients}
    new = st.aggregate(1, state, {c.cid: Reply({R_KEY: cores[c.cid]}, c.num_examples) for c in clients})
    A, B = state.arrays[A_KEY].double(), state.arrays[B_KEY].double()
    expected = sum(n * 2.0 * B @ cores[c].double() @ A for c, n in ((0, 2), (1, 5), (2, 1))) / 8
    got = 2.0 * B @ new.arrays[R_KEY].double() @ A
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_the_frozen_factors_are_orthonormal_and_seeded():
    g = torch.Generator().manual_seed(0)
    tall, wide = orthonormal(6, 3, g), orthonormal(3, 6, g)
    torch.testing.assert_close(tall.T @ tall, torch.eye(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(wide @ wide.T, torch.eye(3), atol=1e-6, rtol=0)
    st = FedSB(LoraSettings(r_max=2, lora_alpha=2.0, init_seed=5))
    a, b = st.initialize({"m": (3, 4)}, CLIENTS), st.initialize({"m": (3, 4)}, CLIENTS)
    assert torch.equal(a.arrays[A_KEY], b.arrays[A_KEY]) and torch.equal(a.arrays[B_KEY], b.arrays[B_KEY])


def layer(out_f=3, in_f=4, seed=0):
    torch.manual_seed(seed)
    return LoraLinear(torch.nn.Linear(in_f, out_f), rank=2, scaling=0.5)


def test_the_core_layer_computes_s_B_R_A_and_trains_only_R():
    lin = torch.nn.Sequential()
    lin.add_module("m", layer())
    A, B = T([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, -1.0]]), T([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    R = T([[1.0, 2.0], [0.0, 1.0]])
    keys = {peft_key("m", "lora_A"): A, peft_key("m", "lora_B"): B, lora_core_key("m", "lora_core"): R}
    apply_arrays(lin, keys, 0.5)
    x = T([[1.0, 1.0, 1.0, 0.0]])
    # A x = [3, 1]; R A x = [5, 1]; B R A x = [5, 2, 6]; times s = 0.5
    base = lin.m.base_layer(x)
    torch.testing.assert_close(lin(x) - base, T([[2.5, 1.0, 3.0]]))
    params = lora_parameters(lin)
    assert params == [lin.m.lora_core.weight] and not lin.m.lora_A.weight.requires_grad
    out = lora_arrays(lin)
    assert set(out) == {lora_core_key("m", "lora_core")} and torch.equal(out[lora_core_key("m", "lora_core")], R)
    # a payload without the core makes the layer plain LoRA again: s B A x = 0.5 [3, 2, 4]
    apply_arrays(lin, {peft_key("m", "lora_A"): A, peft_key("m", "lora_B"): B}, 0.5)
    assert lin.m.lora_core is None
    torch.testing.assert_close(lin(x) - base, T([[1.5, 1.0, 2.0]]))


def test_the_export_folds_R_into_B():
    A, B, R = T([[1.0, 2.0]]), T([[1.0], [3.0]]), T([[2.0]])
    folded = fold_cores({A_KEY: A, B_KEY: B, R_KEY: R})
    assert set(folded) == {A_KEY, B_KEY}
    torch.testing.assert_close(folded[B_KEY], T([[2.0], [6.0]]))
    arrays, scale = one_adapter({A_KEY: A, B_KEY: B, R_KEY: R}, 0.5)  # what nestfed export --client writes
    torch.testing.assert_close(arrays[B_KEY], T([[2.0], [6.0]]))
    assert scale == 0.5


def test_heterogeneous_ranks_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="fed_sb cannot take clients of different ranks: every client trains one R"):
        tiny_config("strategy.name=fed_sb")


def test_a_tiny_run_learns_and_its_peft_export_has_the_deployed_logits(tmp_path):
    from peft import PeftModel

    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.frozen_prefix import lm_logits

    cfg = tiny_config("strategy.name=fed_sb", "lora.ranks=[4]", "federation.rounds=2")
    prep = tiny_prepared(cfg)
    summary = run_method(prep, cfg, tmp_path / "run")
    assert summary["method"] == "fed_sb" and summary["aggregated_rounds"] == 2
    ls = lines(tmp_path / "run")
    assert ls[-1]["eval"]["0"]["loss"] < ls[0]["eval"]["0"]["loss"]
    out = tmp_path / "run" / "adapter"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    state, _, mr = tiny_run(tmp_path / "again", cfg, tiny_prepared(cfg))
    arrays, scale = mr.strategy.deploy(state, None)
    cores = [v for k, v in arrays.items() if k.endswith("lora_core.weight")]
    assert cores and all(c.abs().sum() > 0 for c in cores)  # R trained away from 0
    ours = prep.backbone.model
    apply_arrays(ours, arrays, scale)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = lm_logits(ours, ids)
    peft_model = PeftModel.from_pretrained(load_backbone(cfg.model).model, out)
    torch.testing.assert_close(peft_model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    # nestfed export --client K writes the same adapter (every client runs the global model, B R
    # folded); --rank is refused with the reason
    client, _ = export_adapter(tmp_path / "run", client=1, out=tmp_path / "client1")
    ours_b, theirs_b = (
        load_file(str(out / "adapter_model.safetensors")),
        load_file(str(client / "adapter_model.safetensors")),
    )
    assert ours_b.keys() == theirs_b.keys() and all(torch.equal(ours_b[k], theirs_b[k]) for k in ours_b)
    with pytest.raises(NestfedError, match="fed_sb cannot export its global adapter at a rank: the exported adapter"):
        export_adapter(tmp_path / "run", rank=4, out=tmp_path / "r4")


def test_the_secure_rebuild_is_the_hand_computed_mean():
    """R's rows are its rank dimension, every client holds all of them: G + S / N is the mean."""
    from nestfed.federation.secure_sum import layout, plain_sum

    st = FedSB(LoraSettings(r_max=2, lora_alpha=2.0))
    state = st.initialize({"m": (3, 2)}, CLIENTS)
    state.arrays[R_KEY] = T([[1.0, 1.0], [0.0, 0.0]])
    ins = st.configure(1, state, CLIENTS)
    r1, r2 = T([[1.0, 2.0], [3.0, 4.0]]), T([[5.0, 6.0], [7.0, 8.0]])
    replies = {1: {R_KEY: r1}, 2: {R_KEY: r2}}
    sums = plain_sum({c: ins[c].arrays for c in replies}, replies, {1: 1, 2: 3}, layout(ins[c].expect for c in replies))
    # S = 1 (r1 - G) + 3 (r2 - G) = [[12, 16], [24, 28]], N = 4: G + S / N = [[4, 5], [6, 7]]
    torch.testing.assert_close(sums.sums[R_KEY], T([[12.0, 16.0], [24.0, 28.0]], dtype=torch.float64))
    new = st.aggregate_secure(1, state, sums)
    torch.testing.assert_close(new.arrays[R_KEY], T([[4.0, 5.0], [6.0, 7.0]]))


def test_the_core_trains_at_its_own_learning_rate_when_set():
    from nestfed.methods import get

    cfg = tiny_config("strategy.name=fed_sb", "lora.ranks=[4]", "fed_sb.lr=0.25")
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert get("fed_sb").client_hooks(cfg).param_groups(None, params) == [{"params": params, "lr": 0.25}]
    default = tiny_config("strategy.name=fed_sb", "lora.ranks=[4]")
    assert get("fed_sb").client_hooks(default).param_groups(None, params) == [{"params": params}]
    with pytest.raises(ConfigError, match="lr must be >= 0"):
        tiny_config("strategy.name=fed_sb", "lora.ranks=[4]", "fed_sb.lr=-1")


def test_a_client_sends_and_receives_r_squared_numbers_per_layer_whatever_the_number_of_clients():
    shapes = {"a": (6, 5), "b": (7, 3)}
    for k in (2, 9):
        clients = [ClientInfo(c, 3, 1 + c) for c in range(k)]
        st = FedSB(LoraSettings(r_max=3, lora_alpha=3.0))
        ins = st.configure(1, st.initialize(shapes, clients), clients)
        for i in ins.values():
            assert sum(v.numel() for v in i.arrays.values()) == 2 * 3 * 3  # two layers, R [3, 3] each
            assert sum(math.prod(s) for s in i.expect.values()) == 2 * 3 * 3
