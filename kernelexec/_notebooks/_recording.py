"""Recording a session as a notebook: every run becomes a code cell, saved atomically."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import keyword
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import filelock
import nbformat
from nbformat import NotebookNode

from kernelexec._exceptions import ConfigError, NotebookError
from kernelexec._tools._tool import Tool

KEY = "kernelexec"
"""The metadata key (cell and notebook) under which kernelexec keeps what it recorded."""

ERROR_TAG = "raises-exception"
"""nbclient/nbconvert keep running past a cell with this tag when it raises."""

_MAX_RETURN_IN_META = 10_000
_KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


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
    return repr(value)


def call_source(name: str, args: dict[str, Any]) -> str:
    """The Python call ``name(a=1, b='x')`` for JSON ``args``."""
    if all(k.isidentifier() and not keyword.iskeyword(k) for k in args):
        inner = ", ".join(f"{k}={python_literal(v)}" for k, v in args.items())
    else:
        inner = f"**{python_literal(args)}"
    return f"{name}({inner})"


def now_iso() -> str:
    """The current UTC time in ISO 8601 with milliseconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


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
    try:
        nb = nbformat.read(str(path), as_version=4)
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such file") from None
    except Exception as exc:
        raise NotebookError(f"{path} is not a readable notebook: {exc}") from None
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        raise NotebookError(f"{path} is not a valid notebook: {exc.message}") from None
    return nb


