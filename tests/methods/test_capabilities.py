"""What a method can do (nestfed.config.capabilities): refused unless declared, at config load and
by the round loop for every transport; and, for every registered method that declares a
capability, the capability's result is the method's own:

- robust aggregation: the block form under the n_k-weighted mean rule equals ``aggregate``;
- secure aggregation: the rebuild from exact sums equals ``aggregate`` (float rounding), and from
  SecAgg+'s quantised sums stays within the stated bound (nestfed.federation.secure_sum);
- server optimiser: the optimiser's identity step (SGD with momentum 0, lr 1, through the
  pseudo-gradient) equals ``aggregate``;
- resume: a run crashed in round 2 and resumed ends bit-identical to an uninterrupted run;
- export at a rank: the exported adapter loads in PEFT with the logits the strategy deploys.
"""

import dataclasses
import json

import pytest
import torch
from secagg_quantisation import quantised_sum
from tiny_federation import crash_and_resume, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import ConfigError, PrivacyConfig, RobustConfig, ServerOptimizerConfig, r_max
from nestfed.config.capabilities import WHAT, Capability
from nestfed.experiments.export import export_adapter
from nestfed.experiments.federated_run import Federation, run_federation
from nestfed.federation.in_process import InProcessTransport
from nestfed.federation.messages import Reply
from nestfed.federation.population import Population
from nestfed.federation.robust import BlockRule
from nestfed.federation.run_dir import RunDir
from nestfed.federation.secure_sum import layout, plain_sum, sum_error
from nestfed.federation.server_optimizer import server_step
from nestfed.methods.method import Method
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.frozen_prefix import lm_logits

C = Capability


def declaring(cap: Capability) -> list[str]:
    return [n for n, m in methods.REGISTRY.items() if cap in m.capabilities]


def config(name: str, *extra: str):
    """The tiny federation running ``name``, at one rank when the method takes no other."""
    hetero = C.HETEROGENEOUS_RANKS in methods.get(name).capabilities
    return tiny_config(f"strategy.name={name}", *([] if hetero else ["lora.ranks=[4]"]), *extra)


#: the settings under which a method offers a capability it declares (its check_config refuses it
#: otherwise): HetLoRA's robust block form has n_k weights, not its Frobenius-norm weights
UNDER = {(C.ROBUST_AGGREGATION, "hetlora"): ("hetlora.weighting=examples",)}
#: a setting that asks for each capability (the config-driven ones)
ASK = {C.ROBUST_AGGREGATION: ("robust.rule=median",), C.SERVER_OPTIMIZER: ("server_optimizer.name=adam",)}


def one_round(name: str, cap: Capability | None = None, seed: int = 0):
    """The method's strategy under the settings it needs for ``cap`` (checked: the config asking for
    ``cap`` loads), a random global state, its round-1 instructions and noisy replies (sent + noise;
    client c has n_k = 2 + c)."""
    under = UNDER.get((cap, name), ())
    if cap in ASK:
        config(name, *under, *ASK[cap])  # the method accepts the capability under these settings
    cfg = config(name, *under)
    prep = tiny_prepared(cfg)
    mr = methods.get(name).build(prep, cfg)
    st = mr.strategy
    g = torch.Generator().manual_seed(seed)
    state = st.initialize(mr.shapes, mr.clients)
    for k, v in state.arrays.items():
        if v.is_floating_point():
            state.arrays[k] = v + 0.1 * torch.randn(v.shape, generator=g)
    ins = st.configure(1, state, mr.clients)
    replies = {}
    for c, i in ins.items():
        arrays = {}
        for k, shape in i.expect.items():
            base = i.arrays[k] if k in i.arrays and tuple(i.arrays[k].shape) == tuple(shape) else torch.zeros(shape)
            arrays[k] = base + 0.1 * torch.randn(shape, generator=g)
        replies[c] = Reply(arrays, 2 + c)
    return st, state, ins, replies


# -- refused by default --------------------------------------------------------------------------


