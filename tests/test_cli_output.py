"""Per-round progress reaches a pipe as the rounds happen, not when the run ends: the real command
is held before round 2's checkpoint until round 1's line has been read from the pipe. Its stderr
is a pipe too (the lines go there), or a terminal (then they go to stdout, the bar to the terminal)."""

import os
import pty
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"

#: the command, held before it writes round 2's checkpoint until the file GATE exists (at most 120 s)
HELD = """
import os, sys, time
from pathlib import Path
from nestfed.io import atomic
real = atomic.write_tensors
def held(path, *a, **k):
    if Path(path).name == "round_002.safetensors":
        t0 = time.time()
        while not os.path.exists(os.environ["GATE"]) and time.time() - t0 < 120:
            time.sleep(0.05)
    return real(path, *a, **k)
atomic.write_tensors = held
from nestfed.cli import main
sys.argv = ["nestfed"] + sys.argv[1:]
main()
"""


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _drain(fd: int) -> None:
    """Read a pseudo-terminal until it closes (the bar's updates must not fill it)."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("stderr", ["pipe", "terminal"])
def test_round_lines_reach_a_pipe_while_the_run_goes_on(tmp_path, stderr):
    (tmp_path / "held.py").write_text(HELD)
    gate = tmp_path / "go"
    env = dict(os.environ, GATE=str(gate), COLUMNS="120", PYTHONPATH=str(ROOT / "src"))
    args = [sys.executable, str(tmp_path / "held.py"), "run", str(TINY), "--set", f"output.dir={tmp_path / 'runs'}"]
    args += ["--set", "federation.rounds=2", "--set", "data.num_clients=2", "--set", "lora.ranks=[2,4]"]
    args += ["--set", "output.plots=false", "--set", "train.threads=1"]
    master = None
    if stderr == "pipe":
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watched = proc.stderr
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    else:
        master, slave = pty.openpty()
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        watched = proc.stdout
        threading.Thread(target=_drain, args=(master,), daemon=True).start()
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(watched, lines), daemon=True).start()
    seen = []
    try:
        while True:
            line = lines.get(timeout=120)
            assert line is not None, f"the output ended without round 1's line: {seen}"
            seen.append(line)
            if line.startswith("prelort round 1/2: mean held-out ppl"):
                break
        assert proc.poll() is None  # the run is held in round 2: the line came while it went on
        assert not any("round 2/2" in s for s in seen)
    finally:
        gate.touch()
        proc.wait(timeout=300)
        if master is not None:
            os.close(master)
    assert proc.returncode == 0


@pytest.mark.parametrize("columns", [80, 140])
def test_help_text_is_rewrapped_to_the_terminal_not_broken_at_source_lines(columns):
    """Every line of a command's description but its last is filled to the panel's width: a line
    broken where the docstring's source line breaks would stop short."""
    env = dict(os.environ, COLUMNS=str(columns), PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "nestfed.cli", "--help"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if "Commands" in ln) + 1
    panel = [ln.strip("│").rstrip() for ln in lines[start:] if ln.startswith("│")]
    entries: list[list[str]] = []
    for ln in panel:
        if ln[:10].strip():  # a command's name starts an entry
            entries.append([ln])
        else:
            entries[-1].append(ln)
    width = max(len(ln) for ln in panel)
    assert [e[0].split()[0] for e in entries] == ["run", "compare", "export", "eval", "methods"]
    for e in entries:
        assert all(len(ln) >= width - 20 for ln in e[:-1]), e
