"""``HostCalls``: the host side of one run's calls from kernel code to host functions.

The run loop hands it every ``HOST_CALL`` message whose parent is the run's request (see
``_core/_run.py``); anything else never reaches it. Each accepted call runs as its own task, so
calls made together in the kernel (``asyncio.gather``) run together here, a slow host function
never holds up the run loop (the run's deadline is the loop's), and an interrupt cancels the
calls in flight. The kernel is an untrusted peer: a call is answered only when it names an
exposed function, carries a fresh well-formed id and fits the run's call limit; the answer is a
JSON value or a typed refusal carrying a message, never a host traceback. Each finished call is
kept as a :class:`~kernelexec.HostCall` for the run's result (and, when the session records, as
an output of the recorded cell).

What a session's calls may spend on the host is bounded (:class:`HostCallBounds`): the bytes of
a call's arguments are measured before they are parsed, calls accepted and not yet answered are
counted across the session's runs (:class:`InFlight`), an answer is measured before it is sent,
and plain host functions run on the session's own threads (:class:`HostThreads`), never on the
event loop's default pool that kernel starts, saves and shutdowns use.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kernelexec import _json
from kernelexec._codemode._functions import (
    ArgumentsRejected,
    CallTimedOut,
    HostFunction,
    NotJSON,
    TooLarge,
    result_text,
)
from kernelexec._codemode._kernel_side import HOST_CALL, HOST_REPLY
from kernelexec._models import HostCall, HostCallContext, HostCallOutcome
from kernelexec.backends._base import KernelConnection, KernelMessage

log = logging.getLogger("kernelexec")

HOST_CALL_MIME = "application/vnd.kernelexec.host-call+json"
"""The MIME type of a host call's record among a recorded cell's outputs."""

_MAX_ID = 64
_MAX_LABEL = 100  # characters of a module or function name kept from the kernel
_MAX_RUNNING = 32  # calls of one run running at once on the host; the rest wait their turn
_FINISH_WAIT = 1.0  # seconds to let cancelled calls end before the run's result is made
HOST_THREADS = 8
"""Threads of one session for its plain (``def``) host functions; more calls wait for one."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HostCallBounds:
    """What one session's host calls may spend on the host (the executor's settings)."""

    calls_per_run: int = 1000  # max_host_calls
    result_chars: int = 10_000_000  # max_result_chars
    call_bytes: int = 1 << 20  # max_host_call_bytes: arguments, and an answer
    in_flight: int = 64  # max_host_calls_in_flight

    def kernel_half(self) -> dict[str, int]:
        """The bounds the kernel half applies before sending, so honest code never meets the
        host's refusal."""
        return {"bytes": self.call_bytes, "in_flight": self.in_flight}


class InFlight:
    """Host calls of one session accepted and not yet answered, against its bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def take(self) -> bool:
        """Count one more call; False (nothing counted) when the bound is reached."""
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def give(self) -> None:
        """A call was answered (or dropped)."""
        self.count -= 1


class HostThreads:
    """One session's threads for plain host functions, started when first needed and shut
    down with the session: a tenant's slow functions wait for these, and nothing else does."""

    def __init__(self, size: int = HOST_THREADS) -> None:
        self._size = size
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on one of the session's threads (with the caller's context variables)."""
        if self._closed:
            raise RuntimeError("the session is closed")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._size, thread_name_prefix="kernelexec-host-fn")
        call = functools.partial(contextvars.copy_context().run, fn)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        """Refuse new work and drop what waits; a function still running is not waited for
        (its thread ends when it returns)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_ENVELOPE = 1 << 16
"""Bytes of a host call's message beside its arguments (id, names, JSON)."""


