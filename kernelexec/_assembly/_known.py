"""``KnownSessions``: the registry of an executor's sessions, by agent id and environment.

A session with a kernel is *live* and held strongly. One whose kernel was evicted is *parked*:
held weakly, kept while its caller holds it and forgotten otherwise, so an executor's memory is
bounded by its live sessions, not by every agent it ever saw. What a forgotten session lost is
kept (bounded) and told to its agent's next session.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kernelexec._core._budget import KernelBudget
from kernelexec._core._lease import Arrival, KernelLease, LeasedKernel, Leaving
from kernelexec._core._session import AsyncSession
from kernelexec._core._state import Lifecycle
from kernelexec._models import Restored
from kernelexec._recording import SessionRecorder

Key = tuple[str, str]
"""(agent id, environment fingerprint)."""

Released = Callable[[KernelLease, SessionRecorder | None], None]
"""Called when a parked session nobody held was collected, with what it leaves behind."""

_MAX_REMEMBERED_LOSSES = 1_024


class KnownSessions:
    """The sessions of one executor: live, parked, and what forgotten ones lost.

    Args:
        state: The executor's lifecycle: once it is no longer open, a parked session is not
            held again and a forgotten one's losses are not kept.
        on_released: Lets go of a forgotten session's resources (its recording, names,
            directory); called from the garbage collector, on the executor's thread.
    """

    def __init__(self, state: Lifecycle, on_released: Released) -> None:
        self._state = state
        self._on_released = on_released
        self._live: dict[Key, AsyncSession] = {}
        self._parked: weakref.WeakValueDictionary[Key, AsyncSession] = weakref.WeakValueDictionary()
        self._finalizers: dict[Key, weakref.finalize[Any, Any]] = {}
        self._lost: OrderedDict[Key, list[str]] = OrderedDict()

    def get(self, key: Key) -> AsyncSession | None:
        """The live or parked session of ``key``, if any."""
        return self._live.get(key) or self._parked.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self._live or key in self._parked

    def add(self, session: AsyncSession) -> None:
        """Hold a new session (it is live)."""
        self._live[(session.agent_id, session.fingerprint)] = session

    def take_lost(self, key: Key) -> list[str]:
        """What the forgotten session of ``key`` lost (once; empty when nothing)."""
        return self._lost.pop(key, [])

    def live(self) -> list[AsyncSession]:
        """The live sessions."""
        return list(self._live.values())

    def every(self) -> list[AsyncSession]:
        """Every session held, live then parked."""
        return [*self._live.values(), *self._parked.values()]

    def by_key(self) -> dict[Key, AsyncSession]:
        """Every session held by its key (a copy)."""
        return {**self._parked, **self._live}

    def park(self, key: Key) -> AsyncSession | None:
        """The session's kernel was evicted: hold it weakly from now on; the session parked,
        or None when ``key`` was not live."""
        session = self._live.pop(key, None)
        if session is None:
            return None
        self._parked[key] = session
        if key not in self._finalizers:
            self._finalizers[key] = weakref.finalize(
                session, self._collected, key, session.lease, session.recorder
            )
        return session

    def unpark(self, key: Key) -> None:
        """A parked session got a kernel again (its caller held it): hold it strongly again."""
        session = self._parked.pop(key, None)
        if session is not None and self._state.is_open and key not in self._live:
            self._live[key] = session

    def forget(self, session: AsyncSession) -> None:
        """The session closed: no longer known (its agent id may be used again)."""
        key = (session.agent_id, session.fingerprint)
        if self._live.get(key) is session:
            del self._live[key]
        if self._parked.get(key) is session:
            del self._parked[key]
        finalizer = self._finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()

    def clear(self) -> None:
        """Hold no session any more (the executor closed)."""
        self._live.clear()
        self._parked.clear()

    def _collected(self, key: Key, lease: KernelLease, recorder: SessionRecorder | None) -> None:
        """A parked session nobody held was collected: let its resources go, and keep what it
        lost for the agent's next session."""
        self._finalizers.pop(key, None)
        self._on_released(lease, recorder)
        lost = lease.pending_lost()
        if lost and self._state.is_open:
            self._lost[key] = lost
            while len(self._lost) > _MAX_REMEMBERED_LOSSES:
                self._lost.popitem(last=False)


class RegistryEntry:
    """A session's place in its executor's registry and budget, kept by watching its lease:
    parked (held weakly, no longer a candidate for eviction) when its kernel is given back,
    held again when it gets one.

    Args:
        known: The executor's registry.
        budget: The executor's kernel budget.
        key: The session's key.
        lease: The session's lease.
    """

    def __init__(
        self, known: KnownSessions, budget: KernelBudget, key: Key, lease: KernelLease
    ) -> None:
        self._known = known
        self._budget = budget
        self._key = key
        self._lease = lease
        self._parked = False

    async def attaching(self) -> None:
        """The registry follows kernels once attached."""

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        """A parked session got a kernel again (its caller held it): hold it again."""
        if self._parked:
            self._parked = False
            self._known.unpark(self._key)
            self._budget.register(self._lease)
        return None

    async def before_use(self, kernel: LeasedKernel) -> None:
        """Using the kernel does not move the session in the registry."""

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        """The kernel is given back (evicted, hibernated): the registry holds the session
        weakly from now on (it may be collected at once: watchers that keep its state come
        before this one)."""
        if why in ("evict", "saved"):
            self._parked = True
            session = self._known.park(self._key)
            if session is not None:
                self._budget.forget(self._lease)
        return False

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        """Runs do not move the session in the registry."""

    def gone(self) -> None:
        """The executor forgets the session itself (``KnownSessions.forget``)."""
