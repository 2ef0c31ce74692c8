"""Writing one output file so that a failure replaces nothing: ``replace_file``.

The CLI stages several outputs at once (graphc/cli.py, ``_write_all``); the Python API writes
one file at a time (``Weights.save``, ``DecodeStep.profile``) through this.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .errors import GraphcError


def check_writable(path, what: str) -> Path:
    """``path`` as a Path once it could be written by ``replace_file``: a GraphcError naming
    ``what`` for an empty or non-path value, a folder that does not exist, and a path that is a
    folder, a device or a pipe. For callers that check before long work (``DecodeStep.profile``)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise GraphcError(f"{what}: expected the path of a file to write, found {path!r:.60}")
    path = Path(path)
    if not path.parent.is_dir():
        raise GraphcError(f"{what} {path}: the folder {path.parent} does not exist")
    if path.exists() and not path.is_file():
        raise GraphcError(f"{what} {path}: not a regular file (a folder, a device or a pipe); nothing was written")
    return path


def replace_file(path: str | os.PathLike, write: Callable[[Path], None], what: str) -> Path:
    """Call ``write(tmp)`` on a temporary name beside ``path``, then rename it onto ``path``:
    a write that fails half-way (a full disk) leaves no truncated file and replaces nothing.
    Refuses, as a GraphcError naming ``what`` and the path, a folder that does not exist and
    a path that is a folder, a device or a pipe."""
    path = check_writable(path, what)
    tmp = path.with_name(f".{path.name}.graphc-{os.getpid()}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as e:       # OSError, or the writer's own (safetensors' SafetensorError)
        raise GraphcError(f"{what} {path}: cannot write it ({getattr(e, 'strerror', None) or e}); "
                          f"nothing was written or replaced") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
