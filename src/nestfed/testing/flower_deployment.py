"""A Flower deployment on this machine: a SuperLink and SuperNodes on 127.0.0.1, driven by ``flwr``.

Used by the tests (``tests/flower``) and ``bench/perf/flower_vs_embedded.py``; also a quick way to try
the apps before going to real machines. Everything it starts is a child process started in its
own session; :meth:`LocalDeployment.stop` (also on ``with`` exit, on error too) stops each one by
its PID: SIGTERM to the process, then SIGKILL to its process group (the ClientApp / ServerApp
processes Flower started under it) after a grace period.

Settings for every process: a private ``FLWR_HOME``, ``FLWR_TELEMETRY_ENABLED=0``,
``FLWR_DISABLE_UPDATE_CHECK=1``, runtime dependency installation disabled, only 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for flwr processes: private FLWR_HOME, no telemetry, no update check, no installs."""
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    env.update(extra or {})
    return env


def toml_value(v: Any) -> str:
    """A run-config value as TOML (for ``flwr run --run-config``).

    flwr reads a quoted value up to the next quote of its kind (no escapes), so a string holding
    double quotes (an override such as ``lora.target_modules=["q_proj","v_proj"]``) travels as a
    TOML literal string in single quotes. Raises ValueError for a string holding both kinds of
    quote, which that command line cannot carry.
    """
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    if '"' not in s:
        return json.dumps(s)
    if "'" in s or "\n" in s:
        raise ValueError(
            f"run-config value {s!r}: flwr run --run-config cannot carry a string with both ' and \" "
            "(or a newline); use the other quote inside it"
        )
    return f"'{s}'"


