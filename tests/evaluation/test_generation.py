"""Generation: batched with left padding equals one prompt at a time, and equals transformers'
``generate`` with the same adapter in PEFT's format on a plain model (the global adapter truncated
to a rank, a client's rank-r_k adapter); through a window and a delta-rule memory, the stream
equals a full forward over the tokens so far at every step; sampling is seeded per prompt."""

import copy

import pytest
import torch

from nestfed.evaluation.generation import Decoding, generate, uses_streams
from nestfed.federation.aggregation import truncate_rank
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.bounded_attention import install_bounded_attention
from nestfed.nn.lora import get_adapter_state, inject_lora, set_adapter_state
from nestfed.nn.memory import MemorySettings, install_memory, memory_rules, set_memory_enabled
from nestfed.nn.peft_export import export_peft_adapter

PROMPTS = [[5, 17, 99, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13], [200], [60, 61, 62, 63]]
STOP, PAD = 257, 256


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def plain(tiny_llama):
    return tiny_llama.model.double()


def hf_generate(model, prompts, n, stop=STOP) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding at all)."""
    out = []
    for p in prompts:
        x = torch.tensor([p])
        y = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=PAD
        )
        out.append(y[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_batched_equals_one_by_one_equals_transformers_on_a_plain_model(tiny_llama, batch):
    model = plain(tiny_llama)
    d = Decoding(max_new_tokens=6)
    got = generate(model, PROMPTS, d, [STOP], PAD, batch_size=batch)
    assert [len(g) for g in got] == [6] * 5
    assert got == hf_generate(model, PROMPTS, 6)


@pytest.mark.parametrize("rank", [2, 8])
def test_a_truncated_adapter_equals_peft_on_a_plain_model(tiny_llama, tmp_path, rank):
    """The global adapter (rank 8) truncated to rank r, and exported to PEFT at that rank: the
    same tokens from nestfed's LoRA layers (batched) and from PEFT's (transformers' generate)."""
    from peft import PeftModel

    base = copy.deepcopy(plain(tiny_llama))
    bare = copy.deepcopy(base)  # PEFT injects its layers into the model it is given
    model = plain(tiny_llama)
    inject_lora(model, ("q_proj", "v_proj"), rank=8, scaling=2.0)
    g = torch.Generator().manual_seed(0)
    state = {
        k: 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in get_adapter_state(model).items()
    }
    set_adapter_state(model, state)
    arrays = truncate_rank(state, rank)
    apply_arrays(model, arrays, 2.0)
    got = generate(model, PROMPTS, Decoding(max_new_tokens=5), [STOP], PAD, batch_size=3)
    export_peft_adapter({k: v.float() for k, v in arrays.items()}, 2.0, tmp_path / "adapter")
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").double().eval()
    assert got == hf_generate(peft, PROMPTS, 5)
    assert got != generate(bare, PROMPTS, Decoding(max_new_tokens=5), [STOP], PAD)  # the adapter matters


def test_stopping_at_a_stop_token_keeps_it_and_ends_the_row(tiny_llama):
    model = plain(tiny_llama)
    free = generate(model, PROMPTS[:1], Decoding(max_new_tokens=6), [STOP], PAD)[0]
    got = generate(model, PROMPTS[:1], Decoding(max_new_tokens=6), [free[2]], PAD)[0]
    assert got == free[: free.index(free[2]) + 1]


def test_rows_that_stop_early_leave_the_batch_without_changing_any_row(tiny_llama):
    """A stop token that ends some rows after one or two tokens and others never: the batch drops
    the stopped rows from its cache mid-way, and every row is still what it is alone and what
    transformers' generate gives (greedy), and batch-invariant (sampled)."""
    model = plain(tiny_llama)
    free = generate(model, PROMPTS, Decoding(max_new_tokens=6), [STOP], PAD, batch_size=1)
    stop = free[1][1]  # the second prompt stops at its second token
    got = generate(model, PROMPTS, Decoding(max_new_tokens=6), [stop], PAD, batch_size=5)
    lengths = [len(g) for g in got]
    assert lengths[1] == 2 and max(lengths) == 6 and len(set(lengths)) > 1  # rows did leave early
    assert got == hf_generate(model, PROMPTS, 6, stop)
    d = Decoding(max_new_tokens=8, temperature=1.5, seed=5)
    sampled = generate(model, PROMPTS, d, [stop, free[0][0]], PAD, batch_size=5)
    assert sampled == [generate(model, [p], d, [stop, free[0][0]], PAD)[0] for p in PROMPTS[:1]] + sampled[1:]
    assert sampled == generate(model, PROMPTS, d, [stop, free[0][0]], PAD, batch_size=1)


@torch.no_grad()
def test_a_memory_with_a_window_streams_what_a_full_forward_gives(tiny_llama):
    """FedNL's memory on both layers and a window of 4 tokens with 1 sink: every generated token
    is the argmax of a one-pass forward over the prompt and the tokens so far (the naive
    reference), batched or not."""
    model = plain(tiny_llama)
    install_memory(model, MemorySettings(window=4, sink=1, chunk_size=4))
    set_memory_enabled(model, True)
    g = torch.Generator().manual_seed(1)
    for r in memory_rules(model).values():
        r.beta_weight.copy_(0.3 * torch.randn(r.beta_weight.shape, generator=g, dtype=torch.float64))
    assert uses_streams(model)
    prompts = PROMPTS + [[1, 2, 3, 4]]  # two prompts of length 4 stream together
    got = generate(model, prompts, Decoding(max_new_tokens=6), [STOP], PAD, batch_size=4)
    assert got == generate(model, prompts, Decoding(max_new_tokens=6), [STOP], PAD, batch_size=1)
    for p, toks in zip(prompts, got):
        seq = list(p)
        for t in toks:
            want = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            assert t == want
            seq.append(t)
    set_memory_enabled(model, False)
    assert generate(model, prompts, Decoding(max_new_tokens=6), [STOP], PAD) != got  # the memory matters


@torch.no_grad()
def test_a_deployment_window_streams_too(tiny_llama):
    model = plain(tiny_llama)
    install_bounded_attention(model, None, window=3, sink=0, fixed=True)
    got = generate(model, PROMPTS, Decoding(max_new_tokens=5), [STOP], PAD, batch_size=5)
    for p, toks in zip(PROMPTS, got):
        seq = list(p)
        for t in toks:
            assert t == int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(t)


def test_sampling_is_seeded_per_prompt(tiny_llama):
    model = plain(tiny_llama)
    d = Decoding(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=3)
    a = generate(model, PROMPTS, d, [STOP], PAD, batch_size=5)
    assert a == generate(model, PROMPTS, d, [STOP], PAD, batch_size=2)  # batch-invariant
    assert a == [generate(model, [p], d, [STOP], PAD)[0] for p in PROMPTS[:1]] + a[1:]
    assert a != generate(model, PROMPTS, Decoding(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=4), [STOP], PAD)
    assert a != generate(model, PROMPTS, Decoding(max_new_tokens=8), [STOP], PAD)  # not the greedy path
    tight = generate(model, PROMPTS, Decoding(max_new_tokens=8, temperature=1.5, top_p=1e-6), [STOP], PAD)
    assert tight == generate(model, PROMPTS, Decoding(max_new_tokens=8), [STOP], PAD)  # nucleus of one: greedy


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="top_p must be in"):
        Decoding(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        Decoding(max_new_tokens=0)


def test_a_clients_deployed_adapter_equals_its_peft_export(tmp_path):
    """A tiny PreLort federation (ranks 2/4/8): client 1's adapter as its hooks run it, applied by
    nestfed, generates what PEFT generates with ``nestfed export --client 1``'s adapter."""
    from peft import PeftModel
    from tiny_federation import tiny_config, tiny_run

    from nestfed.experiments.export import export_adapter
    from nestfed.federation.run_dir import RunDir
    from nestfed.nn.backbone import load_backbone

    cfg = tiny_config("strategy.name=prelort", "federation.rounds=1")
    _, _, mr = tiny_run(tmp_path / "run", cfg)
    path, info = export_adapter(tmp_path / "run", client=1)
    assert info["rank"] == 4
    ck = RunDir(tmp_path / "run").latest_checkpoint()
    arrays, scale = mr.strategy.deploy(ck.state, 1)
    model = mr.trainer.model.double()
    apply_arrays(model, mr.trainer.hooks.evaluation_arrays({}, arrays), scale)
    got = generate(model, PROMPTS, Decoding(max_new_tokens=5), [STOP], PAD, batch_size=5)
    base = load_backbone(cfg.model).model.double()
    peft = PeftModel.from_pretrained(base, path).double().eval()
    assert got == hf_generate(peft, PROMPTS, 5)