def bare(monkeypatch) -> Method:
    """FedAvg's implementation registered as a method that declares nothing."""
    m = dataclasses.replace(methods.get("fedavg"), name="bare", capabilities=frozenset(), refusals={})
    monkeypatch.setitem(methods.REGISTRY, "bare", m)
    return m


@pytest.mark.parametrize(
    "setting,needle",
    [
        ("lora.ranks=[2,4,8]", "lora.ranks: bare cannot take clients of different ranks"),
        ("robust.rule=median", "robust.rule: bare cannot aggregate robustly or with central DP"),
        (
            "privacy.mode=central privacy.clip_norm=1 privacy.noise_multiplier=1",
            "privacy.mode: bare cannot aggregate robustly or with central DP",
        ),
        ("server_optimizer.name=adam", "server_optimizer.name: bare cannot take a server optimiser"),
    ],
)
def test_a_method_that_declares_nothing_is_refused_at_config_load(monkeypatch, setting, needle):
    bare(monkeypatch)
    with pytest.raises(ConfigError, match=needle):
        tiny_config("strategy.name=bare", "lora.ranks=[4]", *setting.split())
    tiny_config("strategy.name=bare", "lora.ranks=[4]")  # asked for nothing: accepted


class AskingTransport(InProcessTransport):
    """The in-process transport asking for what Flower with secure aggregation asks."""

    asks = {C.FLOWER: "strategy.name", C.SECURE_AGGREGATION: "run config: secure-aggregation"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "caps,transport,extra,needle",
    [
        (frozenset(), AskingTransport, (), "strategy.name: fedavg cannot run on Flower"),
        (
            frozenset({C.FLOWER}),
            AskingTransport,
            (),
            "run config: secure-aggregation: fedavg cannot aggregate from secure sums alone",
        ),
        (frozenset(), InProcessTransport, ("robust.rule=median",), "robust.rule: fedavg cannot aggregate robustly"),
        (frozenset(), InProcessTransport, ("server_optimizer.name=adam",), "fedavg cannot take a server optimiser"),
    ],
)
def test_the_round_loop_refuses_what_its_method_does_not_declare_before_writing(
    tmp_path, caps, transport, extra, needle
):
    """The loop's own check, for every transport: a method's declared set (here emptied or cut)
    against what the loop's settings and its transport ask, before any file is written."""
    cfg = config("fedavg", *extra)
    prep = tiny_prepared(cfg)
    mr = methods.get("fedavg").build(prep, cfg)
    fed = Federation(
        "embedded", mr.strategy, transport(mr.trainer), mr.clients, mr.shapes, False, mr.finish, {}, Population()
    )
    monkeypatch_caps = dataclasses.replace(methods.get("fedavg"), capabilities=caps)
    opened = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(methods.REGISTRY, "fedavg", monkeypatch_caps)
        with pytest.raises(ConfigError, match=needle):
            run_federation(cfg, fed, lambda: opened.append(1) or RunDir.create(tmp_path / "run", ""))
    assert opened == [] and not (tmp_path / "run").exists()


def test_every_refusal_names_what_and_why():
    for cap in Capability:
        what, why = WHAT[cap]
        assert what and why, cap
    for m in methods.REGISTRY.values():
        assert set(m.refusals) <= set(Capability) - set(m.capabilities), m.name  # a reason only for a refusal


