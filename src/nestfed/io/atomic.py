"""Atomic, durable file writes that respect the user's umask.

Every file nestfed leaves behind is written here: to a temporary file in the target's folder,
flushed and fsynced, given the mode a plain ``open(path, "w")`` would have given it (0666 minus
the umask; `tempfile.mkstemp` alone leaves 0600), renamed over the target, and the folder
fsynced so the rename survives a power cut. A failure at any point removes the temporary file and
leaves an existing target as it was. Directories (a PEFT adapter) are built beside their target
and renamed into place the same way (mode 0777 minus the umask).

Appends (`append_line`) are the one non-atomic write: a crash mid-append can leave a torn
last line, which readers of such files drop (``federation.run_dir``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save


def current_umask() -> int:
    """Read the process's umask (by setting and restoring it).

    Returns:
        The umask, e.g. 0o022.
    """
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write bytes to a file atomically and durably, mode 0666 & ~umask, creating parent folders.

    Args:
        path: the target file; replaced whole, or left as it was on a failure.
        data: the file's contents.

    Returns:
        ``path``, as a Path.

    Raises:
        OSError: from the file system (the temporary file is removed first).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write text, encoded as UTF-8, atomically (`write_bytes`).

    Args:
        path: the target file.
        text: the file's contents.

    Returns:
        ``path``, as a Path.

    Raises:
        OSError: from the file system.
    """
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> Path:
    """Write an object as indented JSON atomically (`write_text`).

    Args:
        path: the target file.
        obj: what to write (dicts, lists, strings, numbers, booleans, None).

    Returns:
        ``path``, as a Path.

    Raises:
        TypeError: for what JSON cannot hold.
        OSError: from the file system.
    """
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write tensors as a safetensors file, atomically (`write_bytes`).

    Args:
        path: the target file.
        tensors: ``{name: tensor}``, any shapes and dtypes (moved to the CPU).
        metadata: string metadata stored in the file's header; none when None.

    Returns:
        ``path``, as a Path.

    Raises:
        Exception: what safetensors raises for unsupported tensors.
        OSError: from the file system.
    """
    data = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    return write_bytes(path, data)


def write_dir(path: str | Path, build: Callable[[Path], None]) -> Path:
    """Create a directory atomically: build it beside its target, then rename it into place.

    An existing ``path`` is replaced (moved aside, then removed). The folder gets mode 0777 & ~umask
    and its files 0666 & ~umask.

    Args:
        path: the directory to create or replace.
        build: called as ``build(tmp)`` to fill a fresh folder beside ``path``.

    Returns:
        ``path``, as a Path.

    Raises:
        Exception: what ``build`` raises, after removing the folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())
        build(tmp)
        for f in tmp.iterdir():
            if f.is_file():  # what the builder wrote, at the mode a plain open() gives (some writers use 0600)
                os.chmod(f, 0o666 & ~current_umask())
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}-old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)
    return path


def append_line(path: str | Path, line: str) -> None:
    """Append one line to a file and fsync it.

    A crash mid-append can leave a torn last line (no trailing newline): readers must drop it.

    Args:
        path: the file appended to (created when missing).
        line: the line; a newline is added.

    Raises:
        OSError: from the file system.
    """
    path = Path(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())
