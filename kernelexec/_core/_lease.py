"""``KernelLease``: one session's hold on a kernel: taking one, replacing it, giving it back,
and the user's variable names, so that whoever loses them is told which.

The lease owns the session's FIFO lock (``hold``): a kernel runs one of the session's calls at
a time, in the order they were made. The executor's budget sees a lease only through
``busy``, ``has_kernel``, ``last_used`` and ``evict``.

A session feature that must know about the kernel (its durable state, its place in the
executor's registry, its live-attach entry, its files link, code mode) is a
:class:`KernelWatcher`: whoever assembles the session makes the lease, then
``lease.subscribe(watcher)`` for each feature, in order. The lease tells its watchers, in
that order, before a kernel is taken where it has none, when a kernel is attached, when it is
leaving (and why), after every run, and when the session is gone; it names no feature.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kernelexec._core._pool import KernelPool
from kernelexec._core._run import run_internal
from kernelexec._exceptions import KernelStartError, StateError
from kernelexec._models import Restored
from kernelexec._observability._logtext import untrusted
from kernelexec._proctitle import kernel_title
from kernelexec._protocol._host import ExecuteRequest
from kernelexec._sandbox._lend import Loan, LoanMode
from kernelexec._sandbox._lend import check as check_lendable
from kernelexec._sandbox._users import within
from kernelexec.backends._base import KernelConnection

log = logging.getLogger("kernelexec.kernel")

Leaving = Literal["evict", "saved", "lost"]
"""Why a kernel leaves its lease: ``"evict"``, given back whole (idle culling, the budget, a
durable close): a watcher that keeps state saves it now; ``"saved"``, given back after a
watcher saved its state (``hibernate``); ``"lost"``, broken or replaced, its state gone (a
saved checkpoint of it is stale). The kernel a closed session still has is shut down after
``gone``, unannounced."""


Arrival = Literal["fresh", "branched", "same"]
"""How a kernel came to its lease: ``"fresh"``, a new kernel (a kept state is restored into
it); ``"branched"``, a fork or a restored snapshot, holding a state of its own (a kept one is
stale); ``"same"``, a fork put in place of the kernel it continues, between two runs: the same
number and state, only its connection is new."""


@dataclass(frozen=True, slots=True)
class LeasedKernel:
    """The lease's kernel as its watchers see it at one event.

    Attributes:
        conn: The kernel's connection.
        generation: Its number (the lease's first kernel is 1).
        names: The user's variable names it holds now.
        workdir: The session's working directory, as the kernel sees it.
        ask: Runs one of kernelexec's own requests on it; returns the reply (``StateError``
            when the kernel died or did not answer in time).
    """

    conn: KernelConnection
    generation: int
    names: tuple[str, ...]
    workdir: str
    ask: Callable[[ExecuteRequest, float], Awaitable[dict[str, Any]]]


class KernelWatcher(Protocol):
    """A session feature that follows the lease's kernel (subscribed with
    :meth:`KernelLease.subscribe`). Every method runs while the session is held (no call of it
    runs meanwhile), except :meth:`gone`."""

    async def attaching(self) -> None:
        """The lease, which has no kernel, is about to take one; raise to refuse (the lease
        stays without one: durable state does when another executor holds the agent)."""

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        """A kernel is attached (set up: in the working directory, lent directories shown),
        ``how`` (see :data:`Arrival`). Return what was restored into it (durable state), else
        None."""

    async def before_use(self, kernel: LeasedKernel) -> None:
        """The attached kernel is about to be used again (a run, a file operation, a fork).
        A watcher may give it back first (durable state does when another host's executor
        took its agent away): a fresh kernel is then attached as after ``attaching``."""

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        """``kernel`` is about to go (see :data:`Leaving`); it still runs. Return True only
        when ``why`` is ``"evict"`` and this watcher kept the kernel's state (its names are
        then not reported lost)."""

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        """A run of the session reached a kernel and ended (``kernel``: the lease's kernel
        now, None when a lost one could not be replaced); ``extras``: what the kernel side
        reported beside the result (None: no report, the run failed before or lost it)."""

    def gone(self) -> None:
        """The session is closed or forgotten: let go of what it held (idempotent)."""


class KernelLease:
    """A session's kernel, started lazily and replaced when it breaks.

    Args:
        agent_id: The session's agent id (for logs).
        pool: Returns the pool of the session's environment; awaited on first use (it may
            build a virtual environment).
        workdir: The session's working directory, as the kernel sees it; a fresh kernel
            creates it and changes into it on its first request.
        env: Variables to set in each fresh kernel with its first request (the executor's
            ``env_vars``, for a backend whose kernels may not get them at launch).
        private: The executor's own directories, which no directory lent to the kernels may
            overlap.
    """

    def __init__(
        self,
        agent_id: str,
        pool: Callable[[], Awaitable[KernelPool]],
        workdir: str,
        *,
        env: dict[str, str] | None = None,
        private: tuple[str, ...] = (),
    ) -> None:
        self.agent_id = agent_id
        self.workdir = workdir
        self._get_pool = pool
        self._workdir = workdir
        self._env = dict(env or {})
        self._pool: KernelPool | None = None
        self._lock = asyncio.Lock()
        self._conn: KernelConnection | None = None
        self._names: tuple[str, ...] = ()
        self._lost: list[str] | None = None  # state lost outside a run, not yet reported
        self._fresh = False
        self._watchers: list[KernelWatcher] = []
        self.generation = 0
        """How many kernels this lease has had (the current one's number)."""
        self.last_used = time.monotonic()
        self._restored: Restored | None = None
        self._lent: dict[str, Loan] = {}
        self._private = private

    def subscribe(self, watcher: KernelWatcher) -> None:
        """Tell ``watcher`` about the lease's kernels from now on, after those subscribed
        before it (a watcher that keeps state comes before one that acts on its being kept)."""
        self._watchers.append(watcher)

    @property
    def busy(self) -> bool:
        """True while a call runs or waits to run."""
        return self._lock.locked()

    @property
    def has_kernel(self) -> bool:
        """Whether a kernel is attached now (it may be evicted when idle)."""
        return self._conn is not None

    @property
    def connection(self) -> KernelConnection | None:
        """The attached kernel, if any."""
        return self._conn

    @property
    def kernel(self) -> LeasedKernel | None:
        """The attached kernel as a watcher sees it, if any."""
        if self._conn is None:
            return None
        return LeasedKernel(self._conn, self.generation, self._names, self._workdir, self._ask)

    @property
    def names(self) -> tuple[str, ...]:
        """The user's variable names after the last run."""
        return self._names

    @property
    def pool(self) -> KernelPool | None:
        """The pool of the session's environment, once a kernel was taken from it."""
        return self._pool

    async def adopt(self, conn: KernelConnection, pool: KernelPool, names: tuple[str, ...]) -> None:
        """Take ``conn`` (a fork of another session's kernel, already in ``pool``) as this
        lease's kernel, holding ``names``."""
        self._pool = pool
        self._conn = conn
        await self._attached("branched")
        self._names = names

    async def swap(
        self, conn: KernelConnection, names: tuple[str, ...], *, same: bool = False
    ) -> None:
        """Put ``conn`` (a restored snapshot, holding ``names``) in place of the kernel;
        ``same``: ``conn`` is a fork of the kernel made between two runs, which it continues
        (its number stays: recordings, ``setup_code`` and installed helpers carry over)."""
        if self._pool is None:
            self._pool = await self._get_pool()
        if self._conn is None:
            await self._attaching()
        old, self._conn = self._conn, conn
        await self._pool.exchange(old, conn)
        await self._attached("same" if same else "branched")
        self._names = names

    async def lend(self, path: str | os.PathLike[str], *, mode: LoanMode) -> str:
        """Show the host directory ``path`` to the session's kernels, at the same path, from
        now on, in ``mode`` (:mod:`kernelexec._sandbox._lend`: ``"own"``, ``"copy"`` or
        ``"read"``); copy on write, the changes are kept in the session's working directory.
        A directory that is, holds or lies in one lent already is left as it is (one loan never
        hides another). Returns its real path.

        Where kernels run as the host's user the kernel sees the directory already and works
        in it directly: nothing is mounted.

        Raises:
            ConfigError: ``path`` is not a directory, overlaps the executor's own, or (unless
                ``mode="own"``) is out of other users' reach.
            KernelStartError: it could not be shown to the kernel (the message says why).
        """
        loan = await asyncio.to_thread(check_lendable, path, mode, self._private)
        async with self.hold():
            if not self._overlaps(loan.path):
                if self._conn is not None:
                    await self._conn.lend(loan, self._workdir)
                self._lent[loan.path] = loan
        return loan.path

    def _overlaps(self, path: str) -> bool:
        return any(within(path, p) or within(p, path) for p in self._lent)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Exclusive use of the lease, in the order asked for."""
        async with self._lock:
            try:
                yield
            finally:
                self.last_used = time.monotonic()

    async def attach(self) -> tuple[KernelConnection, list[str] | None]:
        """The kernel to run on (taken from the pool if none is attached), and the variable
        names lost since the last run when state was lost (else None)."""
        missing: list[str] = []
        if self._conn is not None:
            await self._before_use()  # a watcher may give it back (its agent was taken away)
        if self._conn is None:
            await self._attaching()  # a watcher may refuse (another executor holds the agent)
            if self._pool is None:
                self._pool = await self._get_pool()
            # If no kernel can be had now (a gateway that is down), the lost names wait for
            # the run that gets one.
            self._conn = await self._pool.acquire()
            missing = await self._attached()
            log.info(
                "agent %r: kernel %d attached (pid %s)",
                self.agent_id,
                self.generation,
                self._conn.kernel_pid() or "-",
            )
        lost, self._lost = self._lost, None
        if missing:
            lost = (lost or []) + missing
        return self._conn, lost

    def take_restored(self) -> Restored | None:
        """What the last restore brought back, once (for the next result)."""
        restored, self._restored = self._restored, None
        return restored

    def put_back_lost(self, lost: list[str] | None) -> None:
        """Hand back what :meth:`attach` returned, unreported (a file operation attached the
        kernel): the session's next run reports it, a restart with no names included."""
        if lost is not None:
            self._lost = lost + (self._lost or [])

    def take_settings(self) -> dict[str, Any] | None:
        """The settings a fresh kernel still needs (sent with its first request), once."""
        if not self._fresh:
            return None
        self._fresh = False
        isolation = self._pool.launch.isolation if self._pool is not None else "none"
        settings: dict[str, Any] = {
            "cwd": self._workdir,
            "title": kernel_title(self.agent_id, isolation),
        }
        if self._env:
            settings["env"] = self._env
        return settings

    def update_names(self, names: tuple[str, ...]) -> None:
        """The user's variable names after a run."""
        self._names = names

    async def replace(self) -> list[str]:
        """Give the kernel a fresh one in its place now; return the names that were lost."""
        lost = list(self._names)
        leaving = self.kernel
        old, self._conn = self._conn, None
        self._names = ()
        if leaving is not None:
            await self._leaving(leaving, "lost")  # never bring back what it had saved
        if old is not None:
            assert self._pool is not None
            try:
                self._conn = await self._pool.replace(old)
            except BaseException:
                # No kernel now (e.g. a remote gateway is down): the run that gets the next
                # kernel reports what was lost.
                self._lost = (self._lost or []) + lost
                raise
            await self._attached()
            log.info(
                "agent %r: kernel %d replaces the last one (pid %s); %d variable(s) lost",
                self.agent_id,
                self.generation,
                self._conn.kernel_pid() or "-",
                len(lost),
            )
        return lost

    async def lose_state(self) -> None:
        """Replace the kernel, and report the lost names with the next run."""
        self._lost = (self._lost or []) + await self.replace()

    async def evict(self) -> None:
        """Give the kernel back (idle culling, the budget, close); the next run starts fresh
        and reports what was lost, or (a watcher kept the state) gets the state restored."""
        async with self._lock:  # a save holds the session until the kernel is gone
            await self.give_back("evict")

    async def give_back(self, why: Literal["evict", "saved"]) -> None:
        """Give the kernel back now (the caller holds the lease): ``"saved"`` once a watcher
        saved its state (``hibernate``), else as :meth:`evict` does."""
        kernel = self.kernel
        if kernel is None:
            return
        await self._leaving(kernel, why)
        conn, self._conn = self._conn, None
        self._names = ()
        assert self._pool is not None and conn is not None
        await self._pool.discard(conn)

    async def after_run(self, extras: Mapping[str, Any] | None) -> None:
        """A run reached the kernel and ended: tell the watchers (``extras``: what the kernel
        side reported beside the result, None when it reported nothing)."""
        kernel = self.kernel
        for watcher in self._watchers:
            await watcher.after_run(kernel, extras)

    def gone(self) -> None:
        """The session is closed or forgotten: tell the watchers."""
        for watcher in self._watchers:
            watcher.gone()

    async def _ask(self, request: ExecuteRequest, timeout: float) -> dict[str, Any]:
        conn = self._conn
        assert conn is not None
        out = await run_internal(conn, request, timeout)
        if out.reply is None or out.died or out.timed_out:
            raise StateError("the kernel died or did not answer in time")
        return out.reply

    def pending_lost(self) -> list[str]:
        """Names lost outside a run and not yet reported."""
        return list(self._lost or [])

    def carry_lost(self, names: list[str]) -> None:
        """Report ``names`` as lost with the next run (a forgotten session's, for its agent)."""
        if names:
            self._lost = (self._lost or []) + names

    async def release(self) -> None:
        """Shut the kernel down for good (the session closed: its watchers were told
        ``gone``)."""
        conn, self._conn = self._conn, None
        if conn is not None and self._pool is not None:
            await self._pool.discard(conn)

    async def _before_use(self) -> None:
        for watcher in self._watchers:
            kernel = self.kernel
            if kernel is None:
                return
            await watcher.before_use(kernel)

    async def _attaching(self) -> None:
        for watcher in self._watchers:
            await watcher.attaching()

    async def _leaving(self, kernel: LeasedKernel, why: Leaving) -> None:
        """Tell the watchers, in order; on an eviction the names are lost unless one of them
        kept the state (accounted before the next watcher hears of it: the registry's entry
        may let the session be collected, taking what it lost along)."""
        before = self._lost
        if why == "evict":
            self._lost = (self._lost or []) + list(kernel.names)
        for watcher in self._watchers:
            if await watcher.leaving(kernel, why) and why == "evict":
                self._lost = before

    async def _attached(self, how: Arrival = "fresh") -> list[str]:
        """Set a kernel up and tell the watchers (see :data:`Arrival`); return the names a
        restore did not bring back."""
        assert self._conn is not None
        await self._conn.enter_workdir(self._workdir)
        for path, loan in list(self._lent.items()):
            try:
                await self._conn.lend(loan, self._workdir)
            except KernelStartError as exc:
                # The fresh kernel works without it; the next lend() of it says why it fails.
                log.warning("%r: %s; not lent again", self.agent_id, untrusted(exc))
                del self._lent[path]
        if how != "same":
            self.generation += 1
            self._names = ()
            self._fresh = True
        missing: list[str] = []
        for watcher in self._watchers:
            kernel = self.kernel
            assert kernel is not None
            restored = await watcher.attached(kernel, how)
            if restored is not None:
                self._restored = restored
                self._names = tuple(restored.names)
                missing = sorted(restored.not_restored)
        return missing
