"""``AtomicRun``: one all-or-nothing run of a session (``atomic=True``).

A snapshot of the session is taken before the run; a run that fails is put back to it, and so
is one its caller cancels (or whose output hook raises). The snapshots are the session's
branches (:class:`~kernelexec._assembly._forking.SessionBranches`); the run pipeline calls
:meth:`AtomicRun.before`, :meth:`AtomicRun.after` and :meth:`AtomicRun.cancelled` around the run,
with the session held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kernelexec._aio import finish_shielded
from kernelexec._core._results import Ran
from kernelexec._observability._logtext import untrusted

if TYPE_CHECKING:
    from kernelexec._assembly._forking import SessionBranches
    from kernelexec._branching._family import AsyncSnapshot
    from kernelexec._core._session import AsyncSession

log = logging.getLogger("kernelexec.kernel")


class AtomicRun:
    """One atomic run of ``session`` (made once the session's checks let it run atomically).

    Args:
        branches: Takes and puts back the session's snapshots.
        session: The session whose run it is.
    """

    def __init__(self, branches: SessionBranches, session: AsyncSession) -> None:
        self._branches = branches
        self._session = session
        self._snap: AsyncSnapshot | None = None

    async def before(self) -> None:
        """Snapshot the session before the run."""
        self._snap = await self._branches.before_atomic(self._session)

    async def after(self, ran: Ran) -> Ran:
        """The run ended: a failed one is rolled back (``ran.rolled_back``), a successful one
        kept; the snapshot is freed either way."""
        snap, self._snap = self._snap, None
        if snap is None:
            return ran
        return await self._branches.after_atomic(self._session, snap, ran)

    async def cancelled(self) -> bool:
        """The run was cancelled (or its output hook raised): put the session back too, all
        or nothing; whether it was."""
        snap, self._snap = self._snap, None
        if snap is None:
            return False
        problem = await finish_shielded(self._branches.undo(self._session, snap))
        if problem is not None:
            log.warning(
                "agent %r: a cancelled atomic run was not rolled back: %s",
                self._session.agent_id,
                untrusted(problem),
            )
        return problem is None