class HostCalls:
    """One run's host calls.

    Args:
        conn: The kernel's connection (answers go back on its control channel).
        exposed: Module name -> function name -> function: everything kernel code may call.
        agent_id: The session's agent id (for ``agent_id``/``context`` parameters).
        bounds: What the session's calls may spend.
        in_flight: The session's calls accepted and not yet answered (shared by its runs).
        threads: The session's threads for plain host functions.
        record: Also add each finished call to ``outputs`` (the session records).
        outputs: The run's collected outputs.
    """

    def __init__(
        self,
        conn: KernelConnection,
        exposed: Mapping[str, Mapping[str, HostFunction]],
        *,
        agent_id: str,
        bounds: HostCallBounds,
        in_flight: InFlight,
        threads: HostThreads,
        record: bool,
        outputs: list[dict[str, Any]],
    ) -> None:
        self._conn = conn
        self._exposed = exposed
        self._agent_id = agent_id
        self._bounds = bounds
        self._in_flight = in_flight
        self._threads = threads
        self._record = record
        self._outputs = outputs
        self._seen: set[str] = set()  # ids of the calls within the limit
        self._count = 0  # calls taken (forged repeats aside)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._counted: set[str] = set()  # ids of the calls counted in flight
        self._slots = asyncio.Semaphore(_MAX_RUNNING)
        self._ended = False
        self.calls: list[HostCall] = []
        # JSON text inside JSON: escaping can double what the kernel side measured.
        conn.limit_messages(HOST_CALL, 2 * bounds.call_bytes + _ENVELOPE)

    def take(self, msg: KernelMessage) -> bool:
        """Handle ``msg`` if it is a host call of this run; True when it was one."""
        if msg.channel != "iopub" or msg.msg_type != HOST_CALL:
            return False
        content = msg.content
        call_id = content.get("id")
        if self._ended or not isinstance(call_id, str) or not 0 < len(call_id) <= _MAX_ID:
            return True  # nothing to answer to (or nobody to answer)
        if call_id in self._seen:
            return True  # a forged repeat: the first call with this id keeps its answer
        self._count += 1
        module, name = content.get("module"), content.get("name")
        label = (_label(module), _label(name))
        limit = self._bounds.calls_per_run
        if self._count > limit:
            # Refused at once; past twice the limit no longer kept either (a flood must not
            # grow the result), and ids need no tracking: nothing of them will run.
            message = (
                f"this run made more than {limit} host calls (the per-run limit, max_host_calls)"
            )
            keep = self._count <= 2 * limit
            self._answer_now(call_id, label, "refused", message, kind="limit", keep=keep)
            return True
        self._seen.add(call_id)
        if "oversized" in content:  # refused unread by the connection (limit_messages)
            message = (
                f"the host call {label[0]}.{label[1]}() is {content['oversized']} bytes as sent; "
                f"a host call takes at most {self._bounds.call_bytes} of arguments "
                "(max_host_call_bytes)"
            )
            self._answer_now(call_id, label, "refused", message, kind="limit")
            return True
        function = None
        if isinstance(module, str) and isinstance(name, str):
            function = (self._exposed.get(module) or {}).get(name)
        if function is None:
            self._answer_now(call_id, label, "refused", f"{label[0]}.{label[1]} is not exposed")
            return True
        over = self._over_bounds(label, content.get("args"))
        if over is not None:
            self._answer_now(call_id, label, "refused", over, kind="limit")
            return True
        self._counted.add(call_id)
        task = asyncio.ensure_future(self._serve(call_id, label, function, content))
        self._tasks[call_id] = task
        task.add_done_callback(lambda _: self._done(call_id))
        return True

    def _done(self, call_id: str) -> None:
        self._tasks.pop(call_id, None)
        self._answered(call_id)  # a task cancelled before it started never did

    def _answered(self, call_id: str) -> None:
        if call_id in self._counted:
            self._counted.discard(call_id)
            self._in_flight.give()

    def _over_bounds(self, label: tuple[str, str], args: Any) -> str | None:
        """Why a call may not run (its arguments' size, the session's calls in flight), or
        None when it takes a place in flight. Measured before the arguments are parsed."""
        limit = self._bounds.call_bytes
        size = _utf8_size(args, limit) if isinstance(args, str) else 0
        if size > limit:
            return (
                f"the arguments of {label[0]}.{label[1]}() are {size} bytes of JSON or more; "
                f"a host call takes at most {limit} (max_host_call_bytes)"
            )
        if not self._in_flight.take():
            return (
                f"this session has {self._in_flight.limit} host calls in flight, its limit "
                "(max_host_calls_in_flight); wait for an answer before calling again"
            )
        return None

    def interrupted(self) -> None:
        """The run is being interrupted: cancel the calls in flight; each tells the kernel
        (a waiting ``await`` wakes at once, whatever SIGINT did)."""
        for task in list(self._tasks.values()):
            task.cancel()

    async def finish(self) -> list[HostCall]:
        """The run ended: cancel what still runs (the kernel fails its waiting calls itself);
        return the run's calls."""
        self._ended = True
        for task in list(self._tasks.values()):
            task.cancel()
        await self._settle()
        return self.calls

    async def _settle(self) -> None:
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=_FINISH_WAIT)
        if pending:
            log.warning("%d host call(s) did not stop when cancelled", len(pending))

    async def _serve(
        self, call_id: str, label: tuple[str, str], function: HostFunction, content: Any
    ) -> None:
        # The call leaves the session's count before its answer is sent: the kernel half
        # frees its own slot only on the answer, so it never has more in flight than we allow.
        cancelled: asyncio.CancelledError | None = None
        try:
            reply = await self._run(call_id, label, function, content)
        except asyncio.CancelledError as exc:
            cancelled = exc
            reply = _failure(call_id, "cancelled", "the run was interrupted")
        finally:
            self._answered(call_id)
        await self._send(reply)
        if cancelled is not None:
            raise cancelled

    async def _run(
        self, call_id: str, label: tuple[str, str], function: HostFunction, content: Any
    ) -> dict[str, Any]:
        """Run one call: the answer to send (the call is kept)."""
        start = time.monotonic()
        try:
            arguments = _json.loads(content.get("args"))
        except (ValueError, TypeError, RecursionError) as exc:
            self._keep(label, None, start, "invalid_args", error=f"unreadable arguments: {exc}")
            return _failure(call_id, "invalid_args", "the arguments are not readable JSON")
        try:
            async with self._slots:
                args = function.check(arguments)
                context = HostCallContext(
                    agent_id=self._agent_id, module=label[0], function=label[1], call_id=call_id
                )
                value = await function.run(args, context, self._threads.run)
                text = result_text(value, self._bounds.result_chars, self._bounds.call_bytes)
        except asyncio.CancelledError:
            self._keep(label, arguments, start, "cancelled", error="the run was interrupted")
            raise
        except ArgumentsRejected as exc:
            self._keep(label, arguments, start, "invalid_args", error=str(exc))
            return _failure(call_id, "invalid_args", str(exc))
        except CallTimedOut:
            why = f"{label[1]}() took longer than its timeout of {function.timeout:g} s"
            self._keep(label, arguments, start, "timeout", error=why)
            return _failure(call_id, "timeout", why)
        except TooLarge as exc:
            why = f"{label[1]}() {exc}"
            self._keep(label, arguments, start, "error", error=why)
            return _failure(call_id, "limit", why)
        except NotJSON as exc:
            why = f"{label[1]}() {exc}"
            self._keep(label, arguments, start, "error", error=why)
            return _failure(call_id, "error", why, host_type="NotJSON")
        except TimeoutError as exc:  # the function's own: the kernel gets HostCallTimeout too
            why = f"{type(exc).__name__}: {exc}"
            self._keep(label, arguments, start, "timeout", error=why)
            return _failure(call_id, "timeout", str(exc) or why)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._keep(label, arguments, start, "error", error=why)
            return _failure(call_id, "error", str(exc), host_type=type(exc).__name__)
        self._keep(label, arguments, start, "ok", result=_json.loads(text))
        return {"id": call_id, "ok": True, "value": text}

    def _answer_now(
        self,
        call_id: str,
        label: tuple[str, str],
        outcome: HostCallOutcome,
        message: str,
        *,
        kind: str | None = None,
        keep: bool = True,
    ) -> None:
        if keep:
            self._keep(label, None, time.monotonic(), outcome, error=message)
        task = asyncio.ensure_future(self._reply(call_id, kind or outcome, message))
        self._tasks[call_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(call_id, None))

    async def _reply(self, call_id: str, kind: str, message: str) -> None:
        await self._send(_failure(call_id, kind, message))

    async def _send(self, content: dict[str, Any]) -> None:
        if self._ended:
            return
        try:
            await self._conn.send("control", HOST_REPLY, content)
        except Exception as exc:  # the kernel is gone: the run loop reports that
            log.debug("host call answer not sent: %s", exc)

    def _keep(
        self,
        label: tuple[str, str],
        arguments: Any,
        start: float,
        outcome: HostCallOutcome,
        *,
        result: Any = None,
        error: str | None = None,
    ) -> None:
        call = HostCall(
            module=label[0],
            name=label[1],
            arguments=arguments,
            duration_s=time.monotonic() - start,
            outcome=outcome,
            result=result,
            error=error,
        )
        self.calls.append(call)
        if self._record:
            self._outputs.append(record_output(call))


def _failure(call_id: str, kind: str, message: str, host_type: str = "") -> dict[str, Any]:
    content = {"id": call_id, "ok": False, "kind": kind, "message": message}
    if host_type:
        content["type"] = host_type
    return content


def _label(value: Any) -> str:
    """A module or function name as the kernel sent it, cut short (it is kept and echoed)."""
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, bool | int | float):
        text = repr(value)
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_LABEL else text[:_MAX_LABEL] + "..."


def _utf8_size(text: str, limit: int) -> int:
    """Bytes of ``text`` in UTF-8; a text too long for ``limit`` is not encoded to find out
    (its length in characters, already over, is returned)."""
    if text.isascii() or len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def record_output(call: HostCall) -> dict[str, Any]:
    """A host call as a ``display_data`` output of the recorded cell."""
    summary = f"[host call] {call.module}.{call.name}: {call.outcome} in {call.duration_s:.4f} s"
    if call.error:
        summary += f" ({call.error})"
    return {
        "output_type": "display_data",
        "data": {HOST_CALL_MIME: call.model_dump(mode="json"), "text/plain": summary},
        "metadata": {},
    }
