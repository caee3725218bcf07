"""One agent's session for a framework adapter, driven from synchronous or asynchronous code.

Adapters take either executor: a :class:`~kernelexec.KernelExecutor` (the blocking facade, whose
calls run on its own loop thread) or an :class:`~kernelexec.AsyncKernelExecutor` (running on the
caller's loop or on a loop in another thread). When they are given none, they own a blocking one,
made on first use (building an adapter starts nothing), and close it with themselves.

Every operation is a coroutine function of the agent's :class:`~kernelexec.AsyncSession`, run on
the executor's loop: :meth:`AgentKernel.call` waits for it from a plain thread,
:meth:`AgentKernel.acall` awaits it from any event loop (cancelling the caller cancels it there).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kernelexec._aio import await_on, call_blocking
from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._config import make_config
from kernelexec._core._session import AsyncSession
from kernelexec._exceptions import ExecutorClosedError
from kernelexec._models import ExecError, Execution
from kernelexec._plaintext import strip_ansi
from kernelexec._sync import KernelExecutor, async_side

T = TypeVar("T")

SessionOp = Callable[[AsyncSession], Awaitable[T]]


class AgentKernel:
    """The session of one agent on a shared or owned executor.

    Args:
        prefix: Start of the generated agent id when ``agent_id`` is None.
        agent_id: The session's agent id (default: ``<prefix>-<random>``).
        executor: An executor to share (not closed by :meth:`close`), or None to own one.
        executor_config: :class:`~kernelexec.ExecutorConfig` fields for an owned executor.
    """

    def __init__(
        self,
        prefix: str,
        agent_id: str | None,
        executor: KernelExecutor | AsyncKernelExecutor | None,
        executor_config: dict[str, Any],
    ) -> None:
        if executor is not None and executor_config:
            names = ", ".join(sorted(executor_config))
            raise TypeError(f"pass either executor= or executor settings ({names}), not both")
        if executor is not None and not isinstance(executor, KernelExecutor | AsyncKernelExecutor):
            raise TypeError(
                "executor must be a kernelexec.KernelExecutor or AsyncKernelExecutor, "
                f"not {type(executor).__name__}"
            )
        if agent_id is not None and (not isinstance(agent_id, str) or not agent_id):
            raise TypeError("agent_id must be a non-empty str")
        self.agent_id = agent_id or f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.owned = executor is None
        self._config = dict(executor_config)
        if executor is None:  # refuse a bad setting now, though the executor is made later
            facade = {"backend", "backend_options", "on_progress"}
            make_config(**{k: v for k, v in executor_config.items() if k not in facade})
        self._executor = executor
        self._made = threading.Lock()
        self._session: AsyncSession | None = None
        self._closed = False

    @property
    def executor(self) -> KernelExecutor | AsyncKernelExecutor:
        """The executor the session runs on (an owned one is made here, on first use)."""
        if self._executor is None:
            with self._made:
                if self._executor is None:
                    self._executor = KernelExecutor(**self._config)
        return self._executor

    @property
    def started(self) -> bool:
        """Whether the session was made (by this adapter or, when attaching, before it)."""
        return self._session is not None

    def _async_executor(self) -> tuple[AsyncKernelExecutor, asyncio.AbstractEventLoop | None]:
        """The async executor and its loop (None: an ``AsyncKernelExecutor`` not started yet,
        which starts on the loop that first uses it, as in the core API)."""
        if self._closed:
            raise ExecutorClosedError(f"the adapter of agent {self.agent_id!r} was closed")
        ex = self.executor
        if isinstance(ex, KernelExecutor):
            return async_side(ex)  # a closed facade's loop is gone: it fails, never hangs
        return ex, ex.loop

    def session_exists(self) -> bool:
        """Whether the executor holds an open session of this agent (for attaching by id)."""
        ex, _ = self._async_executor()
        return self.agent_id in ex.sessions

    async def _with_session(self, op: SessionOp[T]) -> T:
        if self._session is None:
            ex, _ = self._async_executor()
            self._session = await ex.session(self.agent_id)
        return await op(self._session)

    def call(self, op: SessionOp[T]) -> T:
        """Run ``op(session)`` on the executor's loop and wait for it (from a plain thread)."""
        _, loop = self._async_executor()
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None:
            raise RuntimeError(
                "a synchronous framework called kernelexec with an AsyncKernelExecutor that no "
                "event loop has started: it runs on the loop that starts it, and this thread "
                "runs none; pass a KernelExecutor, or start the executor on a loop first"
            )
        if running is loop:
            raise RuntimeError(
                "a synchronous framework called kernelexec from the executor's own event-loop "
                "thread, which would deadlock; run the agent in a worker thread "
                "(asyncio.to_thread) or pass a KernelExecutor"
            )
        return call_blocking(loop, self._with_session(op))

    async def acall(self, op: SessionOp[T]) -> T:
        """Await ``op(session)`` from any event loop; cancelling the caller cancels it. An
        ``AsyncKernelExecutor`` not started yet starts on the caller's loop."""
        _, loop = self._async_executor()
        if loop is None or asyncio.get_running_loop() is loop:
            return await self._with_session(op)
        return await await_on(loop, self._with_session(op))

    def run_code(self, code: str, timeout: float | None = None) -> Execution:
        """Run code in the agent's kernel and wait for the result."""
        ex = self.executor
        if isinstance(ex, KernelExecutor):
            return ex.session(self.agent_id).run_code(code, timeout=timeout)
        return self.call(lambda session: session.run_code(code, timeout=timeout))

    def close(self) -> None:
        """Close the agent's session, and the executor when the adapter made it. Idempotent."""
        if self._closed:
            return
        ex = self._executor
        if ex is None:
            self._closed = True
            return
        if self.owned:
            self._closed = True
            assert isinstance(ex, KernelExecutor)
            ex.close()
            return
        session, self._session = self._session, None
        if isinstance(ex, KernelExecutor):
            if self.agent_id in ex.sessions:
                ex.session(self.agent_id).close()
        elif session is not None:
            self.call(lambda _: session.aclose())
        self._closed = True

    async def aclose(self) -> None:
        """:meth:`close` from an event loop."""
        if self._closed:
            return
        ex = self._executor
        if ex is None:
            self._closed = True
            return
        if self.owned:
            self._closed = True
            assert isinstance(ex, KernelExecutor)
            await asyncio.to_thread(ex.close)
            return
        session, self._session = self._session, None
        if session is not None:
            await self.acall(lambda _: session.aclose())
        self._closed = True


