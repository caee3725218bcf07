"""Notebook files: reading and validating them, writing them atomically, naming them, and
writing JSON values as Python source for recorded calls."""

from __future__ import annotations

import contextlib
import hashlib
import keyword
import math
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelexec._exceptions import NotebookError
from kernelexec._json import int_text, parse_int

if TYPE_CHECKING:
    from nbformat import NotebookNode

KEY = "kernelexec"
"""The metadata key (cell and notebook) under which kernelexec keeps what it recorded."""

ERROR_TAG = "raises-exception"
"""nbclient/nbconvert keep running past a cell with this tag when it raises."""


def safe_filename(agent_id: str) -> str:
    """A file name (without suffix) for ``agent_id``; different ids never share one.

    Ids made only of ``[A-Za-z0-9._-]`` (and not starting with a dot) are used as they are;
    others get the unsafe characters replaced and a short hash of the real id appended.
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", agent_id)[:80]
    if agent_id and cleaned == agent_id and not agent_id.startswith("."):
        return agent_id
    digest = hashlib.sha256(agent_id.encode()).hexdigest()[:8]
    return f"{cleaned.lstrip('.') or 'agent'}-{digest}"


def python_literal(value: Any) -> str:
    """Python source that evaluates to the JSON value ``value`` (big ints and unicode exact)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, dict):
        items = ", ".join(f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items())
        return "{" + items + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool):
        return int_text(value)
    return repr(value)


def call_source(name: str, args: dict[str, Any], *, awaited: bool = False) -> str:
    """The Python call ``name(a=1, b='x')`` for JSON ``args``; ``await name(...)`` when
    ``awaited`` (an ``async def`` tool: IPython runs top-level await on the kernel's loop)."""
    if all(k.isidentifier() and not keyword.iskeyword(k) for k in args):
        inner = ", ".join(f"{k}={python_literal(v)}" for k, v in args.items())
    else:
        inner = f"**{python_literal(args)}"
    call = f"{name}({inner})"
    return f"await {call}" if awaited else call


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves the old or the new file, whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_notebook(path: str | Path) -> NotebookNode:
    """Read and validate a notebook, raising :class:`NotebookError` with the reason."""
    import nbformat  # here: importing it (and jsonschema) costs up to a second

    try:
        # parse_int: a recorded integer may be longer than this process's digit limit.
        nb = nbformat.read(str(path), as_version=4, parse_int=parse_int)
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such file") from None
    except Exception as exc:
        raise NotebookError(f"{path} is not a readable notebook: {exc}") from None
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        raise NotebookError(f"{path} is not a valid notebook: {exc.message}") from None
    return nb
