"""``KernelPool``: the kernels of one environment: warm ones kept ahead of need, and the
starting, replacing and shutting down of every kernel of that environment.

How many kernels may live at once is not the pool's business: it asks the executor's
:class:`~kernelexec._core._budget.KernelBudget` before starting one and tells it when one is
gone. Warm kernels are refilled one at a time, under the executor's task supervisor, so
refilling never starves running sessions of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Protocol

from kernelexec._core._budget import KernelBudget
from kernelexec._core._run import run_internal
from kernelexec._core._startup import restart_kernel, shutdown_fully, start_kernel
from kernelexec._core._state import Lifecycle
from kernelexec._core._tasks import TaskSupervisor
from kernelexec._exceptions import ExecutorClosedError, KernelStartError, PoolExhaustedError
from kernelexec._observability._logtext import untrusted
from kernelexec._observability._otel import telemetry
from kernelexec._protocol._host import WARM_TRACEBACKS, ExecuteRequest
from kernelexec.backends._base import KernelBackend, KernelConnection, KernelLaunch

log = logging.getLogger("kernelexec")

REFILL_DELAY = 0.2
"""Seconds between handing out a warm kernel and starting its replacement."""


class KernelKeeper(Protocol):
    """May keep a kernel the pool lets go (one that other kernels were forked from)."""

    async def released(self, conn: KernelConnection) -> bool:
        """``conn`` is about to be shut down or replaced: True when the keeper keeps it (the
        pool then leaves it alone), False when the pool shuts it down."""


class KernelPool:
    """Owns the kernels of one environment; see the module docstring."""

    def __init__(
        self,
        backend: KernelBackend,
        launch: KernelLaunch,
        *,
        bootstrap: ExecuteRequest,
        prewarm: int,
        start_timeout: float,
        budget: KernelBudget,
        supervisor: TaskSupervisor,
        keeper: KernelKeeper | None = None,
    ) -> None:
        self._backend = backend
        self._keeper = keeper
        self._launch = launch
        self._bootstrap = bootstrap
        self._prewarm = prewarm
        self._start_timeout = start_timeout
        self._budget = budget
        self._supervisor = supervisor
        self._warm: deque[KernelConnection] = deque()
        self._in_use: set[KernelConnection] = set()
        self._starting = 0
        self._refilling = False
        self._changed = asyncio.Condition()
        self._state = Lifecycle("the executor", opened=True)
        self._span_attributes = {
            "kernelexec.backend": backend.name,
            "kernelexec.isolation": launch.isolation,
        }

    @property
    def warm(self) -> int:
        """Kernels started and waiting for a session."""
        return len(self._warm)

    @property
    def launch(self) -> KernelLaunch:
        """What this pool's kernels are started with."""
        return self._launch

    @property
    def size(self) -> int:
        """Kernels of this environment alive or starting."""
        return len(self._warm) + len(self._in_use) + self._starting

    def open(self) -> None:
        """Start prewarming."""
        self._kick_refill()

    async def wait_warm(self) -> None:
        """Wait until ``prewarm`` kernels are warm (or no more can be started)."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: (
                    len(self._warm) >= self._prewarm or not self._refilling or self._state.closed
                )
            )

    async def acquire(self) -> KernelConnection:
        """A ready kernel for a session: a warm one, one being warmed, or a new one."""
        while True:
            self._state.check()
            if self._warm:
                conn = self._warm.popleft()
                break
            if self._refilling:
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: bool(self._warm) or not self._refilling or self._state.closed
                    )
                continue
            await self._budget.reserve()
            conn = await self._start()
            break
        self._in_use.add(conn)
        # Start the replacement a moment later: launching a kernel takes a core for half a
        # second, and the session that just took this kernel is about to make its first call.
        self._kick_refill(delay=REFILL_DELAY)
        return conn

    async def replace(self, conn: KernelConnection) -> KernelConnection:
        """Swap a session's broken or stuck kernel for a fresh one (state is lost)."""
        self._state.check()
        telemetry().count("kernel.restarts", self._span_attributes)
        with telemetry().span("kernel.restart", self._span_attributes):
            return await self._replace(conn)

    async def _replace(self, conn: KernelConnection) -> KernelConnection:
        if self._warm:
            fresh = self._warm.popleft()
            self._in_use.add(fresh)
            await self.discard(conn)
            return fresh
        if self._keeper is not None and await self._keeper.released(conn):
            # Kept for the kernels forked from it: the session gets a new one in its place
            # (the budget's count passes from the kept kernel to the new one).
            self._in_use.discard(conn)
            fresh = await self._start()
            self._in_use.add(fresh)
            return fresh
        try:
            await restart_kernel(conn, self._bootstrap, self._start_timeout)
        except BaseException:
            await self.discard(conn)
            raise
        return conn

    def adopt(self, conn: KernelConnection) -> None:
        """Take a kernel started elsewhere (a branch) as one of this pool's, in use; the
        caller has counted it in the budget."""
        self._state.check()
        self._in_use.add(conn)

    async def exchange(self, old: KernelConnection | None, new: KernelConnection) -> None:
        """A session puts ``new`` (a restored branch) in place of ``old``: ``new`` takes
        ``old``'s place in the budget (the caller counted it when there was no ``old``)."""
        self._in_use.add(new)
        if old is None:
            return
        self._in_use.discard(old)
        if self._keeper is None or not await self._keeper.released(old):
            await shutdown_fully(old)

    async def discard(self, conn: KernelConnection) -> None:
        """Shut a kernel down and forget it."""
        known = conn in self._in_use or conn in self._warm
        self._in_use.discard(conn)
        with contextlib.suppress(ValueError):
            self._warm.remove(conn)
        if self._keeper is None or not await self._keeper.released(conn):
            await shutdown_fully(conn)
        if known:
            self._budget.release()
        self._kick_refill()

    async def aclose(self) -> None:
        """Shut every kernel of this environment down."""
        self._state.close()
        conns = [*self._warm, *self._in_use]
        self._warm.clear()
        self._in_use.clear()
        await asyncio.gather(*(c.shutdown() for c in conns), return_exceptions=True)
        for _ in conns:
            self._budget.release()
        async with self._changed:
            self._changed.notify_all()

    # -- internals ---------------------------------------------------------------------------

    def _warm_enough(self) -> bool:
        return len(self._warm) >= self._prewarm or not self._refilling or self._state.closed

    async def _start(self) -> KernelConnection:
        """Start one kernel; the caller has reserved it in the budget."""
        self._starting += 1
        try:
            with telemetry().span("kernel.start", self._span_attributes):
                conn = await start_kernel(
                    self._backend, self._launch, self._bootstrap, self._start_timeout
                )
            telemetry().count("kernel.starts", self._span_attributes)
            log.debug(
                "kernel started (pid %s; %s backend, isolation %s)",
                conn.kernel_pid() or "-",
                self._backend.name,
                self._launch.isolation,
            )
        except BaseException:
            self._budget.release()
            raise
        finally:
            self._starting -= 1
        if self._state.closed:
            await conn.shutdown()
            self._budget.release()
            self._state.check()
        return conn

    def _kick_refill(self, delay: float = 0.0) -> None:
        if self._state.closed or self._refilling or len(self._warm) >= self._prewarm:
            return
        self._refilling = True
        self._supervisor.spawn("prewarming", lambda: self._refill(delay))

    async def _refill(self, delay: float = 0.0) -> None:
        try:
            if delay:
                await asyncio.sleep(delay)
            while not self._state.closed and len(self._warm) < self._prewarm:
                if not self._budget.try_reserve():
                    break
                try:
                    conn = await self._start()
                except (KernelStartError, ExecutorClosedError, PoolExhaustedError) as exc:
                    # PoolExhaustedError: a remote service (a gateway) has no room now.
                    log.warning("prewarming a kernel failed: %s", untrusted(exc))
                    break
                try:
                    # Ahead of need there is time for what would slow the first error down.
                    await run_internal(conn, WARM_TRACEBACKS, self._start_timeout)
                except BaseException:
                    await shutdown_fully(conn)
                    self._budget.release()
                    raise
                self._warm.append(conn)
                async with self._changed:
                    self._changed.notify_all()
        finally:
            self._refilling = False
            async with self._changed:
                self._changed.notify_all()
