"""``AsyncSession``: one agent's persistent kernel, its calls serialised in submission order."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbformat import NotebookNode
from pydantic import BaseModel

from kernelexec._core._run import Callbacks, OutputCallback, RunOutcome, run_request
from kernelexec._exceptions import EnvSetupError, ExecutorClosedError
from kernelexec._models import ExecError, Execution, ToolResult
from kernelexec._notebooks._recording import SessionRecorder, now_iso
from kernelexec._tools._tool import Tool
from kernelexec.backends._base import ExecuteRequest, KernelConnection

if TYPE_CHECKING:
    from kernelexec._core._pool import KernelPool

log = logging.getLogger("kernelexec")

RESULT_MIME = "application/vnd.kernelexec.result+json"
_MODULE = "__import__('__kernelexec__')"
REPORT_EXPRESSION = f"{_MODULE}.report()"
_REPORT = {"kx": REPORT_EXPRESSION}
_KIND_BY_ENAME = {
    "KernelexecInvalidTool": "invalid_tool",
    "KernelexecInvalidArgs": "invalid_args",
}


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class AsyncSession:
    """A stateful sandbox for one agent: a kernel kept across calls.

    Get one from :meth:`AsyncKernelExecutor.session`; the same agent id always gives the same
    session. Calls are run one at a time in the order they were made; different sessions run in
    parallel. The kernel is started on first use (or taken from the prewarmed pool), replaced
    when it dies or has to be killed, and may be shut down when idle (its state is then lost and
    the next result says so).
    """

    def __init__(
        self,
        agent_id: str,
        pool: Callable[[], Awaitable[KernelPool]],
        workdir: Path,
        *,
        fingerprint: str,
        default_timeout: float,
        interrupt_grace: float,
        output_grace: float,
        max_output_chars: int,
        max_result_chars: int,
        recorder: SessionRecorder | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.workdir = workdir
        self.fingerprint = fingerprint
        self._get_pool = pool  # builds the session's environment on first use
        self._pool: KernelPool | None = None
        self._timeout = default_timeout
        self._grace = interrupt_grace
        self._output_grace = output_grace
        self._max_output = max_output_chars
        self._max_result = max_result_chars
        self._lock = asyncio.Lock()
        self._conn: KernelConnection | None = None
        self._names: list[str] = []
        self._lost: list[str] | None = None  # state lost outside a run, not yet reported
        self._closed = False
        self._recorder = recorder
        self._pending_config: dict[str, Any] | None = None
        self.last_used = time.monotonic()

    # -- public API -------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a call runs or waits to run."""
        return self._lock.locked()

    @property
    def notebook(self) -> NotebookNode | None:
        """The session's recording (an nbformat v4 notebook), or None when not recording.

        Every run is a code cell with its outputs; a tool call is its definition cell (once per
        version of its source) and a call cell such as ``add(a=1, b=2)``.
        """
        return self._recorder.notebook if self._recorder is not None else None

    @property
    def record_path(self) -> Path | None:
        """The file the recording is saved to after every run (None: not saved)."""
        return self._recorder.path if self._recorder is not None else None

    @property
    def has_kernel(self) -> bool:
        """Whether a kernel is currently attached (it may be shut down when idle)."""
        return self._conn is not None

    async def run_code(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
    ) -> Execution:
        """Run code in the session's kernel, like a notebook cell.

        Args:
            code: Python source (IPython syntax allowed).
            timeout: Seconds before the run is interrupted (default: the executor's).
            on_stdout: Called with each piece of stdout text as it arrives.
            on_stderr: Called with each piece of stderr text as it arrives.
            on_display: Called with each display_data output dict as it arrives.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be str, not {type(code).__name__}")
        request = ExecuteRequest(code=code, user_expressions=_REPORT)
        callbacks = Callbacks(on_stdout, on_stderr, on_display)
        async with self._lock:
            started = now_iso()
            fields, _ = await self._run(request, timeout, callbacks)
            if self._recorder is not None:
                self._recorder.add_code(code, fields, started, fields["timeout_s"])
                await self._save()
        return Execution(**fields)

    async def call_tool(
        self,
        tool: Tool,
        args: dict[str, Any] | None = None,
        *,
        agent_state: Any = None,
        env_vars: dict[str, str] | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
    ) -> ToolResult:
        """Call a tool with JSON arguments; they are validated first and sent as data.

        Args:
            tool: The tool to call; its source is sent to the kernel once (again if it changes).
            args: Arguments by name, validated against the tool's schema.
            agent_state: Injected as the ``agent_state`` parameter when the tool has one; the
                changed state comes back in ``ToolResult.agent_state``.
            env_vars: Environment variables set only for the duration of this call.
            timeout: Seconds before the call is interrupted (default: the executor's).
            on_stdout: Called with each piece of stdout text as it arrives.
            on_stderr: Called with each piece of stderr text as it arrives.
            on_display: Called with each display_data output dict as it arrives.
        """
        if not isinstance(tool, Tool):
            raise TypeError(f"tool must be a kernelexec.Tool, not {type(tool).__name__}")
        args = {} if args is None else args
        problems = tool.validate_args(args)
        if env_vars is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            problems.append("env_vars must map str to str")
        if problems:
            self._check_open()
            rejected = self._invalid_args(problems, agent_state)
            if self._recorder is not None:
                async with self._lock:
                    assert rejected.error is not None
                    fields = _not_run(rejected.error)
                    self._recorder.add_tool_call(
                        tool, args, fields, now_iso(), timeout or self._timeout, agent_state
                    )
                    await self._save()
            return rejected
        spec: dict[str, Any] = {
            "name": tool.name,
            "digest": tool.digest,
            "args": json.dumps(args, ensure_ascii=False),
            "env": dict(env_vars or {}),
            "max_result_chars": self._max_result,
            "source": tool.source_code,
        }
        if tool.takes_agent_state:
            spec["agent_state"] = _dump_state(agent_state)
        if self._recorder is not None:
            spec["display"] = True
        callbacks = Callbacks(on_stdout, on_stderr, on_display)
        request = ExecuteRequest(
            code=f"{_MODULE}.call()",
            user_expressions=_REPORT,
            metadata={"kernelexec": spec},
        )
        async with self._lock:
            started = now_iso()
            fields, result = await self._run(request, timeout, callbacks)
            fields["sandbox_config_fingerprint"] = self.fingerprint
            fields["agent_state"] = agent_state
            if result is not None:
                fields["func_return"] = result.get("return")
                if "agent_state" in result:
                    fields["agent_state"] = _load_state(agent_state, result["agent_state"])
            if self._recorder is not None:
                self._recorder.add_tool_call(
                    tool, args, fields, started, fields["timeout_s"], agent_state
                )
                await self._save()
                # The return value was displayed only for the notebook; the result is the same
                # whether or not the session records.
                fields["outputs"] = [
                    o for o in fields["outputs"] if o.get("output_type") != "execute_result"
                ]
                fields["result"] = None
        return ToolResult(**fields)

    async def interrupt(self) -> None:
        """Interrupt whatever the kernel is running now (the running call gets the error)."""
        self._check_open()
        if self._conn is not None:
            await self._conn.interrupt()

    async def restart(self) -> None:
        """Replace the kernel with a fresh one now; all state is lost."""
        async with self._lock:
            self._check_open()
            if self._conn is not None:
                self._lost = (self._lost or []) + self._names
                await self._replace_kernel()

    async def aclose(self) -> None:
        """Shut the session's kernel down; later calls raise ``ExecutorClosedError``."""
        self.mark_closed()
        conn, self._conn = self._conn, None
        if conn is not None and self._pool is not None:
            await self._pool.discard(conn)

    def mark_closed(self) -> None:
        """Refuse further calls and release the recording's file (used by the executor)."""
        self._closed = True
        if self._recorder is not None:
            self._recorder.close()

    # -- used by the pool -------------------------------------------------------------------

    async def evict(self) -> None:
        """Give the kernel back (idle culling or LRU eviction); the next call starts fresh."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._lost = (self._lost or []) + self._names
        self._names = []
        assert self._pool is not None
        await self._pool.discard(conn)

    # -- internals ---------------------------------------------------------------------------

    async def _save(self) -> None:
        assert self._recorder is not None
        # Off the event loop (other sessions keep running), still under this session's lock.
        try:
            await asyncio.to_thread(self._recorder.save)
        except OSError as exc:
            # The run's result is not lost over the file: the notebook stays complete in memory
            # and the next save writes it whole.
            log.warning("could not save the recording %s: %s", self._recorder.path, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorClosedError(f"session {self.agent_id!r} is closed")

    def _invalid_args(self, problems: list[str], agent_state: Any) -> ToolResult:
        error = ExecError(kind="invalid_args", ename="InvalidArguments", evalue="; ".join(problems))
        return ToolResult(
            status="error",
            error=error,
            agent_state=agent_state,
            sandbox_config_fingerprint=self.fingerprint,
        )

    async def _attach(self) -> tuple[KernelConnection, list[str] | None]:
        """The kernel to run on, and the variables lost since the last run (if any)."""
        lost, self._lost = self._lost, None
        conn = self._conn
        if conn is not None and not await conn.is_alive():
            lost = (lost or []) + self._names
            assert self._pool is not None
            await self._pool.discard(conn)
            conn = self._conn = None
        if conn is None:
            if self._pool is None:
                self._pool = await self._get_pool()
            conn = await self._pool.acquire()
            self._conn = conn
            self._names = []
            self._kernel_attached()
        return conn, lost

    def _kernel_attached(self) -> None:
        # The session's settings go with the next request instead of on their own: one round
        # trip less per new kernel.
        self._pending_config = {"cwd": str(self.workdir)}
        if self._recorder is not None:
            self._recorder.kernel_started(None)

    async def _replace_kernel(self) -> None:
        old, self._conn = self._conn, None
        self._names = []
        if old is not None:
            assert self._pool is not None
            self._conn = await self._pool.replace(old)
            self._kernel_attached()

    async def _run(
        self, request: ExecuteRequest, timeout: float | None, callbacks: Callbacks
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        self._check_open()
        start = time.monotonic()
        timeout = self._timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        try:
            try:
                conn, lost = await self._attach()
            except EnvSetupError as exc:
                fields = _not_run(
                    ExecError(kind="env_setup_failed", ename="EnvSetupError", evalue=str(exc))
                )
                fields["duration_s"] = time.monotonic() - start
                fields["timeout_s"] = timeout
                return fields, None
            out = await self._send(conn, request, timeout, callbacks)
            if out.died and not out.started:
                # The kernel died before it saw the request (e.g. killed between calls): the
                # code never ran, so run it once on a fresh kernel.
                lost = (lost or []) + self._names
                await self._replace_kernel()
                assert self._conn is not None
                conn = self._conn
                out = await self._send(conn, request, timeout, callbacks)
            generation = self._recorder.generation if self._recorder is not None else 0
            fields, result = await self._finish(out, conn, timeout, lost)
        finally:
            self.last_used = time.monotonic()
        fields["duration_s"] = time.monotonic() - start
        fields["timeout_s"] = timeout
        fields["kernel_generation"] = generation
        return fields, result

    async def _send(
        self,
        conn: KernelConnection,
        request: ExecuteRequest,
        timeout: float,
        callbacks: Callbacks,
    ) -> RunOutcome:
        if self._pending_config is not None:
            metadata = dict(request.metadata or {})
            spec = dict(metadata.get("kernelexec") or {})
            spec["configure"], self._pending_config = self._pending_config, None
            metadata["kernelexec"] = spec
            request = dataclasses.replace(request, metadata=metadata)
        return await run_request(
            conn,
            request,
            timeout=timeout,
            interrupt_grace=self._grace,
            output_grace=self._output_grace,
            max_output_chars=self._max_output,
            callbacks=callbacks,
        )

    async def _finish(
        self, out: RunOutcome, conn: KernelConnection, timeout: float, lost: list[str] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        error: ExecError | None = None
        restarted = lost is not None
        lost_names = list(lost or [])
        result: dict[str, Any] | None = None
        reply = out.reply or {}
        asked_exit = any(p.get("source") == "ask_exit" for p in reply.get("payload") or [])

        if out.died or out.stuck or asked_exit:
            if out.died:
                why = f"the kernel died ({_describe_exit(conn.exit_code)})"
                error = ExecError(kind="kernel_died", ename="KernelDied", evalue=why)
            elif out.stuck:
                why = (
                    f"timed out after {timeout:g} s and did not stop when interrupted; "
                    "the kernel was restarted and its state lost"
                )
                error = ExecError(kind="timeout", ename="TimeoutError", evalue=why)
            else:
                why = "the code asked the kernel to exit; a fresh kernel replaces it"
                error = ExecError(kind="kernel_died", ename="KernelExited", evalue=why)
            restarted = True
            lost_names += self._names
            await self._replace_kernel()
        else:
            report = _read_report(reply)
            if report is not None:
                self._names = list(report.get("names") or [])
                result = report.get("result")
                info = report.get("language_info")
                if self._recorder is not None and isinstance(info, dict):
                    self._recorder.language_info(info)
            if out.timed_out:
                error = ExecError(
                    kind="timeout",
                    ename="TimeoutError",
                    evalue=f"timed out after {timeout:g} s; interrupted, kernel state kept",
                    traceback=list((out.error or {}).get("traceback") or []),
                )
            elif reply.get("status") != "ok" or out.error is not None:
                content = out.error or reply
                ename = str(content.get("ename", "Error"))
                error = ExecError(
                    kind=_KIND_BY_ENAME.get(ename, "exception"),  # type: ignore[arg-type]
                    ename=ename,
                    evalue=str(content.get("evalue", "")),
                    traceback=[str(t) for t in content.get("traceback") or []],
                )
        # Plain fields, not a model: the caller builds an Execution or a ToolResult once.
        fields = {
            "status": "error" if error else "success",
            "stdout": out.stdout,
            "stderr": out.stderr,
            "outputs": out.outputs,
            "result": out.result,
            "error": error,
            "execution_count": out.execution_count,
            "kernel_restarted": restarted,
            "lost_variables": sorted(set(lost_names)),
        }
        return fields, result


def _not_run(error: ExecError) -> dict[str, Any]:
    """Result fields of a run that never reached a kernel."""
    return {"status": "error", "error": error, "outputs": [], "stdout": "", "stderr": ""}


def _read_report(reply: dict[str, Any]) -> dict[str, Any] | None:
    entry = (reply.get("user_expressions") or {}).get("kx") or {}
    text = (entry.get("data") or {}).get(RESULT_MIME)
    if not isinstance(text, str):
        return None
    try:
        report = json.loads(text)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _dump_state(state: Any) -> dict[str, Any]:
    if isinstance(state, BaseModel):
        cls = type(state)
        return {
            "data": state.model_dump(mode="json"),
            "class": f"{cls.__module__}:{cls.__qualname__}",
        }
    return {"data": json.loads(json.dumps(state, default=str))}


def _load_state(original: Any, data: Any) -> Any:
    if isinstance(original, BaseModel):
        try:
            return type(original).model_validate(data)
        except Exception:
            return data
    return data
