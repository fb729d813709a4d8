"""``nestfed eval``: run directories to models, intervals and paired differences by hand, the table,
the cache of scored models, and one-line errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from nestfed.errors import NestfedError
from nestfed.experiments import general_nlp

pytest.importorskip("lm_eval")

from tests.tiny_eval import save_tiny, write_mmlu  # noqa: E402


def _result(correct: dict[str, list[int]]) -> dict:
    return {"correct": {"generation": correct, "loglik": correct}}


def test_rows_by_hand():
    results = {
        "backbone": _result({"stem": [1, 0, 1, 0], "humanities": [0, 0]}),
        "prelort": _result({"stem": [1, 1, 1, 0], "humanities": [0, 1]}),
    }
    rows = {(r["model"], r["scoring"]): r for r in general_nlp.rows(results)}
    b, p = rows[("backbone", "generation")], rows[("prelort", "generation")]
    assert b["categories"]["stem"]["accuracy"] == 50.0 and p["categories"]["stem"]["accuracy"] == 75.0
    assert p["categories"]["humanities"]["accuracy"] == 50.0
    assert b["average"] == 25.0 and p["average"] == 62.5
    # Wilson interval of 3/4 at 95%: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    z, n, ph = 1.959963984540054, 4, 0.75
    centre, half = ph + z * z / (2 * n), z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n))
    low, high = p["categories"]["stem"]["interval"]
    assert low == pytest.approx(100 * (centre - half) / (1 + z * z / n))
    assert high == pytest.approx(100 * (centre + half) / (1 + z * z / n))
    # paired differences over the six questions: [0, 100, 0, 0, 0, 100] -> mean 33.33, sd 51.64, t(5) = 2.5706
    vs = p["vs_backbone"]
    sd = math.sqrt(sum((d - 100 / 3) ** 2 for d in [0, 100, 0, 0, 0, 100]) / 5)
    assert vs["mean"] == pytest.approx(100 / 3)
    assert vs["high"] - vs["mean"] == pytest.approx(2.570581835636314 * sd / math.sqrt(6))
    assert not vs["significant"] and "vs_backbone" not in b


def _fake_run(root: Path, method: str, base: Path, adapter: Path) -> Path:
    run = root / method
    run.mkdir(parents=True)
    (run / "config.toml").write_text(f'[strategy]\nname = "{method}"\n\n[model]\nname = "{base}"\n')
    shutil.copytree(adapter, run / "adapter")
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base)
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    return run


@pytest.mark.slow
def test_nestfed_eval_prints_the_table_and_reuses_scores(tmp_path, cli):
    base, adapter = save_tiny(tmp_path)
    mmlu = write_mmlu(tmp_path / "mmlu", n=1)
    parent = tmp_path / "runs" / "job"
    _fake_run(parent, "prelort", base, adapter)
    res = cli("eval", parent, "--mmlu", mmlu, "--batch-size", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| backbone |" in res.stdout and "| prelort |" in res.stdout
    assert "leaderboard" not in res.stdout  # not SmolLM2: no leaderboard rows
    table = json.loads((parent / "eval" / "flowertune_general_nlp.json").read_text())
    assert {(r["model"], r["scoring"]) for r in table} == {
        (m, s) for m in ("backbone", "prelort") for s in ("generation", "loglik")
    }
    assert all(r["categories"]["stem"]["n"] == 19 for r in table)
    assert all("vs_backbone" in r for r in table if r["model"] == "prelort")
    again = cli("eval", parent / "prelort", "--mmlu", mmlu, "--batch-size", "4", cwd=tmp_path)
    assert again.returncode == 0 and again.stderr.count("scored before") == 2  # backbone and prelort
    shrunk = cli("eval", parent / "prelort", "--mmlu", mmlu, "--fraction", "0.5", "--categories", "stem", cwd=tmp_path)
    assert shrunk.returncode == 0 and "scored before" not in shrunk.stderr and "humanities" not in shrunk.stdout


def test_eval_errors_name_the_run(tmp_path, cli):
    base, adapter = save_tiny(tmp_path)
    run = _fake_run(tmp_path / "runs", "fednl", base, adapter)
    shutil.rmtree(run / "adapter")
    res = cli("eval", run, "--mmlu", tmp_path, cwd=tmp_path)
    assert res.returncode != 0 and f"{run}: no PEFT adapter" in res.stdout + res.stderr
    res = cli("eval", tmp_path / "nothing", cwd=tmp_path)
    assert res.returncode != 0 and "no such run directory" in res.stdout + res.stderr
    with pytest.raises(NestfedError, match="not a Hugging Face directory"):
        other = _fake_run(tmp_path / "r2", "prelort", base, adapter)
        cfg = json.loads((other / "adapter" / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = str(tmp_path / "gone")
        (other / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
        general_nlp.models([other])


def test_a_malformed_run_config_or_adapter_config_is_one_line_naming_the_file(tmp_path, cli):
    base, adapter = save_tiny(tmp_path)
    run = _fake_run(tmp_path / "runs", "prelort", base, adapter)
    (run / "adapter" / "adapter_config.json").write_text("{not json")
    res = cli("eval", run, cwd=tmp_path)
    assert res.returncode == 2 and f"{run / 'adapter' / 'adapter_config.json'}: not a PEFT adapter config" in res.stderr
    (run / "config.toml").write_text("[strategy\n")
    res = cli("eval", run, cwd=tmp_path)
    assert res.returncode == 2 and f"{run / 'config.toml'}: invalid TOML" in res.stderr


def test_the_score_cache_keys_on_contents_not_paths(tmp_path):
    from nestfed.evaluation import harness

    def tree(root: Path, answer: str, weights: bytes) -> tuple[Path, Path]:
        (root / "mmlu" / "test").mkdir(parents=True)
        (root / "mmlu" / "test" / "anatomy_test.csv").write_text(f"q,a,b,c,d,{answer}\n")
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text("{}")
        (root / "model" / "model.safetensors").write_bytes(weights)
        return root / "mmlu", root / "model"

    def key(mmlu: Path, model: Path) -> str:
        return general_nlp._key(model, None, harness.Protocol(mmlu_root=str(mmlu)))

    first = key(*tree(tmp_path / "a", "A", b"w1"))
    assert key(*tree(tmp_path / "b", "A", b"w1")) == first  # the same contents elsewhere: the same key
    assert key(*tree(tmp_path / "c", "B", b"w1")) != first  # an edited answer key
    assert key(*tree(tmp_path / "d", "A", b"w2")) != first  # other weights behind the same config.json


@pytest.mark.slow
def test_a_run_on_the_built_in_tiny_model_is_evaluated_from_its_written_out_directory(tmp_path, cli, monkeypatch):
    """The tiny random model has no directory: eval writes it out once (the run's model.seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nestfed.nn.backbone import byte_tokenizer, tiny_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = Path(__file__).resolve().parents[2]
    sets = [f"output.dir={tmp_path / 'runs'}", "federation.rounds=1", "model.seed=3", "output.plots=false"]
    r = cli("run", root / "configs" / "tiny.toml", *[x for s in sets for x in ("--set", s)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    run = next((tmp_path / "runs").iterdir())
    base, pairs = general_nlp.models([run])
    assert base == tmp_path / "cache" / "nestfed" / "tiny" / "tiny-llama-seed3"
    loaded = AutoModelForCausalLM.from_pretrained(base).state_dict()
    built = tiny_model("llama", len(byte_tokenizer()), seed=3).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in built.items())  # the run's backbone, exactly
    mmlu = write_mmlu(tmp_path / "mmlu", n=1)
    res = cli("eval", run, "--mmlu", mmlu, "--batch-size", "4", "--categories", "stem", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| prelort |" in res.stdout


def test_the_git_hash_lm_eval_records_is_asked_quietly_outside_a_repository(tmp_path, monkeypatch, capfd):
    from nestfed.evaluation.harness import quiet_git_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert quiet_git_hash() is None
    assert capfd.readouterr().err == ""  # git's "fatal: not a git repository" stays off the terminal
