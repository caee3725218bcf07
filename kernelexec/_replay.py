"""Replaying a recorded notebook in a fresh kernel and reporting which outputs differ."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._codemode._calls import HOST_CALL_MIME
from kernelexec._codemode._exposure import DEFAULT_MODULE, HostFunctions
from kernelexec._codemode._stubs import recorded_calls, recorded_stubs
from kernelexec._config import valid_timeout
from kernelexec._envs._envs import VenvEnv
from kernelexec._exceptions import ConfigError, NotebookError
from kernelexec._notebooks._io import KEY, read_notebook
from kernelexec._public import public

_VOLATILE = [
    (re.compile(r"0x[0-9a-fA-F]{4,}"), "0x…"),
    (
        re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?"),
        "<timestamp>",
    ),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|seconds)\b"), "<duration>"),
]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MAX_DIFF_LINES = 24


class CellDifference(BaseModel):
    """A cell whose replayed outputs differ from the recorded ones.

    Attributes:
        index: The cell's index in the notebook (0-based, markdown cells counted).
        first_line: The first line of the cell's source, to find it by eye.
        recorded_status: ``success``/``error`` as recorded (``None`` when not recorded).
        replayed_status: ``success``/``error`` in the replay.
        diff: A short unified diff of the normalised outputs (recorded, then replayed).
    """

    index: int
    first_line: str
    recorded_status: str | None
    replayed_status: str
    diff: str


class ReplayReport(BaseModel):
    """What :func:`replay` found.

    Attributes:
        notebook: The replayed file.
        cells_run: Code cells executed.
        differences: One entry per cell whose outputs (or status) differ.
        notes: What of the recording the replay did not follow, one line each (a recorded
            interpreter or venv path, which a notebook may not make the host run).
    """

    notebook: str
    cells_run: int = 0
    differences: list[CellDifference] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every cell replayed with the recorded outputs."""
        return not self.differences


def normalise(text: str) -> str:
    """Text with the parts that change between runs (addresses, timestamps, timings) masked."""
    text = _ANSI.sub("", text)
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def output_lines(outputs: list[Any]) -> list[str]:
    """Outputs as comparable lines: stream text, text-like data, and error name and message.

    Tracebacks are left out (their frames differ between a tool call and its replayed cell);
    binary data (images) counts only by type; host calls (code mode's records) are left out:
    they are what the code asked of the host, not what it showed.
    """
    lines: list[str] = []
    streams: dict[str, str] = {}
    order: list[str] = []

    def flush() -> None:
        for name in order:
            lines.extend(f"[{name}] {line}" for line in normalise(streams[name]).splitlines())
        streams.clear()
        order.clear()

    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            name = str(out.get("name", "stdout"))
            if name not in streams:
                order.append(name)
                streams[name] = ""
            streams[name] += _text(out.get("text", ""))
            continue
        if HOST_CALL_MIME in (out.get("data") or {}):
            continue
        flush()
        if kind in ("execute_result", "display_data"):
            for mime, value in sorted((out.get("data") or {}).items()):
                if mime.startswith("text/") or mime.endswith("json"):
                    body = value if isinstance(value, str | list) else repr(value)
                    lines.extend(f"[{mime}] {line}" for line in normalise(_text(body)).splitlines())
                else:
                    lines.append(f"[{mime}] <binary>")
        elif kind == "error":
            lines.append(normalise(f"[error] {out.get('ename')}: {out.get('evalue')}"))
    flush()
    return lines


def _recorded_timeout(meta: dict[str, Any], index: int) -> float | None:
    value = meta.get("timeout_s")
    if value is None:
        return None
    try:
        return valid_timeout(value, f"cell {index}: the recorded timeout_s")
    except ConfigError as exc:
        raise NotebookError(str(exc)) from None


