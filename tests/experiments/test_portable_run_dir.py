"""A run made with relative paths works from any other folder: its config records each path
resolved (and as written), so resume, export and PEFT's own loader find the model and the data."""

import json
from pathlib import Path

import pytest

from nestfed.nn.backbone import byte_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


@pytest.mark.slow
def test_a_run_with_relative_paths_resumes_exports_and_loads_from_another_folder(tmp_path, cli):
    import torch
    from peft import AutoPeftModelForCausalLM

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "models").mkdir(parents=True)
    (work / "data").mkdir()
    elsewhere.mkdir()
    tok = byte_tokenizer()
    tiny_model("llama", len(tok)).save_pretrained(work / "models" / "my-llama")
    tok.save_pretrained(work / "models" / "my-llama")
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"It is {i}."} for i in range(16)]
    (work / "data" / "alpaca.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    sets = [
        "model.name=models/my-llama",
        "data.source=instructions",
        "data.path=data/alpaca.jsonl",
        "data.task=instruction",
        "data.partition=iid",
        "data.num_clients=2",
        "lora.ranks=[2,4]",
        "federation.rounds=1",
        "output.dir=runs",
        "output.plots=false",
    ]
    r = cli("run", str(TINY), *[x for s in sets for x in ("--set", s)], cwd=work)
    assert r.returncode == 0, r.stderr[-2000:]
    run = next((work / "runs").iterdir())
    text = (run / "config.toml").read_text()
    model_dir = (work / "models" / "my-llama").resolve()
    assert f'name = "{model_dir}"  # given as "models/my-llama"' in text
    assert f'path = "{(work / "data" / "alpaca.jsonl").resolve()}"  # given as "data/alpaca.jsonl"' in text
    assert 'name = "tiny-llama"' not in text
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(model_dir)

    # from another folder: continue it, export it, load it in PEFT (which reads base_model_name_or_path)
    r = cli("run", "--resume", str(run), "--set", "federation.rounds=2", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rounds = 2" in (run / "config.toml").read_text()  # rewritten by the resume, the given paths kept
    assert f'name = "{model_dir}"  # given as "models/my-llama"' in (run / "config.toml").read_text()
    r = cli("export", str(run), "--rank", "2", "--out", str(elsewhere / "r2"), cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-2000:]
    model = AutoPeftModelForCausalLM.from_pretrained(str(run / "adapter"))
    assert Path(model.peft_config["default"].base_model_name_or_path) == model_dir
    ids = torch.tensor([[5, 6, 7]])
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_built_in_model_name_stays_a_name_and_a_missing_path_keeps_its_text(tmp_path, monkeypatch):
    from nestfed import methods

    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    cfg = methods.load_config(TINY, ["data.path=texts"])
    assert cfg.model.name == "tiny-llama" and dict(cfg.given) == {"data.path": "texts"}
    assert cfg.data.path == str((tmp_path / "texts").resolve())
    cfg = methods.load_config(TINY, ["data.path=gone"])  # for the error that names it as written
    assert cfg.data.path == "gone" and dict(cfg.given) == {}
