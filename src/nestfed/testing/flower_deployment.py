"""A Flower deployment on this machine: a SuperLink and SuperNodes on 127.0.0.1, driven by ``flwr``.

Used by the tests (``tests/flower``) and ``bench/perf/flower_vs_embedded.py``; also a quick way to try
the apps before going to real machines. Everything it starts is a child process started in its
own session; `LocalDeployment.stop` (also on ``with`` exit, on error too) stops each one by
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
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestfed.testing.flower_processes import BIN, Proc, TLSFiles, flwr_env, free_port, toml_value

__all__ = ["BIN", "LocalDeployment", "Proc", "TLSFiles", "flwr_env", "free_port", "toml_value"]


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes on 127.0.0.1 under ``root`` (FLWR_HOME is ``root/flwr_home``).

    Attributes:
        root: the folder of its FLWR_HOME and logs.
        tls: the TLS files; None (default): insecure connections.
        supernode_auth: whether the SuperLink admits only registered SuperNodes (default False).
        env_extra: further environment variables of every process.
        procs: the processes it started, in order.
        port: the SuperLink's port (0 before it starts).
        name: the federation's name in the ``flwr`` CLI's config (default ``local``).
        database: the SuperLink's state: "" (default) in memory (Flower's default), else an SQLite
            file.
        simulation: whether the SuperLink runs Flower's simulation engine (virtual SuperNodes on Ray).
        heartbeat_s: the SuperNodes' heartbeat interval in seconds (at least 10); None (default):
            Flower's 30 s. The SuperLink marks a node offline after two intervals without one, so a
            test that kills a node sets 10 (`nestfed.testing.supernode_heartbeat`).
    """

    root: Path
    tls: TLSFiles | None = None
    supernode_auth: bool = False
    env_extra: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    port: int = 0
    name: str = "local"
    database: str = ""
    simulation: bool = False
    heartbeat_s: int | None = None

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

        Retried on another free port when it exits at once (another process took the port).

        Args:
            timeout_s: how long each attempt waits for /health, in seconds.
            attempts: how many starts it tries.
            same_port: start on the port of the SuperLink started before (a restart the SuperNodes
                reconnect to), and retry on it.

        Returns:
            The SuperLink's process.

        Raises:
            RuntimeError: when the last attempt's SuperLink exits.
            TimeoutError: when it is not healthy within timeout_s.
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
        """Poll the SuperLink's /health until it answers 200.

        Args:
            proc: the SuperLink's process.
            timeout_s: how long to wait, in seconds.

        Raises:
            RuntimeError: when the process exits (the message holds its log's tail).
            TimeoutError: when it is not healthy within timeout_s.
        """
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
        """Start a SuperNode connected to this SuperLink.

        Args:
            node_config: its node config (e.g. {'partition-id': 0}).
            key: its auth private key, or None.
            name: its process name (default ``supernode-<partition-id>``).

        Returns:
            The SuperNode's process.
        """
        cfg = " ".join(f"{k}={toml_value(v)}" for k, v in node_config.items())
        launcher = [str(BIN / "flower-supernode")]
        if self.heartbeat_s is not None:
            launcher = [sys.executable, "-m", "nestfed.testing.supernode_heartbeat", str(self.heartbeat_s)]
        args = [
            *launcher,
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
        """Write ``$FLWR_HOME/config.toml``: the ``flwr`` CLI's connection to this SuperLink."""
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
        """Run the ``flwr`` CLI against this deployment (its FLWR_HOME and connection).

        Args:
            *args: the CLI's arguments.
            timeout_s: the command's time limit, in seconds.
            check: raise when it fails.

        Returns:
            The finished command (stdout and stderr as text).

        Raises:
            RuntimeError: when check is set and it exits non-zero.
        """
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
        """Run the ``flwr`` CLI with ``--format json`` and parse what it prints.

        Args:
            *args: the CLI's arguments.
            timeout_s: the command's time limit, in seconds.

        Returns:
            The parsed JSON.

        Raises:
            RuntimeError: when it prints no JSON.
        """
        res = self.flwr(*args, "--format", "json", timeout_s=timeout_s, check=False)
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(
                f"flwr {' '.join(args)}: no JSON (exit {res.returncode}):\n{res.stdout}\n{res.stderr}"
            ) from None

    def nodes(self) -> list[dict[str, Any]]:
        """List the SuperNodes the SuperLink knows (``flwr supernode list --format json``).

        Returns:
            One record per SuperNode.
        """
        out = self.flwr_json("supernode", "list", self.name)
        return list(out.get("nodes", []))

    def register(self, public_key: Path) -> dict[str, Any]:
        """Register a SuperNode's public key with the SuperLink (``flwr supernode register``).

        Args:
            public_key: the SuperNode's public key file.

        Returns:
            The CLI's JSON answer.
        """
        return self.flwr_json("supernode", "register", str(public_key), self.name)

    def submit(self, app_dir: Path, run_config: dict[str, Any], federation_config: dict[str, Any] | None = None) -> int:
        """Submit a run: ``flwr run APP_DIR`` with run-config overrides.

        Args:
            app_dir: the Flower app's folder.
            run_config: the run-config overrides.
            federation_config: on the simulation engine, its ``--federation-config``
                (``num-supernodes``, ``client-resources-num-cpus``, ``client-resources-num-gpus``, ...).

        Returns:
            The run id (the run goes on).

        Raises:
            RuntimeError: when flwr reports no success.
        """
        rc = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
        extra = []
        if federation_config:
            extra = ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation_config.items())]
        out = self.flwr_json("run", str(app_dir), self.name, "--run-config", rc, *extra)
        if not out.get("success"):
            raise RuntimeError(f"flwr run failed: {out}")
        return int(out["run-id"])

    def run_status(self, run_id: int) -> dict[str, Any]:
        """Read a run's status from the SuperLink's Control API, as ``flwr ls --run-id RID`` does.

        Asked in this process (milliseconds), not through the ``flwr`` CLI, whose start-up costs
        about 1.7 s of CPU a call: the tests poll it.

        Args:
            run_id: the run.

        Returns:
            ``run-id``, ``status`` (e.g. ``finished:completed``, as ``flwr ls --format json``
            writes it) and ``status-details``.

        Raises:
            RuntimeError: when the SuperLink does not know the run.
        """
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest
        from flwr.supercore.control import ControlHttpClient

        root = self.tls.ca_cert.read_bytes() if self.tls is not None else None
        client = ControlHttpClient.from_server_address(f"127.0.0.1:{self.port}", self.tls is None, root, [])
        try:
            res = client.ListRuns(ListRunsRequest(run_id=run_id))
        except Exception as exc:  # httpx's 404 for a run the SuperLink does not know
            raise RuntimeError(f"ListRuns: run {run_id} unknown: {exc}") from None
        finally:
            client.close()
        if run_id not in res.run_dict:
            raise RuntimeError(f"ListRuns: run {run_id} unknown")
        run = run_from_proto(res.run_dict[run_id])
        sub = run.status.sub_status
        return {
            "run-id": str(run_id),
            "status": f"{run.status.status}:{sub}" if sub else run.status.status,
            "status-details": run.status.details,
        }

    def wait_run(self, run_id: int, timeout_s: float = 600.0, poll_s: float = 0.5) -> dict[str, Any]:
        """Poll until the run finishes (``finished:*``).

        Args:
            run_id: the run.
            timeout_s: how long to wait, in seconds.
            poll_s: seconds between polls.

        Returns:
            Its final status record (`run_status`).

        Raises:
            TimeoutError: when it has not finished within timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.run_status(run_id)
            if str(status.get("status", "")).startswith("finished"):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} not finished after {timeout_s} s: {status}")
            time.sleep(poll_s)

    def logs(self, run_id: int) -> str:
        """Read the run's logs as the SuperLink kept them (``flwr log``), for failure reports.

        Args:
            run_id: the run.

        Returns:
            The CLI's stdout and stderr.
        """
        res = self.flwr("log", str(run_id), self.name, "--show", timeout_s=60, check=False)
        return res.stdout + res.stderr

    # -- teardown ------------------------------------------------------------------------------
    @staticmethod
    def stop_proc(proc: Proc, grace_s: float = 5.0) -> None:
        """SIGTERM the process (by PID), wait, then SIGKILL its process group; reap it.

        Args:
            proc: the process.
            grace_s: seconds to wait after SIGTERM, and again after SIGKILL.
        """
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
        """List the live processes of this deployment (their environment holds its FLWR_HOME).

        Read from /proc (Linux).

        Args:
            command: a part of the command line to match, e.g. ``flwr-serverapp`` (which the
                SuperLink's SuperExec starts in a session of its own); "" matches every one.

        Returns:
            Their PIDs, sorted.
        """
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
        """SIGKILL a process and its group at once (a crash, for dropout tests).

        Args:
            proc: the process.
        """
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait(timeout=10)

    def stop(self) -> None:
        """Stop every process this deployment started.

        SuperNodes first, then the SuperLink, then the nodes' workers (their sockets removed, each
        exits within a second of finishing what it is doing; their logs are kept in
        ``root/workers``).
        """
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
