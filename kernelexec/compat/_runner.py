"""The process-wide executor behind ``kernelexec.compat.letta``, on an event loop of its own.

Letta's callers are coroutines on whatever loop their server runs (a FastAPI worker, a test's
loop, ``asyncio.run`` in a script). Kernels, their sockets and background tasks belong to one
loop, so the executor lives on a daemon thread's loop and every call is handed to it; the
caller awaits the result on its own loop. Cancelling the caller cancels the call (the session
then interrupts the kernel).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kernelexec._config import make_config
from kernelexec._core._executor import AsyncKernelExecutor
from kernelexec._exceptions import ExecutorClosedError

T = TypeVar("T")


class ExecutorThread:
    """An :class:`AsyncKernelExecutor` on a loop in a daemon thread.

    Args:
        config: :class:`~kernelexec.ExecutorConfig` fields for the executor.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        make_config(**config)  # a bad field is the caller's error, raised here
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kernelexec-letta", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self.executor: AsyncKernelExecutor = self._call(self._open, config).result()
        except BaseException:
            self._stop()
            raise

    @staticmethod
    async def _open(config: dict[str, Any]) -> AsyncKernelExecutor:
        executor = AsyncKernelExecutor(**config)
        await executor.start()
        return executor

    def _call(
        self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any
    ) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop)

    async def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the executor's loop; await it from any loop."""
        if self._closed:
            raise ExecutorClosedError("the Letta sandbox executor is shut down")
        try:
            return await asyncio.wrap_future(self._call(fn, *args))
        except asyncio.CancelledError:
            if self._closed:  # shutdown() cancelled the call, not the caller's own task
                raise ExecutorClosedError(
                    "the Letta sandbox executor was shut down during the run"
                ) from None
            raise

    def close(self) -> None:
        """Shut every kernel down and stop the thread (blocking; idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.executor.aclose).result()
        finally:
            self._call(_cancel_the_rest).result()
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _cancel_the_rest() -> None:
    """Cancel calls still running (their callers get ``CancelledError``) before the loop stops."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
