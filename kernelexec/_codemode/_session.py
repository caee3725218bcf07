"""``SessionCodeMode``: a session's side of code mode, and the feature's one watcher.

What the session exposes, getting it into each kernel the session gets (the install runs as one
of kernelexec's own requests), and each run's :class:`~kernelexec._codemode._calls.HostCalls`.
The session assembly makes one per session and subscribes it to the session's lease (it is a
``kernelexec._core._lease.KernelWatcher``); ``AsyncSession.expose`` delegates to
:meth:`SessionCodeMode.expose`, and the session's run pipeline calls :meth:`start_run` and
:meth:`end_run` around every run. Nothing here runs when nothing is exposed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kernelexec._codemode._calls import (
    HOST_CALL_MIME,
    HostCallBounds,
    HostCalls,
    HostThreads,
    InFlight,
)
from kernelexec._codemode._exposure import Exposure, HostFunctions, one_call
from kernelexec._codemode._functions import HostFunction
from kernelexec._exceptions import ConfigError, StateError
from kernelexec._models import HostCall, Restored
from kernelexec._observability._logtext import untrusted
from kernelexec._protocol import _host as protocol
from kernelexec._protocol._host import ExecuteRequest

if TYPE_CHECKING:
    from kernelexec._core._lease import Arrival, LeasedKernel, Leaving

log = logging.getLogger("kernelexec")

OneCall = dict[str, dict[str, HostFunction]]
"""One run's own host functions: module name -> function name -> function."""


class SessionCodeMode:
    """One session's exposed host functions and its running run's host calls.

    Args:
        agent_id: The session's agent id (given to functions that take ``agent_id``).
        bounds: What the session's host calls may spend.
        install_timeout: Seconds the install request may take.
    """

    def __init__(self, agent_id: str, *, bounds: HostCallBounds, install_timeout: float) -> None:
        self._agent_id = agent_id
        self._bounds = bounds
        self._install_timeout = install_timeout
        self._exposure = Exposure(bounds.kernel_half())
        self._in_flight = InFlight(bounds.in_flight)
        self._threads = HostThreads()
        self.current: HostCalls | None = None  # the running run's calls

    # -- the session's delegating method -----------------------------------------------------

    async def expose(
        self,
        functions: Iterable[Any],
        module: str,
        timeout: float | None,
        kernel: LeasedKernel | None,
    ) -> None:
        """Expose ``functions`` as ``module``, installed now in ``kernel`` (the session's,
        held by the caller) if it has one, else with the next run; see
        ``AsyncSession.expose``.

        Raises:
            ConfigError: a bad module name, a function that cannot be exposed, or an install
                that failed.
        """
        self._exposure.add(functions, module, timeout)
        if kernel is not None:
            await self.install(kernel, strict=True)

    @staticmethod
    def one_call(host_functions: HostFunctions | None) -> OneCall | None:
        """``host_functions=`` of one run, checked (``ConfigError``) before it is queued."""
        return one_call(host_functions)

    # -- the watcher ---------------------------------------------------------------------------

    async def attaching(self) -> None:
        """Code mode waits for the kernel."""

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        """A fresh kernel: the exposed modules go into it with its next run (the exposure
        knows which kernel generation has them)."""
        return None

    async def before_use(self, kernel: LeasedKernel) -> None:
        """Using the kernel does not concern code mode."""

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        """The kernel goes, with the kernel half."""
        return False

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        """A run ended (its calls were finished by :meth:`end_run`)."""

    def gone(self) -> None:
        """The session is gone: its host-function threads take no more work."""
        self._threads.close()

    # -- around every run ----------------------------------------------------------------------

    async def install(self, kernel: LeasedKernel, *, strict: bool = False) -> None:
        """Install the kernel half with every exposed module in ``kernel`` if it lacks them
        (``strict``: send them again, and raise ``ConfigError`` on failure)."""
        if self._exposure.installed_on(kernel.generation) and not strict:
            return
        try:
            reply = await kernel.ask(self._exposure.install_request(), self._install_timeout)
            why = None if reply.get("status") == "ok" else str(reply.get("evalue") or "no reply")
        except StateError as exc:
            why = str(exc)
        if why is not None:
            if strict:
                raise ConfigError(f"the host functions could not be installed in the kernel: {why}")
            log.warning("code mode could not be installed in the kernel: %s", untrusted(why))
            return
        self._exposure.installed(kernel.generation)

    async def start_run(
        self,
        kernel: LeasedKernel,
        request: ExecuteRequest,
        once: OneCall | None,
        *,
        record: bool,
        outputs: list[dict[str, Any]],
    ) -> tuple[ExecuteRequest, HostCalls | None]:
        """The run's request with code mode's part, and who takes its host calls (None when
        code mode was never used in this kernel)."""
        if not (self._exposure.active or once or self._exposure.installed_on(kernel.generation)):
            return request, None
        # Once installed, every run answers host calls (refusing what is not exposed), so a
        # stub kept from an earlier run's functions fails at once instead of waiting.
        await self.install(kernel)
        request = protocol.with_metadata(request, self._exposure.run_metadata(once))
        self.current = HostCalls(
            kernel.conn,
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

    @staticmethod
    def for_caller(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A recorded run's outputs as an unrecorded run's would be: without the host calls'
        records (kept for the notebook; the result has them in ``host_calls``)."""
        return [o for o in outputs if HOST_CALL_MIME not in (o.get("data") or {})]
