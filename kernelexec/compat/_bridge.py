"""One agent's session for a framework adapter, driven from synchronous framework code.

Adapters take either executor: a :class:`~kernelexec.KernelExecutor` (the blocking facade, whose
calls run on its own loop thread) or an :class:`~kernelexec.AsyncKernelExecutor` running on a
loop in another thread (the adapter hands each call to that loop and waits). When they make none,
they own a blocking one and close it with themselves.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kernelexec._core._executor import AsyncKernelExecutor
from kernelexec._core._session import AsyncSession
from kernelexec._models import Execution
from kernelexec._sync import KernelExecutor

T = TypeVar("T")


class AgentKernel:
    """The session of one agent on a shared or owned executor, with blocking calls.

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
        self.agent_id = agent_id or f"{prefix}-{uuid.uuid4().hex[:12]}"
        self._owned = executor is None
        self._executor = KernelExecutor(**executor_config) if executor is None else executor
        self._session: AsyncSession | None = None

    @property
    def executor(self) -> KernelExecutor | AsyncKernelExecutor:
        """The executor the session runs on."""
        return self._executor

    def run_code(self, code: str, timeout: float | None = None) -> Execution:
        """Run code in the agent's kernel and wait for the result."""
        ex = self._executor
        if isinstance(ex, KernelExecutor):
            return ex.session(self.agent_id).run_code(code, timeout=timeout)
        return self._on_loop(self._async_run, code, timeout)

    async def _async_run(self, code: str, timeout: float | None) -> Execution:
        assert isinstance(self._executor, AsyncKernelExecutor)
        if self._session is None:
            self._session = await self._executor.session(self.agent_id)
        return await self._session.run_code(code, timeout=timeout)

    def _on_loop(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        assert isinstance(self._executor, AsyncKernelExecutor)
        loop = self._executor.loop
        if loop is None:
            raise RuntimeError(
                "the AsyncKernelExecutor is not started: `async with` it (or await start()) "
                "on its loop before handing it to a synchronous framework"
            )
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError(
                "a synchronous framework called kernelexec from the AsyncKernelExecutor's own "
                "event-loop thread, which would deadlock; run the agent in a worker thread "
                "(asyncio.to_thread) or pass a KernelExecutor"
            )
        return asyncio.run_coroutine_threadsafe(fn(*args), loop).result()

    def close(self) -> None:
        """Close the agent's session, and the executor when the adapter made it."""
        ex = self._executor
        if self._owned:
            assert isinstance(ex, KernelExecutor)
            ex.close()
        elif isinstance(ex, KernelExecutor):
            ex.session(self.agent_id).close()
        elif self._session is not None:
            session, self._session = self._session, None
            self._on_loop(session.aclose)
