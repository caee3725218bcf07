"""``KernelLease``: one session's hold on a kernel: taking one, replacing it, giving it back,
and the user's variable names, so that whoever loses them is told which.

The lease owns the session's FIFO lock (``hold``): a kernel runs one of the session's calls at
a time, in the order they were made. The executor's budget sees a lease only through
``busy``, ``has_kernel``, ``last_used`` and ``evict``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from kernelexec._core._pool import KernelPool
from kernelexec._core._run import run_internal
from kernelexec._durable._keeper import SessionState
from kernelexec._exceptions import ConfigError, KernelStartError, StateError
from kernelexec._models import Hibernation, Restored
from kernelexec._observability._logtext import untrusted
from kernelexec._proctitle import kernel_title
from kernelexec._protocol._host import ExecuteRequest
from kernelexec._sandbox._lend import Loan, LoanMode
from kernelexec._sandbox._lend import check as check_lendable
from kernelexec._sandbox._users import within
from kernelexec.backends._base import KernelConnection

log = logging.getLogger("kernelexec.kernel")


class KernelWatcher(Protocol):
    """Told whenever a lease's kernel changes (the live-attach registry is one)."""

    def kernel_changed(self, conn: KernelConnection | None) -> None:
        """The lease's kernel is now ``conn`` (None: it has none)."""

    def close(self) -> None:
        """The session is gone."""


class KernelLease:
    """A session's kernel, started lazily and replaced when it breaks.

    Args:
        agent_id: The session's agent id (for logs).
        pool: Returns the pool of the session's environment; awaited on first use (it may
            build a virtual environment).
        workdir: The session's working directory, as the kernel sees it; a fresh kernel
            creates it and changes into it on its first request.
        watcher: Told when the kernel changes.
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
        watcher: KernelWatcher | None = None,
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
        self.watcher = watcher
        self.generation = 0
        """How many kernels this lease has had (the current one's number)."""
        self.last_used = time.monotonic()
        self.on_evicted: Callable[[], None] | None = None
        """Told when the budget took the kernel back (the executor then forgets the session)."""
        self.on_attached: Callable[[], None] | None = None
        """Told when a kernel is attached (the executor then knows the session again)."""
        self.keeper: SessionState | None = None
        """The session's durable state (with a ``state_dir``): saved before the kernel goes,
        restored into the next one."""
        self._restored: Restored | None = None
        self._lent: dict[str, Loan] = {}
        self._private = private

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
        await self._attached(branched=True)
        self._names = names
        if self.on_attached is not None:
            self.on_attached()

    async def swap(
        self, conn: KernelConnection, names: tuple[str, ...], *, same: bool = False
    ) -> None:
        """Put ``conn`` (a restored snapshot, holding ``names``) in place of the kernel;
        ``same``: ``conn`` is a fork of the kernel made between two runs, which it continues
        (its number stays: recordings, ``setup_code`` and installed helpers carry over)."""
        if self._pool is None:
            self._pool = await self._get_pool()
        if self.keeper is not None and self._conn is None:
            await self.keeper.hold_agent()
        old, self._conn = self._conn, conn
        await self._pool.exchange(old, conn)
        await self._attached(branched=True, same=same)
        self._names = names
        if old is None and self.on_attached is not None:
            self.on_attached()

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
        if self._conn is None:
            if self.keeper is not None:
                await self.keeper.hold_agent()  # another executor may hold it: asked to let go
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
            if self.on_attached is not None:
                self.on_attached()
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
        old, self._conn = self._conn, None
        self._names = ()
        if self.keeper is not None:
            await self.keeper.invalidate()  # never bring back what the lost kernel had saved
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
        and reports what was lost, or (durable) gets the state restored."""
        async with self._lock:  # a durable save holds the session until the kernel is gone
            if self._conn is None:
                return
            if self.keeper is None:
                self._lost = (self._lost or []) + list(self._names)
            else:
                try:
                    await self.keeper.save(self._run, self.generation)
                    self.keeper.kernel_gone()
                except StateError as exc:
                    log.warning(
                        "agent %r: hibernating failed, state lost: %s",
                        self.agent_id,
                        untrusted(exc),
                    )
                    self._lost = (self._lost or []) + list(self._names)
                    await self.keeper.invalidate()
            await self._give_back()

    async def hibernate(self) -> Hibernation:
        """Save the state and give the kernel back (the caller holds the lease).

        Raises:
            ConfigError: the executor has no ``state_dir``.
            StateError: the state could not be saved (the kernel is kept, the older
                checkpoint deleted).
        """
        if self.keeper is None:
            raise ConfigError("hibernate() needs an executor with a state_dir")
        if self._conn is None:
            return await self.keeper.on_disk()
        try:
            saved = await self.keeper.save(self._run, self.generation)
        except StateError:
            await self.keeper.invalidate()  # the kernel keeps the state; the disk never lags it
            raise
        self.keeper.kernel_gone()
        await self._give_back()
        return saved

    async def after_call(self, answer: Any) -> None:
        """Commit the checkpoint the kernel side made after a call (``after_call``), or (before
        the session's first checkpoint) mark on disk the names a killed host loses."""
        keeper = self.keeper
        if keeper is None or self._conn is None:
            return
        if keeper.checkpoint == "after_call":
            await keeper.after_call(answer, self._run, self.generation)
        await keeper.names_seen(self._names)

    async def _give_back(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._names = ()
        self._tell(None)
        if self.keeper is not None:
            self.keeper.let_agent_go()  # saved, and no call reaches that kernel any more
        assert self._pool is not None
        await self._pool.discard(conn)
        if self.on_evicted is not None:
            self.on_evicted()

    async def _run(self, request: ExecuteRequest, timeout: float) -> dict[str, Any]:
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
        """Shut the kernel down for good (the session closed)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._tell(None)
        if conn is not None and self._pool is not None:
            await self._pool.discard(conn)
        if self.keeper is not None:
            self.keeper.let_agent_go()

    async def _attached(self, branched: bool = False, same: bool = False) -> list[str]:
        """Set a fresh kernel up; return the names a restore did not bring back. A
        ``branched`` kernel (a fork, a restored snapshot) holds its state already: nothing is
        restored into it, and a saved checkpoint of this session is stale; one that is the
        ``same`` as the kernel it replaces (see :meth:`swap`) only enters its directories."""
        assert self._conn is not None
        await self._conn.enter_workdir(self._workdir)
        for path, loan in list(self._lent.items()):
            try:
                await self._conn.lend(loan, self._workdir)
            except KernelStartError as exc:
                # The fresh kernel works without it; the next lend() of it says why it fails.
                log.warning("%r: %s; not lent again", self.agent_id, untrusted(exc))
                del self._lent[path]
        if same:
            self._tell(self._conn)
            return []
        self.generation += 1
        self._names = ()
        self._fresh = True
        self._tell(self._conn)
        if self.keeper is None:
            return []
        conn = self._conn
        restored, missing = await self.keeper.attached(
            self._run, self.generation, lambda: conn.enter_workdir(self._workdir), branched
        )
        if restored is not None:
            self._restored = restored
            self._names = tuple(restored.names)
        return missing

    def _tell(self, conn: KernelConnection | None) -> None:
        if self.watcher is not None:
            self.watcher.kernel_changed(conn)
