"""``SessionFeatures``: what a session delegates to, beside its run pipeline and its lease.

The other half of a feature's socket: a feature follows the session's kernel as a watcher of
its lease (``kernelexec._core._lease.KernelWatcher``, subscribed by whoever assembles the
session) and, when callers use it, is reached through one delegating method of
``AsyncSession`` (and its twin in ``_sync.py``) that calls the object listed here. The core
names the features' types for the type checker only: it imports no feature folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernelexec._codemode._session import SessionCodeMode
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
