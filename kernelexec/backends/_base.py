"""The backend interface: how kernelexec gets a kernel and talks to it.

A backend starts kernels; a connection moves messages to and from one kernel and controls its
process. Everything above this interface (the run loop, timeouts, output limits, the tool
protocol, the pool) is written once in kernelexec and never touches zmq, processes or HTTP.

Every method is called from the executor's single event-loop thread, never concurrently for one
connection except :meth:`KernelConnection.interrupt`, which may be called while a run is in
progress.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class KernelMessage:
    """One Jupyter message as kernelexec's run loop needs it.

    A plain dataclass rather than a pydantic model: thousands of these are made per second on the
    hot path and they never leave the library.
    """

    channel: Literal["shell", "iopub"]
    msg_type: str
    parent_id: str | None
    content: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExecuteRequest:
    """The parts of an ``execute_request`` kernelexec sends."""

    code: str
    silent: bool = False
    store_history: bool = True
    user_expressions: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


class KernelConnection(abc.ABC):
    """A live kernel: its message channels and its lifecycle."""

    @property
    @abc.abstractmethod
    def kernel_id(self) -> str:
        """A stable identifier for logs and reports."""

    @abc.abstractmethod
    async def execute(self, request: ExecuteRequest) -> str:
        """Send an execute request (stdin never allowed); return its ``msg_id``.

        Called by the run loop once per run.
        """

    @abc.abstractmethod
    async def receive(self, timeout: float) -> KernelMessage | None:
        """Return the next shell or iopub message, or None if none arrived within ``timeout``.

        Messages that fail to decode or carry a bad signature are dropped here: the kernel is an
        untrusted peer and must not be able to crash the host's receive loop.
        """

    @abc.abstractmethod
    async def is_alive(self) -> bool:
        """Whether the kernel process still runs. Called when ``receive`` times out; cheap."""

    @property
    @abc.abstractmethod
    def exit_code(self) -> int | None:
        """The process exit status once the kernel died (negative: killed by that signal)."""

    @abc.abstractmethod
    async def interrupt(self) -> None:
        """Ask the kernel to interrupt the running code (returns without waiting)."""

    @abc.abstractmethod
    async def restart(self) -> None:
        """Replace the kernel process with a fresh one (state lost); return when it is ready."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the kernel immediately and release every resource (files, sockets, dirs).

        Must be safe to call more than once and on a dead kernel.
        """


class KernelBackend(abc.ABC):
    """Starts kernels. One backend instance may serve many executors."""

    @abc.abstractmethod
    async def start(self, *, env: dict[str, str], timeout: float) -> KernelConnection:
        """Start a kernel with exactly ``env`` as its environment; return once it is ready.

        Raises:
            KernelStartError: the kernel did not become ready within ``timeout`` seconds, with
                the tail of its stderr when there is one. Nothing is left running.
        """

    def describe(self) -> str:
        """A short text identifying what this backend runs (used in fingerprints)."""
        return type(self).__name__
