"""Output files: where one may be written, and writing it so that a failure replaces nothing.

The CLI checks its outputs with ``check_writable`` before any work and stages several at once
under ``staging_name`` (graphc/cli.py, ``_write_all``); the Python API writes one file at a
time through ``replace_file`` (``Weights.save``, ``DecodeStep.profile``). No torch here: the
CLI imports this before anything heavy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .errors import GraphcError


def staging_name(path: Path) -> Path:
    """The temporary name beside ``path`` that an output is written under before it is renamed
    onto ``path``."""
    return path.with_name(f".{path.name}.graphc-{os.getpid()}.partial")


def check_writable(path: Path, what: str, folder: bool = False) -> None:
    """Refuse, naming why, a ``path`` that cannot be written as a file (``folder``: created or
    written into as a folder) for ``what``: the wrong kind of thing there, no permission, or a
    file where a folder on the way must be. Folders on the way that do not exist yet pass (the
    CLI creates them)."""
    if path.exists():
        if path.is_dir() != folder:
            raise GraphcError(f"{what} {path}: " + ("that is a folder; give a file name" if not folder
                                                    else "a file of that name is in the way" if path.is_file()
                                                    else "a device, a pipe or a socket, not a folder"))
        if not folder and not path.is_file():
            # An output is renamed into place, which would replace a device or a pipe with a
            # regular file (as root, /dev/null itself).
            raise GraphcError(f"{what} {path}: not a regular file (a device, a pipe or a socket); "
                              f"give a file name")
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise GraphcError(f"{what} {path}: this user cannot " + ("write into it" if folder else "overwrite it"))
        return
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise GraphcError(f"{what} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GraphcError(f"{what} {path}: this user cannot write into {existing}")


def output_file(path, what: str) -> Path:
    """``path`` as a Path once ``replace_file`` could write it there: a path (not empty) whose
    folder exists (the Python API creates none) and that ``check_writable`` accepts. For callers
    that check before long work (``DecodeStep.profile``)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise GraphcError(f"{what}: expected the path of a file to write, found {path!r:.60}")
    path = Path(path)
    if not path.parent.is_dir():
        raise GraphcError(f"{what} {path}: the folder {path.parent} does not exist")
    check_writable(path, what)
    return path


def replace_file(path: str | os.PathLike, write: Callable[[Path], None], what: str) -> Path:
    """Call ``write(tmp)`` on ``staging_name(path)``, then rename it onto ``path``: a write that
    fails half-way (a full disk) leaves no truncated file and replaces nothing. Refuses first what
    ``output_file`` refuses."""
    path = output_file(path, what)
    tmp = staging_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as e:       # OSError, or the writer's own (safetensors' SafetensorError)
        raise GraphcError(f"{what} {path}: cannot write it ({getattr(e, 'strerror', None) or e}); "
                          f"nothing was written or replaced") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
