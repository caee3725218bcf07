"""``Handoff``: one executor's side of a ``state_dir`` shared with others: claiming an agent
before its kernel runs, asking the executor that holds it to hand it over, and handing over the
agents it holds when another executor asks.

The request travels as a file in the holder's inbox (:mod:`._leases`), which the holder polls
every 10 ms: a file, not a socket, because executors on other hosts share only the filesystem,
and polling because a change made by another NFS client wakes no ``inotify`` watch here. The
holder waits for the session's current call (and those queued before the request), hibernates
it, lets the lease go, and the asker, polling the lock every 5 ms, takes it and restores the
agent as any wake does. A holder that cannot hand over (its session stays busy past the asker's
deadline, the checkpoint passes ``max_checkpoint_bytes``) answers why and keeps the agent; the
asker's :class:`~kernelexec.AgentBusyError` carries that answer. A holder that died lets its
lock go with its process: the asker takes the agent at once, from its last checkpoint.

A holder on another host may keep its lock after its host died (until the filesystem's lock
manager gives up on it). An asker that sees such a holder's heartbeat unchanged for
:data:`STALE_S` by its own clock (no clocks compared across hosts) breaks the lease
(:meth:`~._leases.LeaseBook.break_stale`) and takes the agent from its last checkpoint. A
holder that was only paused or cut off finds the lease broken when it renews: it writes nothing
more to the agent's state (:meth:`AgentClaim.still_held`) and drops the kernel unsaved, after
the call it may be running; its sessions ask for the agent back on their next call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import anyio
import anyio.abc

from kernelexec._durable._leases import Holder, LeaseBook, Request
from kernelexec._durable._store import agent_key
from kernelexec._exceptions import AgentBusyError, StateError
from kernelexec._models import Hibernation
from kernelexec._observability._logtext import untrusted

log = logging.getLogger("kernelexec")

SERVE_POLL_S = 0.01
"""How often a holder looks for requests."""
ASK_POLL_S = 0.005
"""How often an asker tries the lock."""
RENEW_S = 2.0
"""How often an executor renews its heartbeat."""
FRESH_S = 5.0
"""A heartbeat renewed this recently proves the leases still held: nobody breaks one before
:data:`STALE_S` of silence. Older, a session checks its lease on disk before using its
kernel."""
STALE_S = 10.0
"""A heartbeat unchanged this long names its executor as not renewing (hung, or its host
gone); on another host, its leases are then broken."""


class Holdable(Protocol):
    """What a hand-over needs of a session's kernel lease (``KernelLease`` is one)."""

    def hold(self) -> AbstractAsyncContextManager[None]:
        """Exclusive use of the session, after the calls made before."""

    @property
    def has_kernel(self) -> bool:
        """Whether a kernel is attached now."""

    @property
    def busy(self) -> bool:
        """Whether a call runs or waits to run."""

    async def hibernate(self) -> Hibernation:
        """Save the state and give the kernel back (the caller holds the lease)."""

    async def drop(self) -> None:
        """Give the kernel back unsaved: the agent was taken away (the caller holds the
        lease)."""


class AgentClaim:
    """One session's hold on its agent in the store.

    Args:
        office: The executor's :class:`Handoff`.
        agent_id: The agent.
        env: Its environment key in the store (``""``: the executor's default).
    """

    def __init__(self, office: Handoff, agent_id: str, env: str) -> None:
        self.agent_id = agent_id
        self.env = env
        self.key = agent_key(agent_id, env)
        self.lease: Holdable | None = None
        """The session's kernel lease, handed over when another executor asks."""
        self._office = office
        self._lock = asyncio.Lock()
        self.era = -1
        """The heartbeat's era in which the lease was last known to be this executor's."""

    @property
    def held(self) -> bool:
        """Whether this executor holds the agent now."""
        return self._office.book.holds(self.agent_id, self.env)

    async def current(self) -> bool:
        """Whether this executor may still use the agent's kernel: it holds the agent, and
        no other executor can have broken the lease (see :meth:`Handoff.current`)."""
        return await self._office.current(self)

    def still_held(self) -> bool:
        """Whether this executor holds the agent, checked on disk: False once another host's
        executor broke the lease (checked before each write to the agent's state)."""
        return self._office.book.mine(self.key)

    async def take(self) -> bool:
        """Hold the agent, asking its holder to hand it over if another executor holds it;
        whether it was taken now (False: it was held already).

        Raises:
            AgentBusyError: the holder refused, or did not let go within ``handoff_timeout``
                (the message names its process and host, and its reason when it gave one).
        """
        async with self._lock:
            if self.held:
                return False
            await self._office.wait_for(self)
            return True

    def release(self) -> None:
        """Let the agent go (its kernel is gone, or the session closed)."""
        self._office.release(self)


