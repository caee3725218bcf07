"""The process-wide executor behind ``kernelexec.compat.letta``, on an event loop of its own.

Letta's callers are coroutines on whatever loop their server runs (a FastAPI worker, a test's
loop, ``asyncio.run`` in a script). Kernels, their sockets and background tasks belong to one
loop, so the executor lives on a loop thread of its own and every call is handed to it; the
caller awaits the result on its own loop. Cancelling the caller cancels the call (the session
then interrupts the kernel).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kernelexec._aio import LoopThread
from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._config import make_config
from kernelexec._exceptions import ExecutorClosedError

T = TypeVar("T")


class ExecutorThread:
    """An :class:`AsyncKernelExecutor` on a :class:`~kernelexec._aio.LoopThread` of its own.

    Args:
        config: :class:`~kernelexec.ExecutorConfig` fields for the executor.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        make_config(**config)  # a bad field is the caller's error, raised here
        self._thread = LoopThread("kernelexec-letta")
        self._closed = False
        try:
            self.executor: AsyncKernelExecutor = self._thread.call(self._open, config)
        except BaseException:
            self._thread.stop()
            raise

    @staticmethod
    async def _open(config: dict[str, Any]) -> AsyncKernelExecutor:
        executor = AsyncKernelExecutor(**config)
        await executor.start()
        return executor

    async def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the executor's loop; await it from any loop."""
        if self._closed:
            raise ExecutorClosedError("the Letta sandbox executor is shut down")
        try:
            return await self._thread.run(fn, *args)
        except asyncio.CancelledError:
            if self._closed:  # shutdown() cancelled the call, not the caller's own task
                raise ExecutorClosedError(
                    "the Letta sandbox executor was shut down during the run"
                ) from None
            raise

    def close(self) -> None:
        """Shut every kernel down and stop the thread (blocking; idempotent); calls still
        running are cancelled (their callers get ``ExecutorClosedError``)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.call(self.executor.aclose)
        finally:
            self._thread.stop()
