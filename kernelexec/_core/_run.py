"""The run loop: one execute request, from sending it to a complete, bounded result.

Written once above the backend interface. A run is complete when both its ``execute_reply`` and
the iopub ``status: idle`` for its msg_id have arrived, in either order (a big print arrives after
the reply). While waiting it watches three things: messages, process death (checked whenever
the kernel is quiet for ``_POLL`` seconds) and the deadline. Past the deadline the kernel is
interrupted; if it does not finish within the grace period the caller must restart it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nbformat.v4 import output_from_msg

from kernelexec.backends._base import ExecuteRequest, KernelConnection, KernelMessage

_POLL = 0.05
"""Seconds of silence after which the loop checks whether the kernel process is alive."""

OutputCallback = Callable[[Any], Awaitable[None] | None]


@dataclass
class Callbacks:
    """Optional hooks called as output arrives (sync functions or coroutines)."""

    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None
    on_display: OutputCallback | None = None

    async def emit(self, hook: OutputCallback | None, value: Any) -> None:
        if hook is None:
            return
        ret = hook(value)
        if inspect.isawaitable(ret):
            await ret


@dataclass
class RunOutcome:
    """What the run loop observed; the session turns it into an ``Execution``."""

    reply: dict[str, Any] | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: dict[str, Any] | None = None
    execution_count: int | None = None
    timed_out: bool = False
    stuck: bool = False  # timed out and did not stop within the grace period
    died: bool = False
    started: bool = False  # the kernel acknowledged the request (any message for it arrived)
    duration_s: float = 0.0


class _Collector:
    """Builds nbformat outputs from iopub messages, within a character budget."""

    def __init__(self, out: RunOutcome, budget: int, callbacks: Callbacks) -> None:
        self.out = out
        self.budget = budget
        self.callbacks = callbacks
        self.truncated = False
        self.clear_pending = False
        self.display_index: dict[str, list[int]] = {}

    def _room(self) -> int:
        return self.budget - len(self.out.stdout) - len(self.out.stderr)

    async def add(self, msg: KernelMessage) -> None:
        kind = msg.msg_type
        content = msg.content
        if kind == "execute_input":
            self.out.execution_count = content.get("execution_count")
            return
        if kind == "clear_output":
            if content.get("wait"):
                self.clear_pending = True
            else:
                self._clear()
            return
        if kind == "update_display_data":
            self._update_display(content)
            return
        if kind not in ("stream", "display_data", "execute_result", "error"):
            return
        if self.clear_pending:
            self._clear()
        if kind == "stream":
            await self._stream(content.get("name", "stdout"), str(content.get("text", "")))
            return
        try:
            msg_dict = {"header": {"msg_type": kind}, "content": content}
            output = dict(output_from_msg(msg_dict))  # type: ignore[no-untyped-call]
        except Exception:
            return  # malformed output from the kernel
        if kind == "error":
            self.out.error = content
        elif kind == "execute_result":
            self.out.execution_count = content.get("execution_count")
            self.out.result = str(output.get("data", {}).get("text/plain", ""))
        if kind in ("display_data", "execute_result"):
            self._bound_display(output)
            display_id = (content.get("transient") or {}).get("display_id")
            if display_id:
                self.display_index.setdefault(display_id, []).append(len(self.out.outputs))
        self.out.outputs.append(output)
        if kind == "display_data":
            await self.callbacks.emit(self.callbacks.on_display, output)

    async def _stream(self, name: str, text: str) -> None:
        name = "stderr" if name == "stderr" else "stdout"
        if self.truncated:
            return
        room = self._room()
        if len(text) > room:
            text = text[: max(room, 0)] + (
                f"\n[kernelexec: output truncated at {self.budget} characters]\n"
            )
            self.truncated = True
        if not text:
            return
        if name == "stdout":
            self.out.stdout += text
        else:
            self.out.stderr += text
        outputs = self.out.outputs
        if outputs and outputs[-1].get("output_type") == "stream" and outputs[-1]["name"] == name:
            outputs[-1]["text"] += text
        else:
            outputs.append({"output_type": "stream", "name": name, "text": text})
        hook = self.callbacks.on_stdout if name == "stdout" else self.callbacks.on_stderr
        await self.callbacks.emit(hook, text)

    def _bound_display(self, output: dict[str, Any]) -> None:
        data = output.get("data") or {}
        size = sum(len(str(v)) for v in data.values())
        if size > self.budget:
            output["data"] = {
                "text/plain": f"[kernelexec: display output of {size} characters dropped]"
            }

    def _update_display(self, content: dict[str, Any]) -> None:
        display_id = (content.get("transient") or {}).get("display_id")
        for index in self.display_index.get(display_id or "", []):
            output = self.out.outputs[index]
            output["data"] = content.get("data", {})
            output["metadata"] = content.get("metadata", {})
            self._bound_display(output)

    def _clear(self) -> None:
        self.out.outputs.clear()
        self.display_index.clear()
        self.clear_pending = False


async def run_internal(
    conn: KernelConnection, request: ExecuteRequest, timeout: float
) -> RunOutcome:
    """Run one of kernelexec's own setup requests (installing the helper, configuring)."""
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
    collector = _Collector(out, max_output_chars, callbacks or Callbacks())
    start = time.monotonic()
    msg_id = await conn.execute(request)
    try:
        await _collect(conn, msg_id, out, collector, start + timeout, interrupt_grace, output_grace)
    except asyncio.CancelledError:
        # The caller gave up (its own timeout, a disconnect): stop the code so the session's
        # next call does not queue behind it in the kernel.
        if not out.reply:
            await asyncio.shield(conn.interrupt())
        raise
    if out.reply is not None and out.execution_count is None:
        out.execution_count = out.reply.get("execution_count")
    out.duration_s = time.monotonic() - start
    return out


async def _collect(
    conn: KernelConnection,
    msg_id: str,
    out: RunOutcome,
    collector: _Collector,
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
        msg = await conn.receive(min(deadline - now, _POLL))
        if msg is None:
            if not await conn.is_alive():
                out.died = True
                break
            continue
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
        else:
            await collector.add(msg)