@dataclass
class Proc:
    """A process this deployment started: its name, Popen handle and log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class TLSFiles:
    """PEM files: the CA certificate (SuperNodes and the CLI trust it) and the SuperLink's cert and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes on 127.0.0.1 under ``root`` (FLWR_HOME is ``root/flwr_home``)."""

    root: Path
    tls: TLSFiles | None = None
    supernode_auth: bool = False
    env_extra: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    port: int = 0
    name: str = "local"
    database: str = ""  # the SuperLink's state: "" = in memory (Flower's default), else an SQLite file
    simulation: bool = False  # the SuperLink runs Flower's simulation engine (virtual SuperNodes on Ray)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.home = self.root / "flwr_home"
        self.home.mkdir(parents=True, exist_ok=True)
        # the nodes' workers (nestfed.flower.worker): a short private folder (a Unix socket path holds
        # at most 107 bytes), named to every process through NESTFED_WORKER_DIR, emptied by stop()
        self.worker_dir = Path(tempfile.mkdtemp(prefix="nestfed-w-"))
        self.env = flwr_env(self.home, {"NESTFED_WORKER_DIR": str(self.worker_dir), **self.env_extra})

    # -- processes -----------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> Proc:
        log = self.root / f"{name}.log"
        f = open(log, "wb")
        try:
            p = subprocess.Popen(
                args,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.root,
                start_new_session=True,
            )
        finally:
            f.close()
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def start_superlink(self, timeout_s: float = 60.0, attempts: int = 3, same_port: bool = False) -> Proc:
        """Start the SuperLink (Fleet, Control and Runtime APIs on one port) and wait for /health.

        Retried on another free port when it exits at once (another process took the port);
        ``same_port``: on the port of the SuperLink started before (a restart the SuperNodes
        reconnect to), retried on it.
        """
        for attempt in range(attempts):
            try:
                return self._start_superlink(timeout_s, same_port and self.port > 0)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_superlink(self, timeout_s: float, same_port: bool = False) -> Proc:
        if not same_port:
            self.port = free_port()
        log_name = (
            "superlink"
            if not any(p.name == "superlink" for p in self.procs)
            else f"superlink-{sum(p.name.startswith('superlink') for p in self.procs)}"
        )
        args = [
            str(BIN / "flower-superlink"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        if self.database:
            args += ["--database", self.database]
        if self.simulation:
            args.append("--simulation")
        if self.tls is None:
            args.append("--insecure")
        else:
            args += [
                "--ssl-ca-certfile",
                str(self.tls.ca_cert),
                "--ssl-certfile",
                str(self.tls.server_cert),
                "--ssl-keyfile",
                str(self.tls.server_key),
            ]
        if self.supernode_auth:
            args.append("--enable-supernode-auth")
        proc = self._start(log_name, args)
        self.write_cli_config()
        self.wait_healthy(proc, timeout_s)
        return proc

    def wait_healthy(self, proc: Proc, timeout_s: float) -> None:
        scheme = "http" if self.tls is None else "https"
        ctx = None
        if self.tls is not None:
            ctx = ssl.create_default_context(cafile=str(self.tls.ca_cert))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"the SuperLink exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/health", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the SuperLink was not healthy within {timeout_s} s:\n{proc.tail()}")

    def start_supernode(self, node_config: dict[str, Any], key: Path | None = None, name: str | None = None) -> Proc:
        """Start a SuperNode with this node config (e.g. {'partition-id': 0}), optionally its auth key."""
        cfg = " ".join(f"{k}={toml_value(v)}" for k, v in node_config.items())
        args = [
            str(BIN / "flower-supernode"),
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--port",
            str(free_port()),
            "--node-config",
            cfg,
        ]
        args += ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca_cert)]
        if key is not None:
            args += ["--auth-supernode-private-key", str(key)]
        return self._start(name or f"supernode-{node_config.get('partition-id', len(self.procs))}", args)

    def write_cli_config(self) -> None:
        """``$FLWR_HOME/config.toml``: the ``flwr`` CLI's connection to this SuperLink."""
        lines = [
            "[superlink]",
            f'default = "{self.name}"',
            "",
            f"[superlink.{self.name}]",
            f'address = "127.0.0.1:{self.port}"',
        ]
        if self.tls is None:
            lines.append("insecure = true")
        else:
            lines.append(f'root-certificates = "{self.tls.ca_cert}"')
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    # -- the flwr CLI --------------------------------------------------------------------------
    def flwr(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI against this deployment (its FLWR_HOME and connection)."""
        res = subprocess.run(
            [str(BIN / "flwr"), *args],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res

    def flwr_json(self, *args: str, timeout_s: float = 120.0) -> dict[str, Any]:
        res = self.flwr(*args, "--format", "json", timeout_s=timeout_s, check=False)
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(
                f"flwr {' '.join(args)}: no JSON (exit {res.returncode}):\n{res.stdout}\n{res.stderr}"
            ) from None

    def nodes(self) -> list[dict[str, Any]]:
        """``flwr supernode list --format json``: the SuperNodes the SuperLink knows."""
        out = self.flwr_json("supernode", "list", self.name)
        return list(out.get("nodes", []))

    def register(self, public_key: Path) -> dict[str, Any]:
        """Register a SuperNode's public key with the SuperLink (``flwr supernode register``)."""
        return self.flwr_json("supernode", "register", str(public_key), self.name)

    def submit(self, app_dir: Path, run_config: dict[str, Any], federation_config: dict[str, Any] | None = None) -> int:
        """``flwr run APP_DIR`` with run-config overrides and, on the simulation engine, its
        ``--federation-config`` (``num-supernodes``, ``client-resources-num-cpus``,
        ``client-resources-num-gpus``, ...); return the run id (the run goes on)."""
        rc = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
        extra = []
        if federation_config:
            extra = ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation_config.items())]
        out = self.flwr_json("run", str(app_dir), self.name, "--run-config", rc, *extra)
        if not out.get("success"):
            raise RuntimeError(f"flwr run failed: {out}")
        return int(out["run-id"])

    def run_status(self, run_id: int) -> dict[str, Any]:
        """The run as ``flwr ls --run-id RID --format json`` reports it (``status``: e.g. finished:completed)."""
        out = self.flwr_json("ls", self.name, "--run-id", str(run_id))
        runs = out.get("runs") or []
        if not runs:
            raise RuntimeError(f"flwr ls: run {run_id} unknown: {out}")
        return runs[0]

    def wait_run(self, run_id: int, timeout_s: float = 600.0, poll_s: float = 2.0) -> dict[str, Any]:
        """Poll until the run finishes (``finished:*``); return its final ``flwr ls`` record."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.run_status(run_id)
            if str(status.get("status", "")).startswith("finished"):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} not finished after {timeout_s} s: {status}")
            time.sleep(poll_s)

    def logs(self, run_id: int) -> str:
        """The run's logs as the SuperLink kept them (``flwr log``), for failure reports."""
        res = self.flwr("log", str(run_id), self.name, "--show", timeout_s=60, check=False)
        return res.stdout + res.stderr

    # -- teardown ------------------------------------------------------------------------------
    @staticmethod
    def stop_proc(proc: Proc, grace_s: float = 5.0) -> None:
        """SIGTERM the process (by PID), wait, then SIGKILL its process group; reap it."""
        p = proc.popen
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # children it started (ServerApp / ClientApp / SuperExec processes), by its group id
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass

    def processes(self, command: str = "") -> list[int]:
        """PIDs of the live processes of this deployment (their environment holds its FLWR_HOME)
        whose command line holds ``command``: e.g. ``flwr-serverapp``, which the SuperLink's
        SuperExec starts in a session of its own. Read from /proc (Linux)."""
        mark = f"FLWR_HOME={self.home}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if mark not in (d / "environ").read_bytes().split(b"\0"):
                    continue
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    continue
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if command in cmd:
                out.append(int(d.name))
        return sorted(out)

    def kill(self, proc: Proc) -> None:
        """SIGKILL a process and its group at once (a crash, for dropout tests)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait(timeout=10)

    def stop(self) -> None:
        """Stop every process this deployment started: SuperNodes first, then the SuperLink, then
        the nodes' workers (their sockets removed, each exits within a second of finishing what it
        is doing; their logs are kept in ``root/workers``)."""
        for proc in reversed(self.procs):
            self.stop_proc(proc)
        deadline = time.monotonic() + 10.0
        while (left := self.processes()) and time.monotonic() < deadline:  # what the SuperLink's SuperExec
            for pid in left:  # started in sessions of their own (a ServerApp), and the nodes' workers
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.2)
        if self.worker_dir.is_dir():
            logs = self.root / "workers"
            for f in self.worker_dir.iterdir():
                if f.suffix == ".log":
                    logs.mkdir(exist_ok=True)
                    shutil.copyfile(f, logs / f.name)
            shutil.rmtree(self.worker_dir, ignore_errors=True)

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
