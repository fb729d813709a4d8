"""Kill the real command at its write points (SIGKILL, no cleanup), resume it with --resume: the
final adapter is the uninterrupted run's, byte for byte, and every round keeps exactly one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nestfed.federation.run_files import RunFiles

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
ARGS = [
    "--set",
    "federation.rounds=2",
    "--set",
    "data.num_clients=3",
    "--set",
    "lora.ranks=[2,4,8]",
    "--set",
    "train.threads=1",
    "--set",
    "output.plots=false",
    "--set",
    "output.name=k",
]

KILLER = """
import os, signal, sys
from pathlib import Path
from nestfed.io import atomic
AT, n = int(os.environ["KILL_AT"]), [0]
def wrap(name, real):
    def f(path, arg, *a):
        n[0] += 1
        if n[0] == AT:
            if name == "append_line":  # die mid-append: half a line, no newline
                with open(path, "a") as fh:
                    fh.write(arg[: len(arg) // 2])
            elif name == "write_bytes":  # die before the rename: a half-written temporary file
                p = Path(path)
                (p.parent / f".{p.name}-killed.tmp").write_bytes(arg[: len(arg) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, arg, *a)
    return f
for name in ("write_bytes", "append_line", "write_dir"):
    setattr(atomic, name, wrap(name, getattr(atomic, name)))
from nestfed.cli import main
sys.argv = ["nestfed"] + sys.argv[1:]
main()
"""


def nestfed(tmp, *args, kill_at=None):
    env = dict(os.environ, COLUMNS="200")
    if kill_at is None:
        cmd = [sys.executable, "-m", "nestfed.cli", *args]
    else:
        (tmp / "killer.py").write_text(KILLER)
        env["KILL_AT"] = str(kill_at)
        cmd = [sys.executable, str(tmp / "killer.py"), *args]
    return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run's directory, run once for every kill point (it is the same run)."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = nestfed(tmp, "run", str(TINY), "--set", f"output.dir={tmp / 'ref'}", *ARGS)
    assert ref.returncode == 0, ref.stderr[-2000:]
    (ref_dir,) = list((tmp / "ref").iterdir())
    return ref_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_at,where",
    [
        (4, "mid-append of round 1's line"),
        (5, "writing round 1's checkpoint, its line already written"),
        (8, "exporting the adapter after the last round"),
    ],
)
def test_a_killed_run_resumes_to_the_same_adapter(tmp_path, reference, kill_at, where):
    killed = nestfed(tmp_path, "run", str(TINY), "--set", f"output.dir={tmp_path / 'cut'}", *ARGS, kill_at=kill_at)
    assert killed.returncode == -9, (where, killed.stderr[-2000:])
    (run_dir,) = list((tmp_path / "cut").iterdir())
    assert not (run_dir / "summary.json").exists()
    spent = sum(ln.get("time_s", 0.0) for ln in RunFiles(run_dir).read_metrics())  # the committed rounds' time
    resumed = nestfed(tmp_path, "run", "--resume", str(run_dir))
    assert resumed.returncode == 0, (where, resumed.stderr[-2000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["wall_time_before_resume_s"] == pytest.approx(spent) and summary["wall_time_s"] > spent
    assert (spent > 0) == (kill_at > 4), where  # killed mid-append of round 1: no round committed before
    for f in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json"):
        assert (run_dir / f).read_bytes() == (reference / f).read_bytes(), (where, f)
    rounds = [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2], where