def describe_execution(result: Execution) -> str:
    """A run as a tool's answer to a model, plain text: its output, its value or its whole
    traceback (line numbers included), and one short line on the interpreter's state (what the
    run bound, or what a failure lost or undid)."""
    parts = []
    if result.stdout:
        parts.append(strip_ansi(result.stdout).rstrip("\n"))
    if result.stderr:
        parts.append(f"[stderr]\n{strip_ansi(result.stderr).rstrip()}")
    if result.error is not None:
        parts.append(describe_error(result.error))
    elif result.result is not None:
        parts.append(strip_ansi(result.result))
    state = state_line(result)
    if state:
        parts.append(state)
    return "\n".join(parts) or "(no output)"


def describe_error(error: ExecError) -> str:
    """An error as plain text: the traceback as the kernel formatted it (without its colours),
    and for a run kernelexec stopped (a timeout, a death, a limit) what stopped it."""
    if error.traceback:
        text = strip_ansi("\n".join(error.traceback)).strip("\n")
    else:
        text = strip_ansi(f"{error.ename}: {error.evalue}" if error.ename else error.evalue)
    if error.kind != "exception" and error.traceback:
        text = f"{text}\n({error.kind}: {strip_ansi(error.evalue)})"
    return text


def describe_loss(lost: list[str]) -> str:
    """What a model is told when the interpreter was replaced (``lost``: the variables gone)."""
    if not lost:
        return "(the interpreter was restarted; no variables were lost)"
    return f"(the interpreter was restarted: these variables were lost: {', '.join(lost)})"


def state_line(result: Execution) -> str | None:
    """One short line for a model on what a run did to the interpreter's state (None when it
    bound, rebound and removed nothing)."""
    if result.rolled_back:
        return "(rolled back: the variables and files are as before this run)"
    if result.kernel_restarted:
        return describe_loss(result.lost_variables)
    if result.changes:
        return f"(variables {result.changes.describe()})"
    return None