async def areplay(
    path: str | Path,
    *,
    default_timeout: float = 60.0,
    max_timeout: float | None = None,
    build_requirements: bool = False,
    host_functions: HostFunctions | None = None,
    **config: Any,
) -> ReplayReport:
    """Run a notebook's code cells top to bottom in a fresh kernel and compare the outputs.

    A notebook is untrusted input: the kernel gets the executor's default isolation (unless
    ``isolation`` is given), and nothing in the notebook's metadata names a host program to run
    (a recorded interpreter is ignored: venvs are made from kernelexec's own). A recorded venv
    is reused from the cache; building its requirements (whose build backends run code) needs
    ``build_requirements=True``, and then happens under the replay kernels' isolation.
    Cells recorded by kernelexec are re-run with the
    timeout they had, and the kernel is
    restarted where the recorded session got a fresh kernel, so a recorded timeout or lost
    state replays as it happened; a cell whose atomic run was rolled back is run atomically.
    Calls that were rejected before running are skipped, and so are calls their caller
    cancelled (how far they got cannot be reproduced). A cell whose code
    called host functions (code mode) gets them back as stubs answering as recorded, unless
    ``host_functions`` are given: then those are exposed and really run.

    Args:
        path: The notebook.
        default_timeout: Seconds allowed for a cell that has no recorded timeout.
        max_timeout: The most any cell may take, whatever its recorded timeout (None: no cap).
        build_requirements: Build the recorded venv's requirements when the cache does not
            hold it already.
        host_functions: Host functions to expose to the replay (a list: module ``tools``; or
            a dict of module name -> functions) instead of answering host calls as recorded.
        **config: Other :class:`~kernelexec.ExecutorConfig` fields for the replay's executor.

    Raises:
        NotebookError: the file is missing or not a valid notebook, or a recorded
            ``timeout_s`` is not a finite positive number (checked before anything runs).
        ConfigError: ``default_timeout`` or ``max_timeout`` is not a finite positive number,
            or the recorded venv would have to be built and ``build_requirements`` is False.
    """
    default_timeout = valid_timeout(default_timeout, "default_timeout")
    if max_timeout is not None:
        max_timeout = valid_timeout(max_timeout, "max_timeout")
    nb = read_notebook(path)
    recorded_timeouts = {
        index: _recorded_timeout(cell.metadata.get(KEY) or {}, index)
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
    }
    report = ReplayReport(notebook=str(path))
    recorded_env = (nb.metadata.get(KEY) or {}).get("env") or {}
    if recorded_env.get("kind") == "venv" and "env" not in config:
        # Rebuilt (or reused from the cache) from the recorded requirements, from kernelexec's
        # own interpreter: the recorded one is a path the notebook's author chose.
        requirements = recorded_env.get("requirements") or ()
        if not isinstance(requirements, list | tuple) or not all(
            isinstance(r, str) for r in requirements
        ):
            raise NotebookError("the recorded env's requirements are not a list of strings")
        config["env"] = VenvEnv(requirements=tuple(requirements))
        ignored = {k: recorded_env.get(k) for k in ("python", "path") if recorded_env.get(k)}
        if ignored:
            named = ", ".join(f"{k} {v!r}" for k, v in ignored.items())
            report.notes.append(
                f"the recorded venv's {named} not used: its requirements were built from "
                "kernelexec's own interpreter (a notebook names no program for the host to run)"
            )
    async with AsyncKernelExecutor(default_timeout=default_timeout, **config) as ex:
        env = ex.env
        building = isinstance(env, VenvEnv) and env.requirements and not build_requirements
        if building and isinstance(env, VenvEnv) and not ex.builder.is_built(env):
            raise ConfigError(
                f"the recording's venv ({', '.join(env.requirements)}) is not built; "
                "building runs the requirements' own code: pass build_requirements=True "
                "(CLI: --build-requirements) to build it under the replay's isolation"
            )
        session = await ex.session("replay")
        if host_functions is not None:
            if not isinstance(host_functions, dict):
                host_functions = {DEFAULT_MODULE: list(host_functions)}
            for module, functions in host_functions.items():
                await session.expose(*functions, module=module)
        every_call = [c for cell in nb.cells for c in recorded_calls(cell.get("outputs") or [])]
        ran = False
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            meta = cell.metadata.get(KEY) or {}
            if meta.get("status") in ("not_run", "cancelled"):
                continue  # never ran, or ran only until its caller cancelled it
            if meta.get("fresh_kernel") and ran:
                await session.restart()
            timeout = recorded_timeouts[index] or default_timeout
            if max_timeout is not None:
                timeout = min(timeout, max_timeout)
            stubs = None
            if host_functions is None and every_call:
                stubs = recorded_stubs(cell.outputs, every_call)
            result = await session.run_code(
                cell.source,
                timeout=timeout,
                host_functions=stubs or None,
                atomic=bool(meta.get("rolled_back")),  # undone when recorded: undone again
            )
            ran = True
            report.cells_run += 1
            recorded = output_lines(cell.outputs)
            replayed = output_lines(result.outputs)
            recorded_status = meta.get("status")
            status_differs = recorded_status is not None and recorded_status != result.status
            if recorded == replayed and not status_differs:
                continue
            diff = list(
                difflib.unified_diff(recorded, replayed, "recorded", "replayed", lineterm="", n=1)
            )
            if status_differs and not diff:
                diff = [f"status: recorded {recorded_status}, replayed {result.status}"]
            if len(diff) > _MAX_DIFF_LINES:
                more = len(diff) - _MAX_DIFF_LINES
                diff = [*diff[:_MAX_DIFF_LINES], f"... {more} more lines"]
            first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
            report.differences.append(
                CellDifference(
                    index=index,
                    first_line=first[:120],
                    recorded_status=recorded_status,
                    replayed_status=result.status,
                    diff="\n".join(diff),
                )
            )
    return report


public(__name__)
