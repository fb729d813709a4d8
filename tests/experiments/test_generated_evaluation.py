"""A run with a generated evaluation (tiny model, real BBC headlines in the chat template): every
client answers its held-out prompts with the model it runs, the answers and their scores are
written to the run directory, the summary holds them per client, rank group and truncation rank,
and ``nestfed compare`` shows ROUGE-L with intervals over seeds."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nestfed.cli import app
from nestfed.evaluation.generation import Decoding, generate
from nestfed.evaluation.lm import evaluate_lm
from nestfed.evaluation.text_scores import answer_scores
from nestfed.experiments.generated import prompts_and_references, stop_ids
from nestfed.experiments.prepare import prepare
from nestfed.experiments.run import run_method
from nestfed.methods import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "instructions" / "bbc_news.toml"
OVERRIDES = [
    "model.name=tiny-llama",
    "lora.ranks=[2,4,4]",
    'lora.target_modules=["q_proj","v_proj"]',
    "lora.layers=[-1]",
    "data.num_clients=3",
    "data.max_train=4",
    "data.max_test=3",
    "data.block_size=160",
    "train.local_steps=2",
    "train.batch_size=2",
    "federation.rounds=1",
    "generation.rows=2",
    "generation.max_new_tokens=6",
    "generation.ranks=[2,4]",
    "output.truncations=[2,4]",
    "output.plots=false",
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.slow
def test_a_run_writes_its_generations_and_scores(tmp_path):
    cfg = load_config(CONFIG, [*OVERRIDES, f"output.dir={tmp_path}"])
    s = run_method(prepare(cfg), cfg, tmp_path / "run")
    g = s["generation"]
    assert g["template"] == "chat" and set(g["clients"]) == {"0", "1", "2"}
    lines = [json.loads(x) for x in (tmp_path / "run" / "generations" / "final.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 2 and {x["client"] for x in lines} == {0, 1, 2}
    topics = cfg.generation.verbaliser
    for x in lines:  # each answer's own scores, recomputed from what was written
        assert x["prompt"].startswith("<|im_start|>user\n") and x["prompt"].endswith("<|im_start|>assistant\n")
        kind = "topic" if x["reference"] in topics else "headline"
        assert ("Which topic" in x["prompt"]) == (kind == "topic") and x["reference"]
        want = answer_scores(x["answer"], x["reference"], topics)
        assert {k: x[k] for k in want} == want and (("accuracy" in x) == (kind == "topic"))
    c0 = [x for x in lines if x["client"] == 0]
    assert {x["reference"] in topics for x in c0} == {True, False}  # both kinds on every client
    heads = [x["rouge_l"] for x in c0 if "rouge_l" in x]
    assert g["clients"]["0"]["rouge_l"] == pytest.approx(sum(heads) / len(heads))
    assert g["clients"]["0"]["ppl"] > 1 and g["clients"]["0"]["answers"] == 2
    assert set(g["by_rank"]) == {"2", "4"} and "half" in g["all"]["rouge_l"]
    assert set(g["truncation"]) == {"2", "4"}
    assert (tmp_path / "run" / "generations" / "rank2.jsonl").is_file()


@pytest.mark.slow
def test_compare_shows_rouge_l_over_seeds(tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "run",
            str(CONFIG),
            "--methods",
            "prelort,zeropad",
            "--seeds",
            "2",
            *[x for o in [*OVERRIDES, f"output.dir={tmp_path}"] for x in ("--set", o)],
        ],
    )
    assert res.exit_code == 0, res.output
    assert "ROUGE-L" in res.output
    md = next(tmp_path.rglob("comparison.md")).read_text()
    assert "ROUGE-L" in md and "vs prelort" in md


FEDSLM = [
    "compression.client_ratios=[0.3,0.5,0.7]",
    "compression.train_layers=[-1]",
    "compression.server_blocks=3",
    "elicitation.steps=2",
    "elicitation.batch_size=2",
]


@pytest.mark.slow
def test_fedslm_clients_answer_with_their_compressed_models(tmp_path):
    """Each FedSLM client answers with its group's SVD-compressed model and trained cores: its
    answers are what that model generates one prompt at a time, the references' perplexity is that
    model's (not the backbone's), and the scores are summarised per model group."""
    cfg = load_config(CONFIG, [*OVERRIDES, *FEDSLM, f"output.dir={tmp_path}", "strategy.name=fedslm"])
    prep = prepare(cfg)
    s = run_method(prep, cfg, tmp_path / "run")
    g = s["generation"]
    assert set(g["by_rank"]) == {"group 0", "group 1", "group 2"} and "truncation_skipped" in g
    (setup,) = prep.cache["compressed"].values()
    tok = prep.backbone.tokenizer
    lines = [json.loads(x) for x in (tmp_path / "run" / "generations" / "final.jsonl").read_text().splitlines()]
    decoding = Decoding(cfg.generation.max_new_tokens, 0.0, 1.0, 0)
    for cid, d in sorted(prep.data.items()):
        model = setup.models[setup.client_group[cid]]  # holds the cores the client answered with
        prompts, _, idx = prompts_and_references(d, cfg.generation.rows, tok)
        mine = [x["answer"] for x in lines if x["client"] == cid]
        one_by_one = [generate(model, [p], decoding, stop_ids(tok), tok.pad_token_id, 1)[0] for p in prompts]
        assert mine == [tok.decode(o, skip_special_tokens=True).strip() for o in one_by_one]
        sel = torch.tensor(idx)
        ppl = evaluate_lm(model, d.test_labels[sel], d.test_ids[sel])["ppl"]
        assert g["clients"][str(cid)]["ppl"] == pytest.approx(ppl, rel=1e-5)
        assert evaluate_lm(prep.backbone.model, d.test_labels[sel], d.test_ids[sel])["ppl"] != pytest.approx(ppl)
