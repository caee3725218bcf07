"""The run loop: one execute request, from sending it to a complete, bounded result.

Written once above the backend interface. A run is complete when both its ``execute_reply`` and
the iopub ``status: idle`` for its msg_id have arrived, in either order (a big print arrives after
the reply). While waiting it watches the messages, the kernel's death (which the backend reports
from ``receive``) and the deadline. Past the deadline the kernel is interrupted; if it does not
finish within the grace period the caller must replace it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kernelexec._core._outputs import Callbacks, Collected, OutputCollector
from kernelexec._protocol._host import ExecuteRequest
from kernelexec.backends._base import KernelConnection, KernelDied


@dataclass
class RunOutcome:
    """What the run loop observed; the session turns it into an ``Execution``."""

    reply: dict[str, Any] | None = None
    collected: Collected = field(default_factory=Collected)
    timed_out: bool = False
    stuck: bool = False  # timed out and did not stop within the grace period
    death: KernelDied | None = None
    started: bool = False  # the kernel acknowledged the request (any message for it arrived)

    @property
    def died(self) -> bool:
        """Whether the kernel died during the run."""
        return self.death is not None


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
) -> RunOutcome:
    """Send ``request`` and collect everything that belongs to it.

    Returns when the run is complete, the kernel died, or the run timed out (after interrupting
    it and waiting ``interrupt_grace``). Messages for any other request are ignored.
    """
    out = RunOutcome()
    collector = OutputCollector(out.collected, max_output_chars, callbacks or Callbacks())
    start = time.monotonic()
    msg_id = await conn.send(
        "shell", "execute_request", request.content(), metadata=request.metadata
    )
    try:
        await _collect(conn, msg_id, out, collector, start + timeout, interrupt_grace, output_grace)
    except asyncio.CancelledError:
        # The caller gave up (its own timeout, a disconnect): stop the code so the session's
        # next call does not queue behind it in the kernel.
        if not out.reply:
            await asyncio.shield(conn.interrupt())
        raise
    if out.reply is not None and out.collected.execution_count is None:
        out.collected.execution_count = out.reply.get("execution_count")
    return out


async def _collect(
    conn: KernelConnection,
    msg_id: str,
    out: RunOutcome,
    collector: OutputCollector,
    deadline: float,
    interrupt_grace: float,
    output_grace: float,
) -> None:
    idle = False
    while out.reply is None or not idle:
        now = time.monotonic()
        if now >= deadline:
            if out.reply is not None:
                break  # the reply came but its idle was lost: keep what arrived
            if not out.timed_out:
                out.timed_out = True
                await conn.interrupt()
                deadline = now + interrupt_grace
                continue
            out.stuck = True
            break
        msg = await conn.receive(deadline - now)
        if msg is None:
            continue
        if isinstance(msg, KernelDied):
            out.death = msg
            break
        if msg.parent_id != msg_id:
            continue
        out.started = True
        if msg.channel == "shell":
            if msg.msg_type == "execute_reply":
                out.reply = msg.content
                if not out.timed_out:
                    deadline = min(deadline, time.monotonic() + output_grace)
        elif msg.msg_type == "status":
            idle = msg.content.get("execution_state") == "idle"
        elif msg.channel == "iopub":
            await collector.add(msg)