class Handoff:
    """See the module docstring.

    Args:
        book: The lease files of the executor's ``state_dir``.
        timeout: ``handoff_timeout``: most seconds a claim waits for a holder.
    """

    def __init__(self, book: LeaseBook, timeout: float) -> None:
        self.book = book
        self.timeout = timeout
        self._held: dict[str, AgentClaim] = {}
        self._serving: set[str] = set()
        self._beat = _Heartbeat(book)

    def claim(self, agent_id: str, env: str) -> AgentClaim:
        """The claim of ``agent_id`` (the one held now, or a new one)."""
        return self._held.get(agent_key(agent_id, env)) or AgentClaim(self, agent_id, env)

    def open(self) -> None:
        """Announce this executor in the store (see :meth:`LeaseBook.open`)."""
        self.book.open()
        self._beat.start()

    def close(self) -> None:
        """Let every agent go and leave the store."""
        self._beat.stop()
        self._held.clear()
        self.book.close()

    async def current(self, claim: AgentClaim) -> bool:
        """Whether ``claim``'s agent may still be used here: held, and either the heartbeat
        is fresh (:data:`FRESH_S`) or, renewed now, the lease is still this executor's on
        disk. An agent found taken away is let go (False).

        Raises:
            StateError: the heartbeat cannot be renewed now (the agent is kept: the next use
                checks again).
        """
        if self._held.get(claim.key) is not claim or not claim.held:
            return False
        if self._beat.fresh(claim.era):
            return True
        try:
            era, mine = await asyncio.to_thread(self._recheck, claim.key)
        except OSError as exc:
            raise StateError(
                f"agent {claim.agent_id!r}: this executor cannot renew its lease in the "
                f"state_dir now ({exc}); nothing ran"
            ) from exc
        if not mine:
            self._let_go(claim.key)
        claim.era = era
        return mine

    def _recheck(self, key: str) -> tuple[int, bool]:
        """Renew, then check the lease of ``key`` on disk: the era it was checked in, and
        whether it is still this executor's."""
        self._beat.beat()
        era = self._beat.era
        return era, self.book.mine(key)

    def _let_go(self, key: str) -> AgentClaim | None:
        """Forget a lease another executor broke (its record is the new holder's)."""
        self.book.forget(key)
        return self._held.pop(key, None)

    def release(self, claim: AgentClaim) -> None:
        """Let ``claim``'s agent go."""
        if self._held.get(claim.key) is claim:
            del self._held[claim.key]
            self.book.release(claim.key)

    # -- asking -------------------------------------------------------------------------------

    async def wait_for(self, claim: AgentClaim) -> None:
        """Take ``claim``'s agent, asking its holder; see :meth:`AgentClaim.take`.

        Raises:
            AgentBusyError: see :meth:`AgentClaim.take`.
            StateError: the lease files could not be read or written.
        """
        try:
            await self._wait_for(claim)
        except OSError as exc:
            raise StateError(f"the lease of agent {claim.agent_id!r}: {exc}") from exc

    async def _wait_for(self, claim: AgentClaim) -> None:
        deadline = time.time() + self.timeout
        asked: tuple[Holder, str] | None = None
        last: Holder | None = None
        answer: dict[str, object] | None = None
        watch = _Silence()
        try:
            while True:
                era = self._beat.era
                if self.book.try_take(claim.agent_id, claim.env):
                    self._held[claim.key] = claim
                    claim.era = era
                    return
                holder = self.book.holder(claim.key)
                last = holder or last
                if holder is not None and self._broke(claim, holder, watch):
                    continue
                if holder is not None and (asked is None or asked[0].token != holder.token):
                    if asked is not None:
                        self.book.withdraw(*asked)
                    mine = holder.token == self.book.token
                    name = None if mine else self.book.ask(holder, deadline)
                    asked, answer = ((holder, name) if name else None), None
                if asked is not None:
                    answer = self.book.answer_to(*asked) or answer
                    if answer is not None and answer.get("status") == "refused":
                        raise AgentBusyError(_busy(claim, asked[0], f"it refused: {answer['why']}"))
                if time.time() >= deadline:
                    raise AgentBusyError(_busy(claim, last, self._why_late(last, answer)))
                await asyncio.sleep(ASK_POLL_S)
        finally:
            if asked is not None:
                self.book.withdraw(*asked)

    def _broke(self, claim: AgentClaim, holder: Holder, watch: _Silence) -> bool:
        """Break ``holder``'s lease if it is on another host and ``watch`` saw it silent for
        :data:`STALE_S`; whether it was broken."""
        if holder.host == self.book.host:
            return False
        lock_id = self.book.lock_id(claim.key)
        if lock_id is None or watch.silent_for(holder, lock_id) < STALE_S:
            return False
        if not self.book.break_stale(claim.key, holder, lock_id):
            return False
        log.warning(
            "agent %r: its holder, %s, has not renewed its lease for %.0fs: lease broken, "
            "the agent is taken from its last checkpoint",
            claim.agent_id,
            untrusted(holder.describe()),
            STALE_S,
        )
        return True

    def _why_late(self, holder: Holder | None, answer: dict[str, object] | None) -> str:
        within = f"it did not hand it over within handoff_timeout={self.timeout:g}s"
        if answer is not None:
            return f"{within}: {answer.get('why')}"
        if holder is None:
            return within
        if holder.renewed_at is None:
            return f"{within}: its executor left no heartbeat, yet its lock is held"
        age = time.time() - holder.renewed_at
        if age > STALE_S:
            why = (
                "a hung process: a holder on this host keeps its lease while it lives"
                if holder.host == self.book.host
                else f"another host's lease is broken once seen silent for {STALE_S:g}s"
            )
            return f"{within}: it has not renewed its lease for {age:.0f}s ({why})"
        return f"{within} and gave no answer"

    # -- serving ------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Serve hand-over requests, and drop the agents whose lease was broken, until
        cancelled (the heartbeat is renewed on a thread of its own)."""
        checked = time.monotonic()
        async with anyio.create_task_group() as group:
            while True:
                try:
                    for request in self.book.requests() if self._held else ():
                        if request.name not in self._serving:
                            self._serving.add(request.name)
                            group.start_soon(self._serve_one, request)
                    if self._held and time.monotonic() - checked >= RENEW_S:
                        checked = time.monotonic()
                        for key in await asyncio.to_thread(self.book.lost):
                            self._forfeit(key, group)
                except OSError as exc:  # a full disk, a filesystem gone a while: go on
                    log.warning("hand-over requests not read: %s", exc)
                await asyncio.sleep(SERVE_POLL_S)

    def _forfeit(self, key: str, group: anyio.abc.TaskGroup) -> None:
        """Another host's executor broke the lease of ``key`` (this one had stopped renewing):
        let it go and drop the kernel unsaved."""
        claim = self._let_go(key)
        if claim is None:
            return
        log.warning(
            "agent %r was taken over by another host's executor while this one was not "
            "renewing its lease (paused, or cut off from the state_dir): its kernel here is "
            "dropped unsaved",
            claim.agent_id,
        )
        if claim.lease is not None:
            group.start_soon(_drop, claim.lease)

    async def _serve_one(self, request: Request) -> None:
        try:
            await self._hand_over(request)
        except Exception as exc:  # one failed hand-over must not end the serving loop
            log.warning("hand-over of %s failed: %s", request.key[:12], untrusted(exc))
            self.book.answer(request, "refused", f"the hand-over failed: {exc}")
            self.book.done(request)
        finally:
            self._serving.discard(request.name)

    async def _hand_over(self, request: Request) -> None:
        claim = self._held.get(request.key)
        lease = claim.lease if claim is not None else None
        if claim is None or lease is None:
            if claim is None:
                self.book.done(request)  # not held (any more): the asker finds the lock free
            return  # a session being made: served on the next round
        remaining = request.deadline - time.time()
        if lease.busy:
            self.book.answer(request, "busy", "its session was running a call")
        async with _hold_within(lease, remaining) as got:
            if not got:
                self.book.answer(request, "busy", "its session was running a call throughout")
                self.book.done(request)
                return
            if not self.book.pending(request):
                return  # the asker gave up meanwhile (cancelled): keep the agent
            if lease.has_kernel:
                try:
                    await lease.hibernate()
                except StateError as exc:
                    self.book.answer(request, "refused", f"it could not hibernate the agent: {exc}")
                    self.book.done(request)
                    return
            claim.release()
            self.book.done(request)
        log.info("agent %r handed over to %s", claim.agent_id, untrusted(request.asker))


def _clock() -> float:
    """Seconds on a clock that counts a suspended host's sleep (a holder that slept long
    must check its leases before it uses them)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class _Heartbeat:
    """Renews an executor's heartbeat every :data:`RENEW_S` on a thread of its own: a live
    holder whose event loop is blocked a while (a CPU-bound handler) does not look dead."""

    def __init__(self, book: LeaseBook) -> None:
        self._book = book
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.renewed = _clock()
        self.era = 0
        """Counts the gaps of :data:`FRESH_S` or more between two renewals (a paused
        process, a host that slept, a filesystem that refused writes): a lease checked on
        disk in an earlier era must be checked again."""

    def start(self) -> None:
        """Renew from now on (the book renewed once when it opened)."""
        self.renewed = _clock()
        self._thread = threading.Thread(target=self._run, name="kx-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the executor closes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def fresh(self, era: int) -> bool:
        """Whether the heartbeat was renewed within :data:`FRESH_S`, with no longer gap
        since era ``era``."""
        return era == self.era and _clock() - self.renewed < FRESH_S

    def beat(self) -> None:
        """Renew now.

        Raises:
            OSError: the heartbeat file could not be written.
        """
        self._book.renew()
        now = _clock()
        if now - self.renewed >= FRESH_S:
            self.era += 1
        self.renewed = now

    def _run(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self.beat()
            except OSError as exc:  # a full disk, a filesystem gone a while: go on
                if not self._failing:
                    log.warning("the executor's heartbeat was not renewed: %s", exc)
                self._failing = True
            else:
                self._failing = False


class _Silence:
    """How long an asker has seen one holder's heartbeat and lock file unchanged, by its own
    monotonic clock."""

    def __init__(self) -> None:
        self._seen: tuple[str, float | None, int] | None = None
        self._since = 0.0

    def silent_for(self, holder: Holder, lock_id: int) -> float:
        """Seconds since ``holder``'s heartbeat or lock file last changed (0: changed now)."""
        seen = (holder.token, holder.renewed_at, lock_id)
        if seen != self._seen:
            self._seen, self._since = seen, time.monotonic()
        return time.monotonic() - self._since


async def _drop(lease: Holdable) -> None:
    try:
        async with lease.hold():
            if lease.has_kernel:
                await lease.drop()
    except Exception as exc:  # the serving loop goes on
        log.warning("a kernel of an agent taken away was not dropped: %s", untrusted(exc))


@asynccontextmanager
async def _hold_within(lease: Holdable, seconds: float) -> AsyncIterator[bool]:
    """``lease.hold()`` if it is had within ``seconds``; yields whether it was."""
    held = lease.hold()
    try:
        with anyio.fail_after(max(seconds, 0.0)):
            await held.__aenter__()
    except TimeoutError:
        yield False
        return
    try:
        yield True
    finally:
        await held.__aexit__(None, None, None)


def _busy(claim: AgentClaim, holder: Holder | None, why: str) -> str:
    who = holder.describe() if holder is not None else "an unknown process (no lease record)"
    return f"agent {claim.agent_id!r} is held by {who}; {why}"
