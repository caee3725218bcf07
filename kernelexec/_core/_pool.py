"""``KernelPool``: the kernels of one environment, prewarmed, capped and culled.

The pool counts kernels that are warm (started, unassigned), in use by a session, or starting;
together they never exceed ``max_kernels``. When a session needs a kernel and the cap is
reached, the least recently used idle session gives its kernel back; when every session is busy,
:class:`PoolExhaustedError` is raised at once instead of waiting without bound. Warm kernels are
refilled one at a time, so refilling never starves running sessions of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kernelexec._core._run import run_internal
from kernelexec._exceptions import ExecutorClosedError, KernelStartError, PoolExhaustedError
from kernelexec.backends._base import ExecuteRequest, KernelBackend, KernelConnection

if TYPE_CHECKING:
    from kernelexec._core._session import AsyncSession

log = logging.getLogger("kernelexec")

_WARM_TRACEBACKS = ExecuteRequest(
    code="__import__('__kernelexec__').warm_tracebacks()", silent=True, store_history=False
)

REFILL_DELAY = 0.2
"""Seconds between handing out a warm kernel and starting its replacement."""


class KernelPool:
    """Owns the kernels of one environment; see the module docstring for the policy.

    ``total`` counts the kernels of every pool of the executor, so ``max_kernels`` caps them
    all together and LRU eviction picks from every environment's sessions.
    """

    def __init__(
        self,
        backend: KernelBackend,
        *,
        env: dict[str, str],
        bootstrap: ExecuteRequest,
        max_kernels: int,
        prewarm: int,
        start_timeout: float,
        idle_timeout: float | None,
        sessions: Callable[[], list[AsyncSession]],
        total: Callable[[], int] | None = None,
    ) -> None:
        self._backend = backend
        self._env = env
        self._bootstrap = bootstrap
        self._max = max_kernels
        self._prewarm = prewarm
        self._start_timeout = start_timeout
        self._idle_timeout = idle_timeout
        self._sessions = sessions
        self._total = total or (lambda: self.size)  # kernels counted against max_kernels
        self._warm: deque[KernelConnection] = deque()
        self._in_use: set[KernelConnection] = set()
        self._starting = 0
        self._refilling = False
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def size(self) -> int:
        """Kernels alive or starting."""
        return len(self._warm) + len(self._in_use) + self._starting

    @property
    def warm_count(self) -> int:
        """Kernels started and waiting for a session."""
        return len(self._warm)

    def open(self) -> None:
        """Start background work: prewarming and idle culling."""
        self._kick_refill()
        if self._idle_timeout is not None:
            self._spawn(self._cull_loop())

    async def wait_warm(self) -> None:
        """Wait until ``prewarm`` kernels are warm (or no more can be started)."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: len(self._warm) >= self._prewarm or not self._refilling or self._closed
            )

    async def acquire(self) -> KernelConnection:
        """A ready kernel for a session: a warm one, one being warmed, or a new one."""
        while True:
            self._check_open()
            if self._warm:
                conn = self._warm.popleft()
                break
            if self._refilling:
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: bool(self._warm) or not self._refilling or self._closed
                    )
                continue
            await self._make_room()
            conn = await self._start()
            break
        self._in_use.add(conn)
        # Start the replacement a moment later: launching a kernel takes a core for half a
        # second, and the session that just took this kernel is about to make its first call.
        self._kick_refill(delay=REFILL_DELAY)
        return conn

    async def replace(self, conn: KernelConnection) -> KernelConnection:
        """Swap a session's broken or stuck kernel for a fresh one (state is lost)."""
        self._check_open()
        if self._warm:
            fresh = self._warm.popleft()
            self._in_use.add(fresh)
            await self.discard(conn)
            self._kick_refill()
            return fresh
        try:
            await asyncio.wait_for(conn.restart(), self._start_timeout + 5)
            await self._install(conn)
        except BaseException:
            await self.discard(conn)
            raise
        return conn

    async def discard(self, conn: KernelConnection) -> None:
        """Shut a kernel down and forget it."""
        self._in_use.discard(conn)
        with contextlib.suppress(ValueError):
            self._warm.remove(conn)
        await asyncio.shield(conn.shutdown())
        self._kick_refill()

    async def aclose(self) -> None:
        """Stop background work and shut every kernel down."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        conns = [*self._warm, *self._in_use]
        self._warm.clear()
        self._in_use.clear()
        await asyncio.gather(*(c.shutdown() for c in conns), return_exceptions=True)
        async with self._changed:
            self._changed.notify_all()

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorClosedError("the executor is closed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _make_room(self) -> None:
        if self._total() < self._max:
            return
        idle = [s for s in self._sessions() if s.has_kernel and not s.busy]
        if not idle:
            raise PoolExhaustedError(
                f"all {self._max} kernels are busy (max_kernels={self._max}); "
                "raise max_kernels or retry when a call finishes"
            )
        victim = min(idle, key=lambda s: s.last_used)
        log.info("max_kernels reached: shutting down the kernel of %r", victim.agent_id)
        await victim.evict()

    async def _start(self) -> KernelConnection:
        self._starting += 1
        try:
            conn = await self._backend.start(env=self._env, timeout=self._start_timeout)
        finally:
            self._starting -= 1
        try:
            await self._install(conn)
        except BaseException:
            await asyncio.shield(conn.shutdown())
            raise
        if self._closed:
            await conn.shutdown()
            self._check_open()
        return conn

    async def _install(self, conn: KernelConnection) -> None:
        out = await run_internal(conn, self._bootstrap, self._start_timeout)
        if out.died or out.timed_out or (out.reply or {}).get("status") != "ok":
            detail = (out.error or out.reply or {}).get("evalue", "no reply")
            raise KernelStartError(f"installing kernelexec's helper in the kernel failed: {detail}")

    def _kick_refill(self, delay: float = 0.0) -> None:
        if self._closed or self._refilling or len(self._warm) >= self._prewarm:
            return
        if self._total() >= self._max:
            return
        self._refilling = True
        self._spawn(self._refill(delay))

    async def _refill(self, delay: float = 0.0) -> None:
        try:
            if delay:
                await asyncio.sleep(delay)
            while (
                not self._closed and len(self._warm) < self._prewarm and self._total() < self._max
            ):
                try:
                    conn = await self._start()
                    # Ahead of need there is time for what would slow the first error down.
                    await run_internal(conn, _WARM_TRACEBACKS, self._start_timeout)
                except (KernelStartError, ExecutorClosedError) as exc:
                    log.warning("prewarming a kernel failed: %s", exc)
                    break
                self._warm.append(conn)
                async with self._changed:
                    self._changed.notify_all()
        finally:
            self._refilling = False
            async with self._changed:
                self._changed.notify_all()

    async def _cull_loop(self) -> None:
        assert self._idle_timeout is not None
        interval = max(0.05, min(self._idle_timeout / 2, 10.0))
        while not self._closed:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for session in self._sessions():
                if (
                    session.has_kernel
                    and not session.busy
                    and now - session.last_used > self._idle_timeout
                ):
                    log.info("shutting down the idle kernel of %r", session.agent_id)
                    await session.evict()
