"""The processes of a local Flower deployment: ports, environment, run-config values, PEM files.

The pieces `nestfed.testing.flower_deployment.LocalDeployment` starts its SuperLink, SuperNodes and
``flwr`` commands with.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    """Find a TCP port on 127.0.0.1.

    Returns:
        A port that was free a moment ago.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Build the environment for flwr processes: private FLWR_HOME, no telemetry, update check or installs.

    Args:
        home: the FLWR_HOME folder.
        extra: further variables, set last.

    Returns:
        This process's environment with those settings and this interpreter's folder first on PATH.
    """
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
    """Write a run-config value as TOML (for ``flwr run --run-config``).

    flwr reads a quoted value up to the next quote of its kind (no escapes), so a string holding
    double quotes (an override such as ``lora.target_modules=["q_proj","v_proj"]``) travels as a
    TOML literal string in single quotes.

    Args:
        v: a bool, number or string (anything else is written as its str).

    Returns:
        The TOML text.

    Raises:
        ValueError: for a string holding both kinds of quote, or a double quote and a newline, which
            that command line cannot carry.
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
    """A process this deployment started.

    Attributes:
        name: its name (also its log's).
        popen: its Popen handle.
        log: its log file (stdout and stderr).
    """

    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def tail(self, n: int = 30) -> str:
        """Read the end of the log.

        Args:
            n: how many lines.

        Returns:
            Its last n lines; empty when the log cannot be read.
        """
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class TLSFiles:
    """PEM files of a TLS deployment.

    Attributes:
        ca_cert: the CA certificate (SuperNodes and the CLI trust it).
        server_cert: the SuperLink's certificate.
        server_key: the SuperLink's private key.
    """

    ca_cert: Path
    server_cert: Path
    server_key: Path
