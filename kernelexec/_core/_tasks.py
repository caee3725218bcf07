"""``TaskSupervisor``: the executor's background work, under one anyio task group.

Prewarming and idle culling run here, not as fire-and-forget tasks: a failure is logged at once
and kept, the other tasks go on, and :meth:`TaskSupervisor.aclose` raises what failed. The task
group lives in a task of its own, so ``start`` and ``aclose`` may be called from different tasks
(the blocking facade makes each call in a new one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

from kernelexec._exceptions import BackgroundTaskError

log = logging.getLogger("kernelexec")


class TaskSupervisor:
    """Runs background tasks until closed; see the module docstring."""

    def __init__(self) -> None:
        self._group: TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.failures: list[BaseException] = []

    async def start(self) -> None:
        """Open the task group (idempotent)."""
        if self._runner is not None:
            return
        ready = asyncio.Event()
        self._runner = asyncio.create_task(self._run(ready), name="kernelexec-supervisor")
        await ready.wait()

    async def _run(self, ready: asyncio.Event) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            ready.set()
            await self._stop.wait()
            group.cancel_scope.cancel()
        self._group = None

    def spawn(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job()`` in the background until it returns or the supervisor closes."""
        if self._group is None or self._stop.is_set():
            return
        self._group.start_soon(self._guard, name, job, name=name)

    async def _guard(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
        except Exception as exc:
            self.record(name, exc)

    def record(self, name: str, exc: Exception) -> None:
        """Log and keep a failure of background work that goes on (one round of a loop)."""
        log.error("background task %s failed: %r", name, exc, exc_info=exc)
        self.failures.append(exc)

    async def aclose(self) -> None:
        """Cancel every task and wait for them.

        Raises:
            BackgroundTaskError: a background task failed while the supervisor ran (it was
                logged then); the first failure is its cause.
        """
        self._stop.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.shield(runner)
        if self.failures:
            failures, self.failures = self.failures, []
            names = "; ".join(repr(f) for f in failures[:3])
            raise BackgroundTaskError(
                f"{len(failures)} background task(s) failed: {names}"
            ) from failures[0]
