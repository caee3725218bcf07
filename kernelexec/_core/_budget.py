"""``KernelBudget``: how many kernels may live at once, over every environment, and who gives
one back.

One budget per executor. Every kernel started counts against ``max_kernels`` from the moment
its start begins until it is shut down: warm, in a session, or starting. When a session needs
a kernel and the cap is reached, the least recently used idle lease gives its kernel back; when
every lease is busy, :class:`PoolExhaustedError` is raised at once instead of waiting without
bound. Idle culling (``idle_timeout``) runs here too, under the executor's task supervisor.

The budget knows leases only through the small :class:`Evictable` protocol; pools call
:meth:`reserve`, :meth:`try_reserve` and :meth:`release`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from kernelexec._core._tasks import TaskSupervisor
from kernelexec._exceptions import PoolExhaustedError

log = logging.getLogger("kernelexec")


class Evictable(Protocol):
    """What the budget needs of a session's kernel lease."""

    @property
    def agent_id(self) -> str:
        """For logs."""

    @property
    def has_kernel(self) -> bool:
        """Whether it holds a kernel now."""

    @property
    def busy(self) -> bool:
        """Whether a call runs or waits on it."""

    @property
    def last_used(self) -> float:
        """``time.monotonic()`` of its last run's end."""

    async def evict(self) -> None:
        """Give the kernel back (its state is lost; the next call says so)."""


class KernelBudget:
    """The executor-wide cap on kernels, the LRU of idle leases and idle culling.

    Args:
        max_kernels: Most kernels alive or starting at once.
        idle_timeout: Seconds after which an idle lease's kernel is shut down (None: never).
        supervisor: Runs the culling loop.
    """

    def __init__(
        self, max_kernels: int, idle_timeout: float | None, supervisor: TaskSupervisor
    ) -> None:
        self.max_kernels = max_kernels
        self._idle_timeout = idle_timeout
        self._supervisor = supervisor
        self._leases: dict[int, Evictable] = {}
        self.count = 0

    def open(self) -> None:
        """Start idle culling, when an ``idle_timeout`` is set."""
        if self._idle_timeout is not None:
            self._supervisor.spawn("idle culling", self._cull_loop)

    def register(self, lease: Evictable) -> None:
        """Make ``lease`` a candidate for eviction and culling."""
        self._leases[id(lease)] = lease

    def forget(self, lease: Evictable) -> None:
        """Stop considering ``lease`` (its session closed)."""
        self._leases.pop(id(lease), None)

    def try_reserve(self) -> bool:
        """Count one more kernel if there is room without evicting anyone (for prewarming)."""
        if self.count >= self.max_kernels:
            return False
        self.count += 1
        return True

    async def reserve(self) -> None:
        """Count one more kernel, evicting the least recently used idle lease if needed.

        Raises:
            PoolExhaustedError: the cap is reached and every lease is busy.
        """
        while self.count >= self.max_kernels:
            idle = [s for s in self._leases.values() if s.has_kernel and not s.busy]
            if not idle:
                raise PoolExhaustedError(
                    f"all {self.max_kernels} kernels are busy (max_kernels={self.max_kernels}); "
                    "raise max_kernels or retry when a call finishes"
                )
            victim = min(idle, key=lambda s: s.last_used)
            log.info("max_kernels reached: shutting down the kernel of %r", victim.agent_id)
            await victim.evict()
        self.count += 1

    def release(self) -> None:
        """One kernel fewer (shut down, or its start failed)."""
        self.count = max(0, self.count - 1)

    async def _cull_loop(self) -> None:
        assert self._idle_timeout is not None
        interval = max(0.05, min(self._idle_timeout / 2, 10.0))
        while True:
            await asyncio.sleep(interval)
            try:
                await self._cull(time.monotonic() - self._idle_timeout)
            except Exception as exc:
                self._supervisor.record("idle culling", exc)

    async def _cull(self, cutoff: float) -> None:
        for lease in list(self._leases.values()):
            if lease.has_kernel and not lease.busy and lease.last_used < cutoff:
                log.info("shutting down the idle kernel of %r", lease.agent_id)
                await lease.evict()
