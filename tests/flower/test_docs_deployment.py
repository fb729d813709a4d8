"""docs/flower.md's deployment section, run as the page writes it on one machine: every bash block
and its ``config.toml`` block, taken from the page (so they cannot drift), in a folder laid out like
the repository (``.venv`` is this interpreter's environment, not on ``PATH``).

The only changes are the names of places, as the page states: ``localhost`` for
``superlink.example.org`` (the certificate is made for it by the page's own commands), a free port
for 9092, this test's folder for ``/srv/nestfed`` and ``/path/to``, the run id ``flwr run``
printed for ``RUN_ID``, ``K=i`` for the five SuperNodes, and a ClientAppIo port per SuperNode. The
launch blocks of step 5 run in the shell of step 3 (its ``export`` line first), as the page says.
The machine holds SmolLM2 already converted from its GGUF, as any node that has loaded it once does
(the suite's converted folder linked into the test's ``HOME``): else the ServerApp and each of the
five workers would convert it again, 17 s of CPU each.

The smoke test (the main job at a tiny budget on SmolLM2: one round, five nodes over TLS with
SuperNode authentication) finishes with the embedded runner's run directory; the main job's launch
is accepted and ``flwr stop`` cancels it. Beside the five, step 4's command with a key that was
never registered, and without a key, is refused (the SuperLink names the unknown key)."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from nestfed.nn.backbone import convert_builtin, default_cache_dir  # noqa: E402
from nestfed.testing.doc_pages import section_blocks  # noqa: E402
from nestfed.testing.flower_deployment import LocalDeployment, Proc, TLSFiles, free_port  # noqa: E402

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Across machines: the deployment engine"
NODES = 5


class Page:
    """The section's blocks with this machine's names of places."""

    def __init__(self, work: Path, port: int) -> None:
        blocks = section_blocks(ROOT / "docs" / "flower.md", SECTION)
        assert len(blocks["toml"]) == 1 and len(blocks["bash"]) == 7, blocks
        self.toml = self.localise(blocks["toml"][0], work, port)
        (self.certs, self.superlink, self.register, self.supernode, smoke, follow, main) = (
            self.localise(b, work, port) for b in blocks["bash"]
        )
        # step 5 continues in step 3's shell: its first line, the export, comes first
        export = self.register.split("\n")[0]
        assert export.startswith("export PATH="), self.register
        self.smoke, self.follow, self.main = (f"{export}\n{b}" for b in (smoke, follow, main))

    @staticmethod
    def localise(text: str, work: Path, port: int) -> str:
        out = text.replace("superlink.example.org", "localhost").replace("9092", str(port))
        return out.replace("/srv/nestfed", str(work)).replace("/path/to", str(work))

    def node(self, k: int, key: str | None = "keys/node$K") -> str:
        """Step 4 for client k: with its key as the page writes it, another key, or none (None)."""
        assert self.supernode.startswith("K=0 ") and " --auth-supernode-private-key keys/node$K" in self.supernode
        with_port = self.supernode.replace("--node-config", f"--port {free_port()} --node-config")
        auth = "" if key is None else f" --auth-supernode-private-key {key}"
        return f"K={k}" + with_port[len("K=0") :].replace(" --auth-supernode-private-key keys/node$K", auth)


def run_id(stdout: str) -> int:
    """The run id ``flwr run`` printed."""
    found = re.findall(r"\b(\d{6,})\b", stdout)
    assert found, stdout
    return int(found[-1])


def run(commands: str, work: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(
        ["bash", "-e", "-c", commands], cwd=work, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, (commands, r.stdout[-3000:], r.stderr[-3000:])
    return r


def background(d: LocalDeployment, name: str, commands: str, work: Path, env: dict) -> Proc:
    log = d.root / f"{name}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(
            ["bash", "-e", "-c", commands],
            cwd=work,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc = Proc(name, p, log)
    d.procs.append(proc)
    return proc


def test_the_deployment_commands_of_docs_flower_run_as_written(tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parents[1])
    for name in ("flower_app", "configs"):
        (work / name).symlink_to(ROOT / name)
    port = free_port()
    page = Page(work, port)
    d = LocalDeployment(tmp_path / "flower")  # its FLWR_HOME and worker folder; stop() ends what is left
    env = {**d.env, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    env.pop("XDG_CACHE_HOME", None)
    weights = convert_builtin("smollm2-135m", default_cache_dir())  # once for the whole suite
    cache = tmp_path / "home" / ".cache" / "nestfed"
    cache.mkdir(parents=True)
    (cache / weights.name).symlink_to(weights)
    try:
        run(page.certs, work, env)
        (d.home / "config.toml").write_text(page.toml)
        link = background(d, "superlink", page.superlink, work, env)
        certs = work / "certs"
        d.name, d.port = "nestfed", port
        d.tls = TLSFiles(certs / "ca.crt", certs / "server.pem", certs / "server.key")
        d.wait_healthy(link, 60)
        run(page.register, work, env)
        for k in range(NODES):
            background(d, f"supernode-{k}", page.node(k), work, env)
        # beside them, a node whose key was never registered and one with no key: both refused
        run('ssh-keygen -q -t ecdsa -b 384 -N "" -f keys/stranger -C stranger', work, env)
        refused = [
            background(d, "unregistered", page.node(NODES, "keys/stranger"), work, env),
            background(d, "keyless", page.node(NODES + 1, None), work, env),
        ]
        smoke = run_id(run(page.smoke, work, env).stdout)
        follow = run(page.follow.replace("RUN_ID", str(smoke)), work, env, timeout=600).stdout
        assert '"finished:completed"' in follow, follow[-3000:]
        assert len(d.nodes()) == NODES  # the five registered keys, one per SuperNode
        first, stop = page.main.split("\nflwr stop")
        main = run_id(run(first, work, env).stdout)
        run(page.main.split("\n")[0] + "\nflwr stop" + stop.replace("RUN_ID", str(main)), work, env)
        deadline = time.monotonic() + 60
        while (status := d.run_status(main)["status"]) != "finished:stopped" and time.monotonic() < deadline:
            time.sleep(1)
        assert status == "finished:stopped"
        serving = [p for p in d.procs if p not in refused]
        assert all(p.popen.poll() is None for p in serving), [p.tail() for p in serving]  # all still serving
        for p in refused:
            assert p.popen.poll() not in (None, 0), p.tail()
            assert "Failed to activate SuperNode" in p.log.read_text() or "305" in p.log.read_text(), p.tail()
        assert "No SuperNode found with the given public key" in (d.root / "superlink.log").read_text()
    finally:
        d.stop()
    lines = [json.loads(x) for x in (work / "runs" / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [0, 1]
    assert sorted(int(c) for c in lines[1]["clients"]) == list(range(NODES))
    assert all(c["status"] == "accepted" for c in lines[1]["clients"].values())
    adapter = json.loads((work / "runs" / "smoke" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16  # r_max of the main job's ranks 2/4/4/8/16
