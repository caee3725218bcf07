"""``SessionCodeMode``: a session's side of code mode (see ``kernelexec._codemode``).

What the session exposes, getting it into each kernel the session gets (the install runs as one
of kernelexec's own requests), and each run's :class:`~kernelexec._codemode._calls.HostCalls`.
The session owns one and calls it around every run; nothing here runs when nothing is exposed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kernelexec._codemode._calls import (
    HOST_CALL_MIME,
    HostCallBounds,
    HostCalls,
    HostThreads,
    InFlight,
)
from kernelexec._codemode._exposure import Exposure
from kernelexec._codemode._functions import HostFunction
from kernelexec._core._run import run_internal
from kernelexec._exceptions import ConfigError
from kernelexec._models import Execution, HostCall
from kernelexec._observability._logtext import untrusted
from kernelexec._protocol import _host as protocol
from kernelexec._protocol._host import ExecuteRequest
from kernelexec.backends._base import KernelConnection

log = logging.getLogger("kernelexec")

OneCall = dict[str, dict[str, HostFunction]]


class SessionCodeMode:
    """One session's exposed host functions and its running run's host calls."""

    def __init__(self, agent_id: str, *, bounds: HostCallBounds, install_timeout: float) -> None:
        self._agent_id = agent_id
        self._bounds = bounds
        self._install_timeout = install_timeout
        self._exposure = Exposure(bounds.kernel_half())
        self._in_flight = InFlight(bounds.in_flight)
        self._threads = HostThreads()
        self.current: HostCalls | None = None  # the running run's calls

    def add(self, functions: Iterable[Any], module: str, timeout: float | None) -> None:
        """Expose ``functions`` as ``module`` (installed with the next run, or by
        :meth:`install`)."""
        self._exposure.add(functions, module, timeout)

    async def install(
        self, conn: KernelConnection, generation: int, *, strict: bool = False
    ) -> None:
        """Install the kernel half with every exposed module in kernel ``generation`` if it
        lacks them (``strict``: send them again, and raise ``ConfigError`` on failure)."""
        if self._exposure.installed_on(generation) and not strict:
            return
        out = await run_internal(conn, self._exposure.install_request(), self._install_timeout)
        reply = out.reply or {}
        if out.reply is None or reply.get("status") != "ok" or out.collected.error is not None:
            why = str((out.collected.error or reply).get("evalue") or "no reply")
            if strict:
                raise ConfigError(f"the host functions could not be installed in the kernel: {why}")
            log.warning("code mode could not be installed in the kernel: %s", untrusted(why))
            return
        self._exposure.installed(generation)

    async def start_run(
        self,
        conn: KernelConnection,
        generation: int,
        request: ExecuteRequest,
        once: OneCall | None,
        *,
        record: bool,
        outputs: list[dict[str, Any]],
    ) -> tuple[ExecuteRequest, HostCalls | None]:
        """The run's request with code mode's part, and who takes its host calls (None when
        code mode was never used in this kernel)."""
        if not (self._exposure.active or once or self._exposure.installed_on(generation)):
            return request, None
        # Once installed, every run answers host calls (refusing what is not exposed), so a
        # stub kept from an earlier run's functions fails at once instead of waiting.
        await self.install(conn, generation)
        request = protocol.with_metadata(request, self._exposure.run_metadata(once))
        self.current = HostCalls(
            conn,
            self._exposure.callable_in_run(once),
            agent_id=self._agent_id,
            bounds=self._bounds,
            in_flight=self._in_flight,
            threads=self._threads,
            record=record,
            outputs=outputs,
        )
        return request, self.current

    async def end_run(self, calls: HostCalls | None) -> list[HostCall]:
        """The run ended: its host calls (those still running are cancelled)."""
        self.current = None
        return await calls.finish() if calls is not None else []

    def interrupted(self) -> None:
        """The session's run is being interrupted: cancel its host calls in flight."""
        if self.current is not None:
            self.current.interrupted()

    def close(self) -> None:
        """The session closed: its host-function threads take no more work."""
        self._threads.close()


def is_host_call_output(output: dict[str, Any]) -> bool:
    """Whether ``output`` is a host call's record (kept for the notebook)."""
    return HOST_CALL_MIME in (output.get("data") or {})


def without_host_call_outputs(execution: Execution) -> Execution:
    """A recorded run's result as an unrecorded one would be: host calls kept in
    ``host_calls``, not among the outputs (they are there for the notebook)."""
    outputs = [o for o in execution.outputs if not is_host_call_output(o)]
    if len(outputs) == len(execution.outputs):
        return execution
    return execution.model_copy(update={"outputs": outputs})
