"""The command line: bad input is one line, exit code 2, and no run directory; a tiny run works.

Most cases call the entry point in this process (``cli`` fixture: the same ``main`` the installed
command runs, its exit code and output captured); a few run the real command in a subprocess."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nestfed.nn.backbone import byte_tokenizer, tiny_model
from tests.interruption import interrupted_in_round

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def nestfed(*args, cwd):
    """The installed command in a subprocess."""
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "nestfed.cli", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--set", "strategy.name=fedsgd"], "strategy.name: unknown method 'fedsgd'"),
        (["--set", "lora.ranks=[2,4,x]"], "lora.ranks"),
        (["--set", "lora.ranks=[2,4,4,8,64]", "--set", "lora.r_max=16"], "above the global maximum lora.r_max = 16"),
        (["--set", "train.nonsense=1"], "unknown key 'train.nonsense'"),
        (
            ["--set", "data.source=mmlu", "--set", "data.path=/does/not/exist"],
            "data.path: /does/not/exist does not exist",
        ),
        (["--methods", "prelort,magic"], "--methods: unknown method 'magic'"),
        (
            ["--set", "data.num_clients=6", "--set", "lora.ranks=[2,2,4,4,8,16]"],
            "data.client_labels: 6 clients but only 5 labels (business, entertainment, politics, sport, tech); list "
            "the labels of each client, or set data.partition = 'iid' (records without labels, e.g. an Alpaca file)",
        ),
        (
            ["--set", "robust.rule=trimmed_mean", "--set", "robust.trim_fraction=0.6"],
            "robust.trim_fraction must be in [0, 0.5)",
        ),
        (["--set", "robust.rule=krum", "--set", "robust.byzantine=2"], "robust.byzantine: Krum tolerates f byzantine"),
        (["--set", "privacy.mode=central"], "privacy.clip_norm: differential privacy needs a clip norm"),
        (["--set", "attack.kind=scale", "--set", "attack.clients=[9]"], "attack.clients: client 9 does not exist"),
        (
            ["--set", "strategy.name=flora", "--set", "robust.rule=median"],
            "robust.rule: flora cannot aggregate robustly",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_run_dir(tmp_path, cli, args, needle):
    r = cli("run", str(TINY), "--set", f"output.dir={tmp_path / 'runs'}", *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_malformed_data_file_names_the_file(tmp_path, cli):
    bad = tmp_path / "alpaca.json"
    bad.write_text('[{"instruction": "x", "output": "y"}, {"instruction": ')
    r = cli(
        "run",
        str(TINY),
        "--set",
        f"output.dir={tmp_path / 'runs'}",
        "--set",
        "data.source=instructions",
        "--set",
        f"data.path={bad}",
        "--set",
        "data.task=instruction",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "alpaca.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_config_file(tmp_path):
    r = nestfed("run", str(tmp_path / "missing.toml"), cwd=tmp_path)
    assert r.returncode == 2 and "missing.toml: config file not found" in r.stderr


def test_a_model_nestfed_cannot_compute_exactly_is_one_line_before_any_run_dir(tmp_path, cli):
    """A Gemma-3 whose logits are soft-capped (a switch nestfed's logit paths do not apply)."""
    model = tiny_model("gemma3", len(byte_tokenizer(bos=True)))
    model.config.final_logit_softcapping = 30.0
    model.save_pretrained(tmp_path / "capped")
    byte_tokenizer(bos=True).save_pretrained(tmp_path / "capped")
    r = cli(
        "run",
        str(TINY),
        "--set",
        f"output.dir={tmp_path / 'runs'}",
        "--set",
        f"model.name={tmp_path / 'capped'}",
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert "Gemma3ForCausalLM sets final_logit_softcapping = 30.0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_an_unexpected_error_prints_no_locals(tmp_path):
    """A bug (here: a loss that raises) is a traceback of code lines only, never of local variables."""
    script = (
        "import sys, torch.nn.functional as F\n"
        "def boom(*a, **k):\n    raise RuntimeError('boom')\n"
        "F.cross_entropy = boom\n"
        "from nestfed.cli import main\nmain()\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "run",
            str(TINY),
            "--set",
            f"output.dir={tmp_path / 'runs'}",
            "--set",
            "federation.rounds=1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        timeout=600,
    )
    assert r.returncode == 1 and "RuntimeError: boom" in r.stderr
    assert "locals" not in r.stderr and len(r.stderr.splitlines()) < 300


@pytest.mark.slow
def test_tiny_run_writes_a_complete_run_directory_and_compare_reads_it(tmp_path, cli):
    runs = tmp_path / "runs"
    r = nestfed(
        "run",
        str(TINY),
        "--set",
        f"output.dir={runs}",
        "--set",
        "federation.rounds=1",
        "--set",
        "output.name=cmp",
        "--methods",
        "prelort,flora",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    parent = next(runs.iterdir())
    assert parent.name.startswith("cmp-")
    for method in ("prelort", "flora"):
        d = parent / method
        for f in (
            "config.toml",
            "metrics.jsonl",
            "summary.json",
            "checkpoints/round_001.safetensors",
            "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors",
            "plots/eval_ppl.png",
            "plots/bytes.png",
        ):
            assert (d / f).is_file(), f"{method}/{f}"
        s = json.loads((d / "summary.json").read_text())
        assert s["method"] == method and s["rounds"] == 1
    assert (parent / "comparison.png").is_file() and "prelort" in (parent / "comparison.md").read_text()
    assert "prelort" in r.stdout and "flora" in r.stdout
    c = cli("compare", str(parent / "prelort"), str(parent / "flora"), "--plot", str(tmp_path / "c.png"), cwd=tmp_path)
    assert c.returncode == 0, c.stderr
    assert (tmp_path / "c.png").is_file() and "backbone" in c.stdout


@pytest.mark.slow
def test_a_run_of_many_clients_reads_by_rank_group_and_writes_small_files(tmp_path, cli):
    """120 clients over the 20 Newsgroups sample's blocks, 12 sampled per round, a panel of 5: the
    preparation is one line of counts, the table has a column per rank group (none per client), the
    metrics lines stay small, and the per-client numbers are in their own files."""
    runs = tmp_path / "runs"
    sets = [
        "data.num_clients=120",
        "data.partition=iid",
        "data.unit=block",
        "data.source=newsgroups",
        "lora.ranks=[2]",
        "population.rank_shares={2=0.5,8=0.5}",
        "federation.fraction=0.1",
        "federation.rounds=2",
        "evaluation.clients=5",
        "train.client_cache=off",
        f"output.dir={runs}",
    ]
    r = cli("run", str(TINY), *[x for s in sets for x in ("--set", s)], "--methods", "prelort,local_only", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prepared 120 clients in" in r.stderr and "clients per rank 2: 60, 8: 60" in r.stderr
    assert "c0 rank" not in r.stderr and "c119" not in r.stdout
    assert "r=2" in r.stdout and "r=8" in r.stdout and "median" in r.stdout
    parent = next(runs.iterdir())
    run = parent / "prelort"
    assert max(len(x) for x in (run / "metrics.jsonl").read_text().splitlines()) < 8000
    assert len((run / "clients.csv").read_text().splitlines()) == 121
    assert json.loads((run / "summary.json").read_text())["rank_counts"] == {"2": 60, "8": 60}
    assert "r=2 mean" in (parent / "comparison.md").read_text()


@pytest.mark.slow
def test_resume_after_interruption_gives_the_same_adapter(tmp_path, cli):
    runs = tmp_path / "runs"
    args = [
        "run",
        str(TINY),
        "--set",
        f"output.dir={runs}",
        "--set",
        "federation.rounds=2",
        "--set",
        "data.num_clients=2",
        "--set",
        "lora.ranks=[2,4]",
        "--set",
        "strategy.name=hetlora",
    ]
    assert cli(*args, "--set", "output.name=full", cwd=tmp_path).returncode == 0
    assert cli(*args, "--set", "output.name=cut", cwd=tmp_path).returncode == 0
    full, cut = sorted(runs.glob("full-*"))[0], sorted(runs.glob("cut-*"))[0]
    interrupted_in_round(cut, 2)  # "cut" as a crash during round 2 leaves it
    r = cli("run", "--resume", str(cut), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    a = (full / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (cut / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b
    assert len((cut / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_instruction_and_multiple_choice_tasks_run(tmp_path, cli):
    data = tmp_path / "dolly.jsonl"
    rows = [
        {
            "instruction": f"Say the number {i}.",
            "context": "",
            "response": f"The number is {i}.",
            "category": ["open_qa", "brainstorming"][i % 2],
        }
        for i in range(24)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    r = cli(
        "run",
        str(TINY),
        "--set",
        f"output.dir={tmp_path / 'a'}",
        "--set",
        "data.source=instructions",
        "--set",
        f"data.path={data}",
        "--set",
        "data.task=instruction",
        "--set",
        "data.num_clients=2",
        "--set",
        "lora.ranks=[2,4]",
        "--set",
        "federation.rounds=1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(next((tmp_path / "a").glob("*/summary.json")).read_text())
    assert set(s["client_labels"].values()) == {"brainstorming", "open_qa"}
    mmlu = Path(__file__).resolve().parents[2] / "shared" / "data" / "mmlu"
    if not mmlu.is_dir():
        pytest.skip("no MMLU copy")
    r = cli(
        "run",
        str(TINY),
        "--set",
        f"output.dir={tmp_path / 'b'}",
        "--set",
        "data.source=mmlu",
        "--set",
        f"data.path={mmlu}",
        "--set",
        "data.task=multiple_choice",
        "--set",
        "data.num_clients=2",
        "--set",
        'data.client_labels=[["astronomy"], ["virology", "nutrition"]]',
        "--set",
        "data.block_size=256",
        "--set",
        "lora.ranks=[2,4]",
        "--set",
        "federation.rounds=1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(next((tmp_path / "b").glob("*/summary.json")).read_text())
    assert 0.0 <= s["mean_accuracy"] <= 1.0 and "accuracy" in s["final"]["0"]
    assert s["client_labels"] == {"0": "astronomy", "1": "nutrition+virology"}


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--set", "lora.ranks=[a,b]"], "lora.ranks[0]: expected an integer, got '[a,b]'"),
        (["--set", "federaton.rounds=2"], "unknown section '[federaton]'"),
        (["--set", "federation.min_clients=6"], "federation.min_clients = 6 is above the 5 clients sampled per round"),
        (
            ["--set", "lora.ranks=[100000]"],
            "lora.ranks: rank 100000 exceeds 32, the smallest adapted layer's min(out, in)",
        ),
        (["--set", "train.lr=nan"], "train.lr: expected a finite number, got nan"),
        (
            [
                "--set",
                "strategy.name=fednl",
                "--set",
                "lora.ranks=[4]",
                "--set",
                'lora.target_modules=["q_proj"]',
                "--set",
                "fednl.layers=[7]",
            ],
            "fednl.layers: index 7 out of range for 2 layers",
        ),
    ],
)
def test_errors_keep_their_words_and_model_checks_come_before_any_file(tmp_path, cli, args, needle):
    r = cli("run", str(TINY), "--set", f"output.dir={tmp_path / 'runs'}", *args, cwd=tmp_path)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert "Traceback" not in r.stderr and len(errors) == 1 and errors[0] == r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists()


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, cli):
    bad = tmp_path / "latin.toml"
    bad.write_bytes("[output]\nname = 'caf\xe9'\n".encode("latin-1"))
    r = cli("run", str(bad), cwd=tmp_path)
    assert r.returncode == 2 and "latin.toml: not UTF-8 text" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_resume_refuses_what_the_run_directory_does_not_describe(tmp_path, cli):
    runs = tmp_path / "runs"
    r = cli("run", str(TINY), "--set", f"output.dir={runs}", "--set", "federation.rounds=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir = next(runs.iterdir())
    (run_dir / "summary.json").unlink()  # unfinished again
    r = cli("run", "--resume", str(run_dir), "--set", "train.lr=0.5", cwd=tmp_path)
    assert r.returncode == 2 and "a resumed run keeps its config; these differ: train.lr: 0.001 -> 0.5" in r.stderr
    text = (run_dir / "config.toml").read_text()  # a hand edit of config.toml: the checkpoint recorded the config
    (run_dir / "config.toml").write_text(text.replace('name = "prelort"', 'name = "zeropad"', 1))
    r = cli("run", "--resume", str(run_dir), cwd=tmp_path)
    assert r.returncode == 2 and "strategy.name: 'prelort' -> 'zeropad'" in r.stderr, r.stderr[-2000:]
    (run_dir / "config.toml").write_text(text)
    more = cli(
        "run",
        "--resume",
        str(run_dir),
        "--set",
        "train.lr=0.001",
        "--set",
        "federation.rounds=2",
        "--set",
        "tracking.tensorboard=true",
        cwd=tmp_path,
    )  # restating a value is fine, so are
    assert more.returncode == 0, more.stderr[-2000:]  # extending the run and adding a tracking sink
    assert "config.toml now has federation.rounds: 1 -> 2" in more.stderr
    assert "config.toml now has tracking.tensorboard: False -> True" in more.stderr
    assert any((run_dir / "tensorboard").iterdir())
    assert "rounds = 2" in (run_dir / "config.toml").read_text()
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    (run_dir / "summary.json").unlink()
    for p in (run_dir / "checkpoints").iterdir():
        p.unlink()
    r = cli("run", "--resume", str(run_dir), cwd=tmp_path)
    assert r.returncode == 2 and "no checkpoint to resume from" in r.stderr and "Traceback" not in r.stderr
    (run_dir / "checkpoints" / "round_001.safetensors").write_bytes(b"\x00" * 40)
    r = cli("run", "--resume", str(run_dir), cwd=tmp_path)
    assert r.returncode == 2 and "round_001.safetensors: not a readable nestfed checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--methods", ","], "--methods: unknown method ''"),
        (["--methods", "prelort,prelort"], "--methods: 'prelort' is listed twice"),
        (["--set", "model.dtype=int8"], "model.dtype: 'int8' is not a floating dtype"),
        (["--set", "lora.lora_alpha=0"], "lora.lora_alpha must be > 0"),
        (["--set", "data.max_train=0"], "data.max_train and data.max_test must be >= 1"),
        (["--set", "federation.rounds=0"], "federation.rounds=0: federation.rounds must be >= 1"),
    ],
)
def test_more_bad_input_found_by_trying_it(tmp_path, cli, args, needle):
    r = cli("run", str(TINY), "--set", f"output.dir={tmp_path / 'runs'}", *args, cwd=tmp_path)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_resume_refuses_a_config_or_methods_beside_it_and_compare_dedupes(tmp_path, cli):
    r = cli("run", str(TINY), "--set", f"output.dir={tmp_path / 'runs'}", "--set", "federation.rounds=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir = next((tmp_path / "runs").iterdir())
    for extra in (["--methods", "zeropad"], [str(TINY)]):
        r = cli("run", *extra, "--resume", str(run_dir), cwd=tmp_path)
        assert r.returncode == 2 and "--resume runs the run directory's own config" in r.stderr
    c = cli("compare", str(run_dir), str(run_dir), cwd=tmp_path)
    assert c.returncode == 0 and (tmp_path / "comparison.png").is_file()
    # one row in the comparison table and one in the truncation table: the run is counted once
    assert c.stdout.count("│ prelort") == 1 and c.stdout.count("| prelort |") == 1, c.stdout


@pytest.mark.slow
def test_seeds_run_every_method_per_seed_and_report_intervals(tmp_path, cli):
    runs = tmp_path / "runs"
    r = cli(
        "run",
        str(TINY),
        "--set",
        f"output.dir={runs}",
        "--set",
        "federation.rounds=1",
        "--set",
        "output.name=s",
        "--methods",
        "prelort,zeropad,local_only",
        "--seeds",
        "2",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    parent = next(runs.iterdir())
    for seed in (0, 1):
        for m in ("prelort", "zeropad", "local_only"):
            cfg = (parent / f"seed{seed}" / m / "config.toml").read_text()
            assert f"seed = {seed}" in cfg and (parent / f"seed{seed}" / m / "summary.json").is_file()
    md = (parent / "comparison.md").read_text()
    assert "±" in md and "reference" in md and "r = 16" in md
    for name in ("comparison.png", "truncation.png", "dimension_importance.png"):
        assert (parent / name).is_file()
    rows = json.loads((parent / "comparison.json").read_text())
    assert sorted((r["label"], r["seed"]) for r in rows) == [
        (m, s) for m in ("local_only", "prelort", "zeropad") for s in (0, 1)
    ]
    # the two seeds drew different batches and initialisations
    ppl = {(r["label"], r["seed"]): r["mean_ppl"] for r in rows}
    assert ppl[("prelort", 0)] != ppl[("prelort", 1)]
    # a campaign interrupted in seed 1's zeropad run (seed 1's local_only never started) resumes
    # both from the parent: the one from its directory, the other from the config the campaign
    # recorded before its first run; compare reads the parent over seeds
    assert sorted(str(q.relative_to(parent / "campaign")) for q in (parent / "campaign").rglob("*.toml")) == [
        f"seed{s}/{m}.toml" for s in (0, 1) for m in ("local_only", "prelort", "zeropad")
    ]
    (parent / "seed1" / "zeropad" / "summary.json").unlink()
    never_started = parent / "seed1" / "local_only"
    shutil.rmtree(never_started)
    r = cli("run", "--resume", str(parent), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (parent / "seed1" / "zeropad" / "summary.json").is_file()
    assert (never_started / "summary.json").is_file() and "seed = 1" in (never_started / "config.toml").read_text()
    assert len(json.loads((parent / "comparison.json").read_text())) == 6
    c = cli(
        "compare",
        str(parent),
        "--reference",
        "zeropad",
        "--plot",
        str(tmp_path / "c.png"),
        "--table",
        str(tmp_path / "c.md"),
        cwd=tmp_path,
    )
    assert c.returncode == 0 and "reference" in c.stdout and (tmp_path / "c_truncation.png").is_file()
    assert "| zeropad |" in (tmp_path / "c.md").read_text() and len(json.loads((tmp_path / "c.json").read_text())) == 6
    bad = cli("compare", str(parent), "--reference", "magic", cwd=tmp_path)
    assert bad.returncode == 2 and "--reference: 'magic'" in bad.stderr
    assert cli("run", str(TINY), "--seeds", "0", cwd=tmp_path).returncode == 2


@pytest.mark.slow
def test_compare_of_one_run_twice_is_one_line(tmp_path, cli):
    """Two copies of one run (label, seed and every field alike) cannot be paired by seed: one line
    naming the fix, exit 2, no traceback. Runs that differ in a field are labelled by it instead
    (tests/experiments/test_report_labels.py)."""
    r = cli("run", str(TINY), "--set", f"output.dir={tmp_path / 'r'}", "--set", "federation.rounds=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    a = next((tmp_path / "r").iterdir())
    shutil.copytree(a, tmp_path / "copy")
    r = cli("compare", str(a), str(tmp_path / "copy"), "--plot", str(tmp_path / "c.png"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "(the same run twice?); give each run once" in r.stderr.strip().splitlines()[-1]


def test_methods_lists_every_method_in_aligned_columns(tmp_path, cli):
    from nestfed import methods

    r = cli("methods", cwd=tmp_path)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == list(methods.REGISTRY)
    where = {ln.index(" flower ") if " flower " in ln else ln.index(" embedded only ") for ln in lines}
    assert len(where) == 1  # the third column starts at one offset, past the longest name and sections


def test_methods_name_shows_the_options_with_defaults_and_meaning(tmp_path, cli):
    r = cli("methods", "prelort", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if "prelort.min_holders" in ln)
    assert row.split("│")[2].strip() == "0" and "held by fewer clients" in row
    r = cli("methods", "fednl", cwd=tmp_path)
    row = next(ln for ln in r.stdout.splitlines() if "fednl.rule_lr" in ln)
    assert row.split("│")[2].strip() == "0.01"
    r = cli("methods", "fedsgd", cwd=tmp_path)
    assert r.returncode == 2 and "methods: unknown method 'fedsgd' (known: prelort, zeropad" in r.stderr


def _without_times(obj):
    """A metrics line without its wall-clock fields (they differ between any two runs)."""
    if isinstance(obj, dict):
        return {k: _without_times(v) for k, v in obj.items() if "time" not in k and k != "timing"}
    return [_without_times(v) for v in obj] if isinstance(obj, list) else obj


@pytest.mark.slow
@pytest.mark.parametrize("method,ranks", [("fedavg", "[4,4]"), ("prelort", "[2,4]")])
def test_a_finished_run_continued_for_more_rounds_equals_one_run_of_them_all(tmp_path, cli, method, ranks):
    import torch

    from nestfed.federation.run_dir import RunDir

    runs = tmp_path / "runs"
    args = [
        "run",
        str(TINY),
        "--set",
        f"output.dir={runs}",
        "--set",
        "data.num_clients=2",
        "--set",
        f"lora.ranks={ranks}",
    ]
    args += ["--set", f"strategy.name={method}", "--set", "output.plots=false"]
    assert cli(*args, "--set", "federation.rounds=4", "--set", "output.name=four", cwd=tmp_path).returncode == 0
    assert cli(*args, "--set", "federation.rounds=2", "--set", "output.name=two", cwd=tmp_path).returncode == 0
    four, two = sorted(runs.glob("four-*"))[0], sorted(runs.glob("two-*"))[0]
    r = cli("run", "--resume", str(two), cwd=tmp_path)  # nothing more asked: refused, saying how to continue
    assert r.returncode == 2 and "has finished (summary.json exists); --set federation.rounds=N" in r.stderr
    r = cli("run", "--resume", str(two), "--set", "federation.rounds=4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "config.toml now has federation.rounds: 2 -> 4" in r.stderr
    assert (four / "adapter/adapter_model.safetensors").read_bytes() == (
        two / "adapter/adapter_model.safetensors"
    ).read_bytes()
    for rnd in range(5):  # every round's global arrays, bit for bit
        a, b = (RunDir(d).load_checkpoint(d / "checkpoints" / f"round_{rnd:03d}.safetensors") for d in (four, two))
        assert list(a.state.arrays) == list(b.state.arrays)  # in the same order
        assert all(torch.equal(a.state.arrays[k], b.state.arrays[k]) for k in a.state.arrays)
    # a continuation that crashed during round 4 (the round-2 summary.json still there) resumes as it is
    summary_two = (two / "summary.json").read_text()
    interrupted_in_round(two, 4)
    (two / "summary.json").write_text(summary_two)
    r = cli("run", "--resume", str(two), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    adapter = "adapter/adapter_model.safetensors"
    assert (four / adapter).read_bytes() == (two / adapter).read_bytes()
    lines = [
        [_without_times(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (four, two)
    ]
    assert [x["round"] for x in lines[1]] == [0, 1, 2, 3, 4]
    for x, y in zip(*lines):  # losses, evaluations, bytes equal; an update's norm (a float64 sum whose
        for c in x.get("clients", {}):  # reduction order follows the thread pool) to the last bits
            assert x["clients"][c].pop("update_norm") == pytest.approx(y["clients"][c].pop("update_norm"), rel=1e-12)
        assert x == y