# -- what each declared capability means ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", declaring(C.ROBUST_AGGREGATION))
def test_the_mean_block_rule_is_the_methods_own_aggregate(name):
    st, state, _, replies = one_round(name, C.ROBUST_AGGREGATION)
    rule = BlockRule(RobustConfig(rule="mean"), PrivacyConfig())
    rule.start_round(1)
    own, blocks = st.aggregate(1, state, replies), st.robust_aggregate(1, state, replies, rule)
    assert own.arrays.keys() == blocks.arrays.keys()
    for k in own.arrays:
        torch.testing.assert_close(blocks.arrays[k], own.arrays[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", declaring(C.SECURE_AGGREGATION))
def test_the_secure_rebuild_is_the_methods_own_aggregate(name):
    st, state, ins, replies = one_round(name, C.SECURE_AGGREGATION)
    n = {c: r.num_examples for c, r in replies.items()}
    lay = layout(ins[c].expect for c in replies)
    exact = plain_sum({c: ins[c].arrays for c in replies}, {c: r.arrays for c, r in replies.items()}, n, lay)
    own = st.aggregate(1, state, replies)
    rebuilt = st.aggregate_secure(1, state, exact)
    for k in own.arrays:
        torch.testing.assert_close(rebuilt.arrays[k], own.arrays[k], rtol=1e-5, atol=1e-6)
    clip, q = 1.0, 2**20
    eps = sum_error(len(replies), clip, q, max(n.values()))
    noisy = st.aggregate_secure(1, state, quantised_sum(ins, replies, n, lay, clip, q))
    c_min = float(exact.counts[exact.counts > 0].min())
    for k in own.arrays:
        big = 1 + float(state.arrays[k].abs().max()) + float(own.arrays[k].abs().max())
        if k in exact.sums:
            big += float(exact.sums[k].abs().max()) / c_min
        bound = eps * big / (c_min - eps) + 1e-6
        assert float((noisy.arrays[k] - own.arrays[k]).abs().max()) <= bound, k


@pytest.mark.slow
@pytest.mark.parametrize("name", declaring(C.SERVER_OPTIMIZER))
def test_the_server_optimisers_identity_step_is_the_methods_own_aggregate(name):
    st, state, _, replies = one_round(name, C.SERVER_OPTIMIZER)
    own = st.aggregate(1, state, replies)
    identity = ServerOptimizerConfig(name="sgdm", momentum=0.0, lr=1.0)  # the pseudo-gradient path, stepped
    assert not identity.identity
    stepped, _ = server_step(identity, state, own)
    for k in own.arrays:
        torch.testing.assert_close(stepped.arrays[k], own.arrays[k], rtol=1e-5, atol=1e-6)


def same_tree(a, b) -> bool:
    """Equal nested dicts of tensors and numbers, bit for bit; wall-clock fields (``*_s``) aside."""
    if isinstance(a, dict):
        keys = {k for k in a if not str(k).endswith("_s")}
        return (
            isinstance(b, dict)
            and keys == {k for k in b if not str(k).endswith("_s")}
            and all(same_tree(a[k], b[k]) for k in keys)
        )
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("name", declaring(C.RESUME))
def test_a_resumed_run_is_the_uninterrupted_run(tmp_path, name, one_thread):
    full, resumed = crash_and_resume(tmp_path, config(name))
    assert same_arrays(full.arrays, resumed.arrays)
    assert same_tree(full.meta, resumed.meta)
    kept = [RunDir(tmp_path / d).latest_checkpoint(True).client_state or {} for d in ("full", "part")]
    assert same_tree(kept[0], kept[1])


@pytest.mark.parametrize("name", declaring(C.EXPORT_AT_RANK))
def test_the_export_loads_in_peft_with_the_deployed_logits(tmp_path, name, one_thread):
    from peft import PeftModel

    from nestfed.nn.backbone import load_backbone

    cfg = config(name, "federation.rounds=1")
    prep = tiny_prepared(cfg)
    state, _, mr = tiny_run(tmp_path / "run", cfg, prep)
    arrays, scale = mr.strategy.deploy(state, None)
    out, _ = export_adapter(tmp_path / "run", rank=r_max(cfg), out=tmp_path / "peft")
    ours = prep.backbone.model
    apply_arrays(ours, arrays, scale)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = lm_logits(ours, ids)
    peft_model = PeftModel.from_pretrained(load_backbone(cfg.model).model, out)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == r_max(cfg)
    torch.testing.assert_close(peft_model(ids).logits, expected, rtol=1e-4, atol=1e-4)
