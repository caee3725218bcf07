"""Recording a session as a notebook: every finished run becomes a code cell, saved atomically.

The recorder is an observer of the session (``run_finished``): it gets each run as a frozen
:class:`~kernelexec._models.RunRecord` and never drives the session.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock

from kernelexec import _json
from kernelexec._exceptions import ConfigError, NotebookError
from kernelexec._models import RunRecord, now_iso
from kernelexec._notebooks._io import ERROR_TAG, KEY, call_source, read_notebook, write_atomic
from kernelexec._protocol._host import state_json

if TYPE_CHECKING:
    from nbformat import NotebookNode

log = logging.getLogger("kernelexec")

_MAX_RETURN_IN_META = 10_000
_KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


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
        import nbformat  # only when recording: see kernelexec._notebooks._io.read_notebook

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

    async def run_finished(self, record: RunRecord) -> str | None:
        """Record a finished run and save the file (off the event loop).

        Returns:
            None when the run was saved (or the notebook is kept in memory only), else why the
            save failed (disk full, permissions): the caller's result says so
            (``recording_error``). The notebook stays complete in memory and the next save
            writes it whole.
        """
        self.add(record)
        if self.path is None:
            return None
        try:
            await asyncio.to_thread(self.save)
        except (OSError, ValueError) as exc:
            log.warning("could not save the recording %s: %s", self.path, exc)
            return f"could not save the recording {self.path}: {exc}"
        return None

    def add(self, record: RunRecord) -> None:
        """Append ``record`` as cells: a code cell, or a tool's definition and call cells."""
        if record.language_info:
            self.notebook.metadata["language_info"] = dict(record.language_info)
        if record.kind == "tool_call":
            self._add_tool_call(record)
        else:
            self._add_code(record)

    def _fresh_kernel(self, record: RunRecord) -> bool:
        """Whether this run is the first recorded one on its kernel (then replay restarts)."""
        fresh = record.kernel_generation != self._recorded_generation
        if fresh:
            self._recorded_generation = record.kernel_generation
            self._defined.clear()
        return fresh

    def continued(self, generation: int) -> None:
        """The kernel ``generation`` continues the recorded state: a rollback put the state of
        before an atomic run back (replay rolls that run back too, and restarts nothing).
        Tools are defined again in the next cells that call them (the rolled-back run may
        have defined them)."""
        self._recorded_generation = generation
        self._defined.clear()

    def _meta(self, kind: str, record: RunRecord, fresh: bool) -> dict[str, Any]:
        error = record.result.error
        extra = {"rolled_back": True} if record.result.rolled_back else {}
        return {
            "kind": kind,
            "agent_id": self.agent_id,
            "status": _status(record),
            "error_kind": error.kind if error is not None else None,
            "duration_s": round(record.result.duration_s, 6),
            "started": record.started,
            "finished": record.finished,
            "timeout_s": record.timeout_s,
            "fresh_kernel": fresh,
            **extra,
        }

    def _cell(
        self, source: str, outputs: list[Any], count: int | None, meta: dict[str, Any]
    ) -> NotebookNode:
        import nbformat

        cell = nbformat.v4.new_code_cell(source=source)
        cell.outputs = [nbformat.from_dict(o) for o in outputs]
        cell.execution_count = count
        cell.metadata[KEY] = meta
        if meta["status"] == "error":
            cell.metadata["tags"] = [ERROR_TAG]
        return cell

    def _not_run(self, source: str, record: RunRecord, meta: dict[str, Any]) -> None:
        # The run never happened: keep it for the audit, commented out so it is not re-run.
        error = record.result.error
        assert error is not None
        why = error.evalue.splitlines()[0] if error.evalue else error.kind
        commented = "\n".join(f"# {line}" for line in source.splitlines())
        text = f"# not run ({error.kind}: {why}):\n{commented}"
        self.notebook.cells.append(self._cell(text, [], None, meta))

    def _add_code(self, record: RunRecord) -> None:
        assert record.code is not None
        meta = self._meta("code", record, self._fresh_kernel(record))
        if not record.ran:
            self._not_run(record.code, record, meta)
            return
        result = record.result
        self.notebook.cells.append(
            self._cell(record.code, result.outputs, result.execution_count, meta)
        )

    def _add_tool_call(self, record: RunRecord) -> None:
        import nbformat

        tool, args, result = record.tool, record.args or {}, record.result
        assert tool is not None
        fresh = self._fresh_kernel(record)
        if record.ran and self._defined.get(tool.name) != tool.digest:
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
        unfit = next(
            (p for k, v in args.items() if (p := _json.problem(v, str(k))) is not None), None
        )
        if unfit is not None:
            # Refused before running (not JSON, too deep): keep why, not the value itself.
            args = {}
            source = f"{tool.name}(...)  # arguments not recorded: {unfit}"
        else:
            call_args = dict(args)
            if tool.takes_agent_state:
                call_args["agent_state"] = state_json(record.agent_state)
            source = call_source(tool.name, call_args, awaited=tool.is_async)
        meta = self._meta("tool_call", record, fresh)
        meta["tool"] = tool.name
        meta["args"] = args
        value = getattr(result, "func_return", None)
        if len(_json.dumps(value, ensure_ascii=False, default=str)) <= _MAX_RETURN_IN_META:
            meta["func_return"] = value
        else:
            meta["func_return_omitted"] = True  # too big; the cell's output shows it
        if not record.ran:
            self._not_run(source, record, meta)
            return
        self.notebook.cells.append(self._cell(source, result.outputs, result.execution_count, meta))

    def note_branch(self, parent: str, parent_notebook: NotebookNode | None) -> None:
        """Start the recording with a cell saying that this session was forked from the
        session ``parent`` (after its last recorded cell, when it records too)."""
        cells = len(parent_notebook.cells) if parent_notebook is not None else None
        where = f"after its cell {cells}" if cells else "(which does not record its cells)"
        import nbformat

        cell = nbformat.v4.new_markdown_cell(
            source=(
                f"Branched from session `{parent}` {where} at {now_iso()}: this session "
                "started with a copy of that session's kernel and files."
            )
        )
        cell.metadata[KEY] = {
            "kind": "branch",
            "agent_id": self.agent_id,
            "parent": parent,
            "parent_cell": cells,
        }
        self.notebook.cells.append(cell)
        self.save()

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


def _status(record: RunRecord) -> str:
    error = record.result.error
    if error is not None and error.kind == "cancelled":
        return "cancelled"  # it ran (as far as it got) whether or not it reached the kernel
    return record.result.status if record.ran else "not_run"


def _dumps(value: Any) -> str:
    # nbformat's own layout: one-space indent, sorted keys, unicode kept.
    return _json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False)


def _indented(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.split("\n"))