class SessionRecorder:
    """Keeps one session's notebook and rewrites its file after every run.

    Args:
        agent_id: The session's agent id (kept in the notebook metadata and every cell).
        path: The ``.ipynb`` file, or ``None`` to keep the notebook in memory only. An existing
            kernelexec notebook at that path is continued, never overwritten.
        fingerprint: The environment's fingerprint, kept in the notebook metadata.
        env: The environment as JSON (``LocalEnv``/``VenvEnv`` dumped), so replay can rebuild it.
    """

    def __init__(
        self,
        agent_id: str,
        path: Path | None,
        fingerprint: str,
        env: dict[str, Any] | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.path = path
        self._defined: dict[str, str] = {}  # tool name -> digest of the recorded definition
        self.generation = 0  # counts the kernels the session has had
        self._recorded_generation = -1  # the kernel of the last recorded cell
        self._lock: filelock.FileLock | None = None
        self._cell_json: list[str] = []  # each recorded cell, serialised once
        if path is not None:
            # Two writers of one file would each drop the other's cells: one recorder a file.
            lock = filelock.FileLock(str(path.parent / f".{path.name}.lock"), thread_local=False)
            try:
                lock.acquire(timeout=0)
            except filelock.Timeout:
                raise ConfigError(
                    f"{path} is being recorded by another session (another executor or "
                    "process with the same record_dir and agent id)"
                ) from None
            self._lock = lock
        try:
            self.notebook = self._load_or_create(fingerprint, env or {"kind": "local"})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another session record to this file (the notebook stays as saved)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _load_or_create(self, fingerprint: str, env: dict[str, Any]) -> NotebookNode:
        if self.path is not None and self.path.exists():
            try:
                nb = read_notebook(self.path)
            except NotebookError as exc:
                raise ConfigError(
                    f"cannot continue the recording {self.path}: it is not a valid notebook "
                    f"({exc}); move it away or choose another record_dir"
                ) from None
            if KEY not in nb.metadata:
                raise ConfigError(
                    f"{self.path} exists and was not written by kernelexec; not overwriting it"
                )
            return nb
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = dict(_KERNELSPEC)
        nb.metadata["language_info"] = {"name": "python"}
        nb.metadata[KEY] = {
            "agent_id": self.agent_id,
            "env_fingerprint": fingerprint,
            "env": env,
            "created": now_iso(),
        }
        return nb

    def kernel_started(self, language_info: dict[str, Any] | None = None) -> None:
        """Note that the session got a fresh kernel (its state starts empty)."""
        self.generation += 1
        if language_info:
            self.language_info(language_info)

    def language_info(self, info: dict[str, Any]) -> None:
        """Keep the kernel's ``language_info`` in the notebook metadata."""
        self.notebook.metadata["language_info"] = info

    def _fresh_kernel(self, fields: dict[str, Any]) -> bool:
        """Whether this run is the first recorded one on its kernel (then replay restarts)."""
        generation = int(fields.get("kernel_generation", self.generation))
        fresh = generation != self._recorded_generation
        if fresh:
            self._recorded_generation = generation
            self._defined.clear()
        return fresh

    def _meta(
        self, kind: str, fields: dict[str, Any], started: str, timeout: float, fresh: bool
    ) -> dict[str, Any]:
        error = fields.get("error")
        meta: dict[str, Any] = {
            "kind": kind,
            "agent_id": self.agent_id,
            "status": fields["status"],
            "error_kind": error.kind if error is not None else None,
            "duration_s": round(float(fields.get("duration_s", 0.0)), 6),
            "started": started,
            "finished": now_iso(),
            "timeout_s": timeout,
            "fresh_kernel": fresh,
        }
        return meta

    def _cell(
        self, source: str, outputs: list[Any], count: int | None, meta: dict[str, Any]
    ) -> NotebookNode:
        cell = nbformat.v4.new_code_cell(source=source)
        cell.outputs = [nbformat.from_dict(o) for o in outputs]
        cell.execution_count = count
        cell.metadata[KEY] = meta
        if meta["status"] == "error":
            cell.metadata["tags"] = [ERROR_TAG]
        return cell

    def add_code(self, code: str, fields: dict[str, Any], started: str, timeout: float) -> None:
        """Record a ``run_code`` run."""
        meta = self._meta("code", fields, started, timeout, self._fresh_kernel(fields))
        error = fields.get("error")
        if error is not None and error.kind == "env_setup_failed":
            why = error.evalue.splitlines()[0] if error.evalue else error.kind
            commented = "\n".join(f"# {line}" for line in code.splitlines())
            meta["status"] = "not_run"
            source = f"# not run ({error.kind}: {why}):\n{commented}"
            self.notebook.cells.append(self._cell(source, [], None, meta))
            return
        count = fields.get("execution_count")
        self.notebook.cells.append(self._cell(code, fields["outputs"], count, meta))

    def add_tool_call(
        self,
        tool: Tool,
        args: dict[str, Any],
        fields: dict[str, Any],
        started: str,
        timeout: float,
        agent_state: Any = None,
    ) -> None:
        """Record a tool call: the tool's definition (when new or changed), then the call."""
        error = fields.get("error")
        rejected = error is not None and error.kind in ("invalid_args", "env_setup_failed")
        fresh = self._fresh_kernel(fields)
        if not rejected and self._defined.get(tool.name) != tool.digest:
            definition = nbformat.v4.new_code_cell(source=tool.source_code)
            definition.metadata[KEY] = {
                "kind": "tool_definition",
                "agent_id": self.agent_id,
                "tool": tool.name,
                "digest": tool.digest,
                "pip_requirements": list(tool.pip_requirements),
                "fresh_kernel": fresh,
            }
            self.notebook.cells.append(definition)
            self._defined[tool.name] = tool.digest
            fresh = False
        call_args = dict(args)
        if tool.takes_agent_state:
            call_args["agent_state"] = state_json(agent_state)
        source = call_source(tool.name, call_args)
        meta = self._meta("tool_call", fields, started, timeout, fresh)
        meta["tool"] = tool.name
        meta["args"] = args
        value = fields.get("func_return")
        if len(json.dumps(value, ensure_ascii=False, default=str)) <= _MAX_RETURN_IN_META:
            meta["func_return"] = value
        else:
            meta["func_return_omitted"] = True  # too big; the cell's output shows it
        if rejected:
            # The tool never ran: keep the call for the audit but do not re-run it.
            assert error is not None
            why = error.evalue.splitlines()[0] if error.evalue else error.kind
            source = f"# not run ({error.kind}: {why}):\n# {source}"
            meta["status"] = "not_run"
            self.notebook.cells.append(self._cell(source, [], None, meta))
            return
        count = fields.get("execution_count")
        self.notebook.cells.append(self._cell(source, fields["outputs"], count, meta))

    def save(self) -> None:
        """Write the notebook to its file atomically (no-op when kept in memory).

        Recorded cells never change, so each is serialised once and kept; a save joins the
        pieces. ``nbformat.writes`` re-validates and re-encodes the whole notebook every time
        (52 ms at 500 cells, measured), which made a recorded call cost more with every call.
        """
        if self.path is None:
            return
        cells = self.notebook.cells
        for cell in cells[len(self._cell_json) :]:
            self._cell_json.append(_indented(_dumps(cell), "  "))
        metadata = _indented(_dumps(self.notebook.metadata), " ").lstrip()
        text = (
            '{\n "cells": [\n'
            + ",\n".join(self._cell_json)
            + f'\n ],\n "metadata": {metadata},\n'
            + f' "nbformat": {self.notebook.nbformat},\n'
            + f' "nbformat_minor": {self.notebook.nbformat_minor}\n}}\n'
        )
        write_atomic(self.path, text)


def _dumps(value: Any) -> str:
    # nbformat's own layout: one-space indent, sorted keys, unicode kept.
    return json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False)


def _indented(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.split("\n"))


def state_json(agent_state: Any) -> Any:
    """The JSON data of an agent state, as the recording shows it."""
    dump = getattr(agent_state, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    return json.loads(json.dumps(agent_state, default=str))
