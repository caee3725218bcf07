"""The sockets a session feature plugs into, beside the lease's ``KernelWatcher``.

A feature follows the session's kernel as a watcher of its lease
(``kernelexec._core._lease.KernelWatcher``, subscribed by whoever assembles the session) and,
when callers use it, is reached through one delegating method of ``AsyncSession`` (and its twin
in ``_sync.py``) that calls the object :class:`SessionFeatures` lists. A feature that takes part
in every run says so through the run pipeline's two protocols: :class:`RunObserver` (the
notebook recorder) and :class:`HostCallSource` (code mode). The core names the features' types
for the type checker only: it imports no feature folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kernelexec._core._lease import LeasedKernel
from kernelexec._core._run import HostCallHandler
from kernelexec._models import HostCall, RunRecord
from kernelexec._protocol._host import ExecuteRequest

if TYPE_CHECKING:
    from kernelexec._codemode._session import OneCall, SessionCodeMode
    from kernelexec._durable._keeper import SessionState
    from kernelexec._files._commands import AsyncSessionCommands
    from kernelexec._files._session import AsyncSessionFiles
    from kernelexec._recording import SessionRecorder


@dataclass(frozen=True, slots=True)
class SessionFeatures:
    """The features a session delegates to, made (and subscribed to its lease) by whoever
    assembles the session.

    Attributes:
        files: ``session.files``.
        commands: ``session.commands``.
        code_mode: What ``expose`` and ``host_functions=`` delegate to.
        durable: What ``hibernate`` delegates to (None: no ``state_dir``).
        recorder: The notebook recorder (None: the session does not record).
    """

    files: AsyncSessionFiles
    commands: AsyncSessionCommands
    code_mode: SessionCodeMode
    durable: SessionState | None = None
    recorder: SessionRecorder | None = None


class RunObserver(Protocol):
    """Told about every finished run of a session, in order, before its caller gets it."""

    async def run_finished(self, record: RunRecord) -> str | None:
        """Take note of ``record``; return None, or what went wrong keeping it (an I/O
        failure must not raise: it is reported on the run's result as ``recording_error``)."""

    def continued(self, generation: int) -> None:
        """The session's kernel ``generation`` continues the state of the runs before (a
        rollback put it back), not a fresh kernel's."""

    def close(self) -> None:
        """The session closed."""


class HostCallSource(Protocol):
    """Takes part in every run with the calls its code makes to host functions (code mode's
    ``SessionCodeMode``)."""

    async def start_run(
        self,
        kernel: LeasedKernel,
        request: ExecuteRequest,
        once: OneCall | None,
        *,
        record: bool,
        outputs: list[dict[str, Any]],
    ) -> tuple[ExecuteRequest, HostCallHandler | None]:
        """The run's request with the source's part, and who takes the run's host calls."""

    async def end_run(self, calls: Any) -> list[HostCall]:
        """The run ended: the host calls it made (``calls``: what :meth:`start_run` gave)."""

    def interrupted(self) -> None:
        """The run is being interrupted: cancel its host calls in flight."""

    def for_caller(self, outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A recorded run's outputs without those kept only for the notebook."""
