"""``SessionBranches``: ``fork``, ``snapshot`` and ``restore`` of an executor's sessions.

The processes are forked by :mod:`kernelexec._branching`; this module is the session side:
the budget (children count against ``max_kernels``, checked before anything is forked), making
each new kernel ready (the kernel-side helper, inherited, is installed again around the new
kernel), the children's sessions (made by the session assembly), the working directory's
files, and putting a restored kernel in place of a session's kernel.

Every method runs with the session held (its lease's lock), so a fork waits for the session's
running call and never copies a kernel in the middle of one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kernelexec import _workdirs
from kernelexec._aio import finish_shielded
from kernelexec._branching._family import AsyncSnapshot, Brancher
from kernelexec._core._budget import KernelBudget
from kernelexec._core._results import Ran
from kernelexec._core._startup import make_ready, shutdown_fully
from kernelexec._exceptions import (
    BranchError,
    BranchingNotSupportedError,
    KernelStartError,
    PoolExhaustedError,
    TreeLimitError,
)
from kernelexec._models import StateChanges
from kernelexec._protocol import _kernel_side as kernel_side
from kernelexec._protocol._host import ExecuteRequest
from kernelexec._tempdirs import make_owned_dir
from kernelexec.backends._base import KernelConnection

if TYPE_CHECKING:
    from kernelexec._core._session import AsyncSession

log = logging.getLogger("kernelexec")

Adopt = Callable[["AsyncSession", KernelConnection], Awaitable["AsyncSession"]]
"""Makes the child session of a parent session around a forked kernel (the assembly's)."""


class SessionBranches:
    """Forks, snapshots and restores the sessions of one executor (module docstring).

    Args:
        brancher: Forks the processes.
        budget: The executor's kernel budget.
        bootstrap: The request that installs the kernel side in a fresh kernel.
        timeout: Seconds a new kernel has to become ready.
        backend: The backend's name (for errors).
        adopt: Makes a child session around a forked kernel.
    """

    def __init__(
        self,
        brancher: Brancher,
        budget: KernelBudget,
        bootstrap: ExecuteRequest,
        timeout: float,
        backend: str,
        adopt: Adopt,
    ) -> None:
        self.brancher = brancher
        self._budget = budget
        # A fork inherits the helper's code: running its install() again around the new
        # kernel is enough (the source is not compiled again).
        self._reinstall = dataclasses.replace(
            bootstrap, code=f"__import__({kernel_side.MODULE_NAME!r}).install()"
        )
        self._timeout = timeout
        self._backend = backend
        self._adopt = adopt

    async def fork(self, session: AsyncSession, n: int) -> list[AsyncSession]:
        """``n`` children of ``session`` (held by the caller); see :meth:`AsyncSession.fork`."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, not {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        self.brancher.check(None, session.isolation.level, self._backend)
        conn = await self._kernel(session)
        self.brancher.check(conn, session.isolation.level, self._backend)
        reserved = 0
        try:
            for _ in range(n):
                if not self._budget.try_reserve():
                    raise PoolExhaustedError(
                        f"forking {n} children of {session.agent_id!r} would exceed "
                        f"max_kernels={self._budget.max_kernels} ({self._budget.count - reserved} "
                        "kernels live); nothing was forked"
                    )
                reserved += 1
            children = await self._branches(conn, session.agent_id, n)
        except BaseException:
            for _ in range(reserved):
                self._budget.release()
            raise
        inherited = session.setup_current  # the children are forks of a set-up kernel
        made: list[AsyncSession] = []
        for child in children:
            made.append(await self._adopt(session, child))
            if inherited:
                made[-1].setup_inherited()
        return made

    async def snapshot(self, session: AsyncSession) -> AsyncSnapshot:
        """A frozen copy of ``session`` (held by the caller); see
        :meth:`AsyncSession.snapshot`."""
        self.brancher.check(None, session.isolation.level, self._backend)
        conn = await self._kernel(session)
        self.brancher.check(conn, session.isolation.level, self._backend)
        template = await self.brancher.snapshot(conn, session.agent_id)
        snap = AsyncSnapshot(self.brancher, template, session.agent_id, session.lease.names)
        snap.setup_ran = session.setup_current
        snap.outlives_kernel = _outlived_by_forks(conn)
        if isinstance(session.workdir, Path):
            files = make_owned_dir("kx-")
            template.extra_dirs.append(files)
            os.mkdir(os.path.join(files, "w"), 0o700)
            await asyncio.to_thread(copy_workdir, session.workdir, Path(files, "w"))
            snap.files = os.path.join(files, "w")
        return snap

    async def restore(self, session: AsyncSession, snap: AsyncSnapshot) -> None:
        """Put ``session`` (held by the caller) back to ``snap``; see
        :meth:`AsyncSession.restore`."""
        if not isinstance(snap, AsyncSnapshot):
            raise TypeError(f"snap must be a kernelexec.AsyncSnapshot, not {type(snap).__name__}")
        if snap.agent_id != session.agent_id:
            raise ValueError(
                f"the snapshot was taken of session {snap.agent_id!r}, not {session.agent_id!r}"
            )
        self.brancher.check(session.lease.connection, session.isolation.level, self._backend)
        reserved = not session.lease.has_kernel
        if reserved:
            await self._budget.reserve()
        try:
            conn = (await self._branches_of(snap, session.agent_id, 1))[0]
        except BaseException:
            if reserved:
                self._budget.release()
            raise
        if snap.files is not None and isinstance(session.workdir, Path):
            await asyncio.to_thread(_workdirs.replace, Path(snap.files), session.workdir)
        await session.lease.swap(conn, snap.names)
        if snap.setup_ran:
            session.setup_inherited()  # restored exactly: setup_code is not run over it

    # -- atomic runs ---------------------------------------------------------------------------

    def check_atomic(self, session: AsyncSession) -> None:
        """Refuse an atomic run, before anything runs, where snapshots are not offered.

        Raises:
            BranchingNotSupportedError: naming the isolation level or the backend.
        """
        self.brancher.check(session.lease.connection, session.isolation.level, self._backend)
        if session.lease.connection is None and self._backend != "local":
            # Refused before a kernel is even started (a kernel of another backend is refused
            # by the check above once it exists).
            raise BranchingNotSupportedError(
                f"sessions of the {self._backend!r} backend cannot be snapshotted, so atomic "
                "runs are not offered (only local kernels at isolation 'none' or 'process')"
            )

    async def before_atomic(self, session: AsyncSession) -> AsyncSnapshot:
        """The snapshot an atomic run of ``session`` (held by the caller) can go back to,
        even if the run ends its kernel: a kernel whose end would end the snapshot too is
        first put on a branch of itself (:meth:`_rebase`)."""
        conn = await self._kernel(session)
        if not _outlived_by_forks(conn):
            await self._rebase(session, conn)
        return await self.snapshot(session)

    async def _rebase(self, session: AsyncSession, conn: KernelConnection) -> None:
        """Put a branch of ``session``'s kernel ``conn`` in its place: the same state, but a
        kernel whose death ends none of its forks (``conn`` is kept, idle, for the branch).
        Not where the kernel runs threads of the user's: a fork has none, and a successful
        run must not lose them."""
        self.brancher.check(conn, session.isolation.level, self._backend)
        template = await self.brancher.snapshot(conn, session.agent_id)
        snap = AsyncSnapshot(self.brancher, template, session.agent_id, ())
        try:
            if template.threads:
                return
            branch = (await self._branches_of(snap, session.agent_id, 1))[0]
        finally:
            await finish_shielded(snap.aclose())  # kept while the branch lives
        await session.lease.swap(branch, session.lease.names, same=True)
        log.info("agent %r: kernel put on a branch of itself for atomic runs", session.agent_id)

    async def after_atomic(self, session: AsyncSession, snap: AsyncSnapshot, ran: Ran) -> Ran:
        """End an atomic run: a failed one is rolled back to ``snap`` (the kernel put back,
        the working directory's files too), a successful one kept; ``snap`` is freed."""
        if ran.error is None:
            await finish_shielded(snap.aclose())
            return ran
        problem = await self.undo(session, snap)
        if problem is not None:
            return _not_rolled_back(ran, problem)
        return dataclasses.replace(
            ran, rolled_back=True, changes=StateChanges(), kernel_restarted=False, lost_variables=[]
        )

    async def undo(self, session: AsyncSession, snap: AsyncSnapshot) -> str | None:
        """Put ``session`` (held by the caller) back to ``snap`` and free it: None when it
        was, else why it could not be."""
        try:
            if not snap.template.alive():
                # Killed (by its user, the OOM killer), or ended with a kernel it could not
                # outlive (before_atomic).
                await finish_shielded(snap.aclose())
                if not snap.outlives_kernel:
                    return (
                        "the snapshot ended with the kernel (the kernel runs threads of its "
                        "own, so the session was not moved to a branch, which would not have them)"
                    )
                return "the snapshot's process was killed"
            try:
                await self.restore(session, snap)
            except (BranchError, KernelStartError, TreeLimitError) as exc:
                return str(exc)
            log.info("agent %r: failed atomic run rolled back", session.agent_id)
            return None
        finally:
            await finish_shielded(snap.aclose())

    # -- internals ---------------------------------------------------------------------------

    async def _kernel(self, session: AsyncSession) -> KernelConnection:
        """The session's kernel, started if it has none (lost names still reported later)."""
        conn, lost = await session.lease.attach()
        session.lease.carry_lost(lost or [])
        return conn

    async def _branches(
        self, conn: KernelConnection, origin: str, n: int
    ) -> list[KernelConnection]:
        template = await self.brancher.snapshot(conn, origin)
        snap = AsyncSnapshot(self.brancher, template, origin, ())
        try:
            return await self._branches_of(snap, origin, n)
        finally:
            await snap.aclose()  # kept while its children live

    async def _ready(self, conn: KernelConnection) -> None:
        await make_ready(conn, self._reinstall, self._timeout)
        await self.brancher.seal(conn)

    async def _branches_of(
        self, snap: AsyncSnapshot, origin: str, n: int
    ) -> list[KernelConnection]:
        """``n`` ready kernels forked from ``snap`` (none on failure)."""
        made: list[KernelConnection] = []
        try:
            for _ in range(n):
                made.append(await self.brancher.branch(snap.template, origin))
            await asyncio.gather(*(self._ready(c) for c in made))
        except BaseException:
            for conn in made:
                if not await self.brancher.released(conn):
                    await shutdown_fully(conn)
            raise
        return made


def _outlived_by_forks(conn: KernelConnection) -> bool:
    """Whether a fork of ``conn``'s kernel outlives that kernel (see
    :attr:`~kernelexec.backends._base.KernelFamily.forks_outlive`)."""
    family = conn.family()
    return family is None or family.forks_outlive


def _not_rolled_back(ran: Ran, why: str) -> Ran:
    """A failed atomic run that could not be undone: its error says so."""
    if ran.error is None:
        return ran
    note = f" [kernelexec: this atomic run was NOT rolled back: {why}]"
    return dataclasses.replace(
        ran, error=ran.error.model_copy(update={"evalue": ran.error.evalue + note})
    )


def copy_workdir(source: Path, target: Path) -> None:
    """Copy a working directory's files into the directory ``target`` by the snapshot's copy
    rule (:data:`kernelexec._workdirs.SNAPSHOT`: never by path, never following a link,
    bounded, the layers of directories lent to its kernels left out).

    Raises:
        TreeLimitError: the directory passes a bound of the walk.
    """
    skipped = _workdirs.copy(source, target, _workdirs.SNAPSHOT)
    if skipped:
        log.info("left out of the copy of %s: %r", source, skipped)
