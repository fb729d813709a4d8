"""The server text: held out from every client's train blocks and test records."""

from pathlib import Path

import pytest

from nestfed import methods
from nestfed.data import partition
from nestfed.data.clients import build_client_data, load_partitions
from nestfed.data.corpora import Document
from nestfed.data.held_out import consumed_texts, load_server_text, server_pools, server_text
from nestfed.data.templates import example_text
from nestfed.errors import ConfigError, DataError
from nestfed.nn.backbone import byte_tokenizer, load_backbone

ROOT = Path(__file__).resolve().parents[2]


def test_consumed_texts_hand_computed():
    tok = byte_tokenizer()  # one token per byte, plus one eos per text
    texts = ["abcd", "efghij", "k", "lmnop"]  # 5, 7, 2, 6 tokens with eos: cumulative 5, 12, 14, 20
    assert consumed_texts(texts, tok, block_size=4, max_blocks=1) == 1  # 4 tokens: the first text
    assert consumed_texts(texts, tok, block_size=4, max_blocks=3) == 2  # 12 tokens exactly
    assert consumed_texts(texts, tok, block_size=13, max_blocks=1) == 3
    assert consumed_texts(texts, tok, block_size=100, max_blocks=1) == 4  # never filled: all used
    bos = byte_tokenizer(bos=True)  # each block: BOS + 4 stream tokens
    assert consumed_texts(texts, bos, block_size=5, max_blocks=3) == 2  # 12 stream tokens, as above
    assert consumed_texts(texts, bos, block_size=5, max_blocks=1) == 1


def test_pools_exclude_every_used_record_and_fill_blocks():
    tok = byte_tokenizer()
    records = [Document("x" * 30 + str(i), "a") for i in range(10)] + [
        Document("y" * 30 + str(i), "b") for i in range(10)
    ]
    parts = [list(range(10)), list(range(10, 20))]
    pools = server_pools(records, parts, 0.2, 0, tok, block_size=16, max_train=4)  # 64 tokens: 2 texts of 31 + eos
    for cid, (idx, pool) in enumerate(zip(parts, pools)):
        train, test = partition.train_test_split(idx, 0.2, 0 + cid)
        assert pool == train[2:]
        assert not set(pool) & set(test)
    ds = server_text(records, pools, tok, block_size=16, blocks=3)
    assert tuple(ds.input_ids.shape) == (3, 16)
    with pytest.raises(DataError, match="held-out blocks"):
        server_text(records, pools, tok, block_size=16, blocks=40)


@pytest.mark.slow
def test_bbc_server_text_shares_no_block_with_any_client():
    cfg = methods.load_config(
        None, ["model.name='tiny-llama'", "data.block_size=32", "data.max_train=4", "data.max_test=2"]
    )
    tok = byte_tokenizer()
    loaded = load_partitions(cfg.data)
    data, _ = build_client_data(cfg, tok, loaded)
    server = load_server_text(cfg, tok, blocks=10, loaded=loaded)
    assert tuple(server.input_ids.shape) == (10, 32)
    client_rows = {tuple(r.tolist()) for d in data.values() for t in (d.train_ids, d.test_ids) for r in t}
    assert not any(tuple(r.tolist()) in client_rows for r in server.input_ids)
    with pytest.raises(ConfigError, match="multiple_choice"):
        load_server_text(methods.replace_config(cfg, data={"task": "multiple_choice"}), tok, 4, loaded)


def test_instruction_server_text_packs_only_records_no_client_uses_in_the_runs_template():
    cfg = methods.load_config(
        ROOT / "configs" / "instructions" / "bbc_news.toml",
        [
            "model.name=tiny-llama",
            "data.block_size=160",
            "data.max_train=4",
            "data.max_test=2",
            "data.num_clients=3",
            "lora.ranks=[2,4,4]",
        ],
    )
    tok = load_backbone(cfg.model).tokenizer
    loaded = load_partitions(cfg.data)
    records, _, parts = loaded
    pools = server_pools(records, parts, cfg.data.test_fraction, cfg.data.seed, tok, 160, 4, "instruction")
    for cid, (idx, pool) in enumerate(zip(parts, pools)):
        train, test = partition.train_test_split(idx, cfg.data.test_fraction, cfg.data.seed + cid)
        assert pool == train[4:]  # one row per record: the first max_train train records are the client's
    server = load_server_text(cfg, tok, blocks=6, loaded=loaded)
    assert tuple(server.input_ids.shape) == (6, 160)
    text = tok.decode(server.input_ids.flatten())
    first = records[pools[0][0]]
    exchange = example_text(tok, "chat", first.instruction, first.input, first.output)
    assert exchange.startswith("<|im_start|>user\n") and f"<|im_start|>assistant\n{first.output}" in exchange
    assert exchange.startswith(tok.decode(server.input_ids[0])[:-4])  # the pool's first record opens the text
    used = {r.output for cid, idx in enumerate(parts) for r in (records[i] for i in idx if i not in pools[cid])}
    assert not any(o in text for o in used if len(o) > 20)
