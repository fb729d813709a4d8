"""The MQAR source: disjoint vocabularies (keys, values, fillers; one per client and a held-out
one), every label the value its key was paired with, queried keys distinct and past the gap, the
held-out vocabulary in no client's training rows, and accuracy counted per queried value."""

import random

import pytest
import torch

from nestfed.config import ConfigError
from nestfed.data import mqar
from nestfed.data.tasks import IGNORE_INDEX
from nestfed.methods import load_config
from nestfed.nn.backbone import byte_tokenizer


def test_vocabularies_are_disjoint_and_keys_and_values_keep_their_roles():
    tok = byte_tokenizer()
    cand = mqar.single_tokens(tok)
    assert len(cand) == len(set(cand)) == 127  # printable ASCII, then the other ASCII characters
    assert all(len(tok.encode(tok.decode([i]), add_special_tokens=False)) == 1 for i in cand)
    pools, fillers = mqar.vocabularies(tok, 5, 10, 16)
    everything = [t for v in pools for t in v.keys + v.values] + list(fillers)
    assert len(everything) == len(set(everything)) == 5 * 20 + 16
    pos = {t: i for i, t in enumerate(cand)}
    assert all(pos[k] % 2 == 0 for v in pools for k in v.keys)  # keys: even candidates in every pool
    assert all(pos[x] % 2 == 1 for v in pools for x in v.values)
    with pytest.raises(ValueError, match="127 one-token candidates"):
        mqar.vocabularies(tok, 8, 10, 16)


@pytest.mark.parametrize("pairs,queries,gap", [(4, 4, 16), (6, 3, 0), (1, 1, 5)])
def test_every_label_is_the_value_its_key_was_paired_with(pairs, queries, gap):
    (vocab,), fillers = mqar.vocabularies(byte_tokenizer(), 1, 8, 8)
    rng = random.Random(0)
    for _ in range(20):
        ids, labels = mqar.mqar_row(vocab, fillers, pairs, queries, gap, rng, bos=[258])
        assert ids[0] == 258 and len(ids) == len(labels) == 1 + 2 * (pairs + queries) + gap
        kv = dict(zip(ids[1 : 1 + 2 * pairs : 2], ids[2 : 2 + 2 * pairs : 2]))
        assert len(kv) == pairs and set(kv) <= set(vocab.keys) and set(kv.values()) <= set(vocab.values)
        assert all(t in fillers for t in ids[1 + 2 * pairs : 1 + 2 * pairs + gap])
        start = 1 + 2 * pairs + gap
        asked = ids[start::2]
        assert len(asked) == len(set(asked)) == queries  # distinct keys
        marked = [i for i, x in enumerate(labels) if x != IGNORE_INDEX]
        assert marked == list(range(start + 1, len(ids), 2))
        for i in marked:
            assert labels[i] == ids[i] == kv[ids[i - 1]]  # the value paired with the key just asked
            first = ids.index(ids[i - 1])
            assert i - first >= gap + 2  # the pair lies past the gap


def cfg_of(*extra):
    return load_config(
        None,
        [
            "model.name=tiny-llama",
            "strategy.name=fedavg",
            "lora.ranks=[4]",
            "data.source=mqar",
            "data.task=multiple_choice",
            "data.num_clients=3",
            "data.max_train=6",
            "data.max_test=5",
            "mqar.vocab=8",
            *extra,
        ],
    )


def test_clients_train_on_their_own_vocabulary_and_are_tested_on_the_held_out_one_too():
    tok = byte_tokenizer()
    cfg = cfg_of()
    clients, candidates = mqar.mqar_clients(cfg, tok)
    pools, _ = mqar.vocabularies(tok, 4, 8, cfg.section("mqar").fillers)
    assert candidates == [x for v in pools for x in v.values]
    for cid, c in enumerate(clients):
        own, held = pools[cid], pools[-1]
        train = set(c["train"].input_ids.flatten().tolist())
        assert not train & set(held.keys + held.values)  # the held-out vocabulary is never trained on
        for other in pools[:-1]:
            if other is not own:
                assert not train & set(other.keys + other.values)
        assert {g: v.tolist() for g, v in c["groups"].items()} == {"own": [0, 1, 2, 3, 4], "held_out": [5, 6, 7, 8, 9]}
        test = c["test"].input_ids
        assert set(test[5:].flatten().tolist()) & set(held.keys) and not set(test[:5].flatten().tolist()) & set(
            held.keys
        )
        assert int((c["train"].labels != IGNORE_INDEX).sum(1).unique()) == cfg.section("mqar").queries
    again, _ = mqar.mqar_clients(cfg, tok)
    assert torch.equal(again[1]["train"].input_ids, clients[1]["train"].input_ids)  # seeded
    no_held, _ = mqar.mqar_clients(cfg_of("mqar.held_out=false"), tok)
    assert list(no_held[0]["groups"]) == ["own"]


def test_bad_options_name_their_key():
    with pytest.raises(ConfigError, match="mqar.queries: must be in 1..pairs"):
        cfg_of("mqar.queries=5")
    with pytest.raises(ConfigError, match="mqar.vocab: 3 keys cannot fill 4 distinct pairs"):
        cfg_of("mqar.vocab=3")
    with pytest.raises(ConfigError, match="mqar: the tokenizer has 127 one-token candidates"):
        mqar.mqar_client_data(cfg_of("data.num_clients=7", "mqar.vocab=12"), byte_tokenizer())
