"""The run loop: one request, from sending it to a complete, bounded result.

Written once above the backend interface. A run is complete when both its ``execute_reply`` and
the iopub ``status: idle`` for its msg_id have arrived, in either order (a big print arrives after
the reply); a tool call the kernel side serves itself sends no busy/idle, and is complete when its
reply and as many output messages as the reply counts have arrived.

The run's own code holds the session key, so it can sign a reply (and an idle) for its own
request and go on running. Where the kernel side answers fences, a fence request follows the
run's request, and the run ends only on the fence's answer, which ipykernel (one shell request at
a time) sends only once the run has really finished: the reply kept is the last one before it,
the kernel side's own, and the outputs awaited are those that reply counts.

While waiting the loop watches the messages, the kernel's death (which the backend reports from
``receive``) and the deadline. Past the deadline the kernel is interrupted; if it does not finish
within the grace period the caller must replace it. A run whose caller cancels it is
interrupted the same way, and the loop keeps collecting for the grace period before it lets the
cancellation go on, so the caller can tell whether the kernel stopped (``stuck`` if not); a
caller's output hook that raises ends the run the same way (``CallbackFailed``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kernelexec._aio import finish_shielded
from kernelexec._core._outputs import CallbackFailed, Callbacks, Collected, OutputCollector
from kernelexec._protocol._host import (
    FENCE_REPLY,
    FENCE_REQUEST,
    ExecuteRequest,
    Reply,
    read_reply,
)
from kernelexec.backends._base import KernelConnection, KernelDied, KernelMessage

log = logging.getLogger("kernelexec.kernel")


class HostCallHandler(Protocol):
    """Takes a run's calls from kernel code to host functions (code mode's ``HostCalls``)."""

    def take(self, msg: KernelMessage) -> bool:
        """Handle ``msg`` (a message of the run) if it is a host call; True when it was."""

    def interrupted(self) -> None:
        """The run is being interrupted: cancel the calls in flight."""


@dataclass
class RunOutcome:
    """What the run loop observed; the session turns it into an ``Execution``."""

    reply: dict[str, Any] | None = None
    collected: Collected = field(default_factory=Collected)
    timed_out: bool = False
    stuck: bool = False  # timed out and did not stop within the grace period
    death: KernelDied | None = None
    started: bool = False  # the kernel acknowledged the request (any message for it arrived)
    idle: bool = False  # the iopub ``status: idle`` for the request arrived
    cancelled: bool = False  # the caller cancelled the run
    executing: bool = False  # the request's ``execute_input`` arrived: its code is running
    interrupt_waits: bool = False  # an interrupt is held until the code runs (see ``interrupt``)
    announces_start: bool = False  # the request publishes an ``execute_input`` (not silent)
    interrupt_asked: bool = False  # interrupted before the request was sent: sent with it
    _read: tuple[dict[str, Any] | None, Reply] | None = field(default=None, repr=False)

    @property
    def died(self) -> bool:
        """Whether the kernel died during the run."""
        return self.death is not None

    def interrupt_now(self) -> bool:
        """Whether an interrupt of this run may be sent now; else it is held (``True`` again
        once the run's ``execute_input`` arrives, and the run loop sends it then).

        ipykernel ignores SIGINT between shell requests and installs the default handler only
        when the request's handler starts, so a SIGINT that reaches a kernel still reading
        its queue (a loaded machine, a CPU-capped kernel) is dropped, and the code then runs
        to its deadline. A request that announces its start waits for it."""
        if self.executing or not self.announces_start:
            return True
        self.interrupt_waits = True
        return False

    def read(self) -> Reply:
        """The reply as kernelexec reads it (:func:`~kernelexec._protocol._host.read_reply`),
        read once: the run loop needs its output count, the session the rest."""
        if self._read is None or self._read[0] is not self.reply:
            self._read = (self.reply, read_reply(self.reply))
        return self._read[1]


async def run_internal(
    conn: KernelConnection, request: ExecuteRequest, timeout: float
) -> RunOutcome:
    """Run one of kernelexec's own set-up requests (installing the helper, warming up)."""
    return await run_request(
        conn,
        request,
        timeout=timeout,
        interrupt_grace=1.0,
        output_grace=1.0,
        max_output_chars=10_000,
    )


async def run_request(
    conn: KernelConnection,
    request: ExecuteRequest,
    *,
    timeout: float,
    interrupt_grace: float,
    output_grace: float,
    max_output_chars: int,
    callbacks: Callbacks | None = None,
    out: RunOutcome | None = None,
    fence: bool = False,
    host: HostCallHandler | None = None,
) -> RunOutcome:
    """Send ``request`` and collect everything that belongs to it (into ``out`` if given).

    Returns when the run is complete, the kernel died, or the run timed out (after interrupting
    it and waiting ``interrupt_grace``). Messages for any other request are ignored. When the
    caller cancels, the run is wound down (see :func:`_wind_down`) and the cancellation goes on
    with ``out.cancelled`` set. ``fence``: follow the request with a fence (the kernel side
    answers them) and end the run on its answer (see the module's docstring). ``host`` gets
    the run's calls to host functions (code mode); the run's deadline holds whatever they do,
    and an interrupt cancels them.
    """
    out = out if out is not None else RunOutcome()
    out.announces_start = request.announces_start
    collector = OutputCollector(out.collected, max_output_chars, callbacks or Callbacks())
    start = time.monotonic()
    content = request.content()
    msg_id = await conn.send("shell", request.msg_type, content, metadata=request.metadata)
    fence_id = await conn.send("shell", FENCE_REQUEST, {}) if fence else None
    if out.interrupt_asked:
        await _interrupt(conn, out)  # held until the code runs, where that can be told
    run = _Run(msg_id, request.reply_type, request.quiet, out, collector, fence_id, host=host)
    try:
        await _collect(conn, run, start + timeout, interrupt_grace, output_grace)
    except (asyncio.CancelledError, CallbackFailed):
        # The caller gave up (its own timeout, a disconnect) or its output hook raised: stop
        # the code so the session's next call does not queue behind it in the kernel.
        out.cancelled = True
        await finish_shielded(_wind_down(conn, run, interrupt_grace))
        raise
    if out.reply is not None and out.collected.execution_count is None:
        out.collected.execution_count = out.reply.get("execution_count")
    return out


@dataclass(slots=True)
class _Run:
    """One request being collected: what ends it and where its messages go."""

    msg_id: str
    reply_type: str
    quiet: bool  # no busy/idle: complete once the outputs the reply counts have arrived
    out: RunOutcome
    collector: OutputCollector
    fence_id: str | None = None  # the fence sent after the request (None: not fenced)
    fenced: bool = False  # the fence's answer arrived: the kernel has finished the run
    host: HostCallHandler | None = None  # takes the run's calls to host functions
    expected: int | None = None  # output messages the kernel says it sent

    @property
    def replied(self) -> bool:
        """The run's reply is in, and it is the kernel side's own (the fence answered)."""
        return self.out.reply is not None and (self.fence_id is None or self.fenced)

    def complete(self) -> bool:
        out = self.out
        if not self.replied:
            return False
        if self.fence_id is not None:
            # An idle may be forged as a reply may; the real reply counts the outputs.
            if self.expected is None:
                count = out.read().count
                self.expected = count.sent if count is not None else -1
            if self.expected >= 0:
                return out.collected.received >= self.expected
        if out.idle:
            return True
        if not self.quiet:
            return False
        if self.expected is None:
            count = out.read().count
            self.expected = count.sent if count is not None else 0
        return out.collected.received >= self.expected


async def _collect(
    conn: KernelConnection,
    run: _Run,
    deadline: float,
    interrupt_grace: float,
    output_grace: float,
) -> None:
    out = run.out
    while not run.complete():
        now = time.monotonic()
        if now >= deadline:
            if run.replied:
                break  # the reply came but its idle was lost: keep what arrived
            if not out.timed_out:
                out.timed_out = True
                await _interrupt(conn, out)
                if run.host is not None:
                    run.host.interrupted()
                deadline = now + interrupt_grace
                continue
            out.stuck = True
            break
        msg = await conn.receive(deadline - now)
        if msg is None:
            continue
        if await _take(msg, run) and not out.timed_out:
            deadline = min(deadline, time.monotonic() + output_grace)
        if out.death is not None:
            break
        await _held_interrupt(conn, out)


async def _interrupt(conn: KernelConnection, out: RunOutcome) -> None:
    """Interrupt the run now, or once its code runs (:meth:`RunOutcome.interrupt_now`)."""
    if out.interrupt_now():
        await conn.interrupt()


async def _held_interrupt(conn: KernelConnection, out: RunOutcome) -> None:
    """Send an interrupt held for the run's start once it has started (or replied: a reply
    with its code never run has nothing left to interrupt)."""
    if out.interrupt_waits and (out.executing or out.reply is not None):
        out.interrupt_waits = False
        if out.executing and out.reply is None:
            log.debug("a held interrupt sent: the run's code starts")
            await conn.interrupt()


async def _take(msg: KernelMessage | KernelDied, run: _Run) -> bool:
    """Note one message in the run's outcome; True when it was the run's reply."""
    out = run.out
    if isinstance(msg, KernelDied):
        out.death = msg
        return False
    if msg.parent_id != run.msg_id:
        fence = msg.parent_id is not None and msg.parent_id == run.fence_id
        if fence and msg.channel == "shell" and msg.msg_type == FENCE_REPLY:
            run.fenced = True
            return out.reply is not None  # the reply is in and final: the grace starts
        return False
    out.started = True
    if msg.msg_type == "execute_input" and msg.channel == "iopub":
        out.executing = True
    if msg.channel == "shell":
        if msg.msg_type == run.reply_type and not run.fenced:
            # Before the fence's answer the last reply is the kernel side's own.
            out.reply = msg.content
            return run.replied
    elif msg.msg_type == "status":
        out.idle = msg.content.get("execution_state") == "idle"
    elif msg.channel == "iopub":
        if run.host is not None and run.host.take(msg):
            return False
        await run.collector.add(msg)
    return False


async def _wind_down(conn: KernelConnection, run: _Run, interrupt_grace: float) -> None:
    """After the caller cancelled: interrupt the run unless it already replied, and collect
    until it ends or ``interrupt_grace`` passes (then ``out.stuck``: the kernel must go)."""
    out = run.out
    run.collector.callbacks = Callbacks()  # the caller is gone
    if not run.replied and out.death is None:
        await _interrupt(conn, out)
    if run.host is not None:
        run.host.interrupted()
    deadline = time.monotonic() + interrupt_grace
    while not run.complete() and out.death is None:
        now = time.monotonic()
        if now >= deadline:
            out.stuck = not run.replied
            return
        msg = await conn.receive(deadline - now)
        if msg is not None:
            await _take(msg, run)
            await _held_interrupt(conn, out)
