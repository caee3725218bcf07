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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from kernelexec import _json
from kernelexec._codemode._functions import (
    ArgumentsRejected,
    CallTimedOut,
    HostFunction,
    NotJSON,
    result_text,
)
from kernelexec._codemode._kernel_side import HOST_CALL, HOST_REPLY
from kernelexec._models import HostCall, HostCallContext, HostCallOutcome
from kernelexec.backends._base import KernelConnection, KernelMessage

log = logging.getLogger("kernelexec")

HOST_CALL_MIME = "application/vnd.kernelexec.host-call+json"
"""The MIME type of a host call's record among a recorded cell's outputs."""

_MAX_ID = 64
_MAX_IN_FLIGHT = 32  # calls of one run running at once on the host; the rest wait their turn
_FINISH_WAIT = 1.0  # seconds to let cancelled calls end before the run's result is made


class HostCalls:
    """One run's host calls.

    Args:
        conn: The kernel's connection (answers go back on its control channel).
        exposed: Module name -> function name -> function: everything kernel code may call.
        agent_id: The session's agent id (for ``agent_id``/``context`` parameters).
        max_calls: Calls the run may make; later ones are refused.
        max_result_chars: The largest answer, in characters of JSON.
        record: Also add each finished call to ``outputs`` (the session records).
        outputs: The run's collected outputs.
    """

    def __init__(
        self,
        conn: KernelConnection,
        exposed: Mapping[str, Mapping[str, HostFunction]],
        *,
        agent_id: str,
        max_calls: int,
        max_result_chars: int,
        record: bool,
        outputs: list[dict[str, Any]],
    ) -> None:
        self._conn = conn
        self._exposed = exposed
        self._agent_id = agent_id
        self._max_calls = max_calls
        self._max_result = max_result_chars
        self._record = record
        self._outputs = outputs
        self._seen: set[str] = set()  # ids of the calls within the limit
        self._count = 0  # calls taken (forged repeats aside)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(_MAX_IN_FLIGHT)
        self._ended = False
        self.calls: list[HostCall] = []

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
        label = (str(module), str(name))
        if self._count > self._max_calls:
            # Refused at once; past twice the limit no longer kept either (a flood must not
            # grow the result), and ids need no tracking: nothing of them will run.
            message = (
                f"this run made more than {self._max_calls} host calls (the per-run limit, "
                "max_host_calls)"
            )
            keep = self._count <= 2 * self._max_calls
            self._answer_now(call_id, label, "refused", message, kind="limit", keep=keep)
            return True
        self._seen.add(call_id)
        function = None
        if isinstance(module, str) and isinstance(name, str):
            function = (self._exposed.get(module) or {}).get(name)
        if function is None:
            self._answer_now(call_id, label, "refused", f"{module}.{name} is not exposed")
        else:
            task = asyncio.ensure_future(self._serve(call_id, label, function, content))
            self._tasks[call_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(call_id, None))
        return True

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
        start = time.monotonic()
        try:
            arguments = _json.loads(content.get("args"))
        except (ValueError, TypeError, RecursionError) as exc:
            self._keep(label, None, start, "invalid_args", error=f"unreadable arguments: {exc}")
            await self._reply(call_id, "invalid_args", "the arguments are not readable JSON")
            return
        try:
            async with self._slots:
                args = function.check(arguments)
                context = HostCallContext(
                    agent_id=self._agent_id, module=label[0], function=label[1], call_id=call_id
                )
                value = await function.run(args, context)
                text = result_text(value, self._max_result)
        except asyncio.CancelledError:
            self._keep(label, arguments, start, "cancelled", error="the run was interrupted")
            if not self._ended:
                await self._reply(call_id, "cancelled", "the run was interrupted")
            raise
        except ArgumentsRejected as exc:
            self._keep(label, arguments, start, "invalid_args", error=str(exc))
            await self._reply(call_id, "invalid_args", str(exc))
        except CallTimedOut:
            why = f"{label[1]}() took longer than its timeout of {function.timeout:g} s"
            self._keep(label, arguments, start, "timeout", error=why)
            await self._reply(call_id, "timeout", why)
        except NotJSON as exc:
            why = f"{label[1]}() {exc}"
            self._keep(label, arguments, start, "error", error=why)
            await self._reply(call_id, "error", why, host_type="NotJSON")
        except TimeoutError as exc:  # the function's own: the kernel gets HostCallTimeout too
            why = f"{type(exc).__name__}: {exc}"
            self._keep(label, arguments, start, "timeout", error=why)
            await self._reply(call_id, "timeout", str(exc) or why)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._keep(label, arguments, start, "error", error=why)
            await self._reply(call_id, "error", str(exc), host_type=type(exc).__name__)
        else:
            self._keep(label, arguments, start, "ok", result=_json.loads(text))
            await self._send({"id": call_id, "ok": True, "value": text})

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

    async def _reply(self, call_id: str, kind: str, message: str, host_type: str = "") -> None:
        content = {"id": call_id, "ok": False, "kind": kind, "message": message}
        if host_type:
            content["type"] = host_type
        await self._send(content)

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
