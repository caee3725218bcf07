"""The host's handles on the processes of branching: the kernel half installed in a live
kernel, the request that forks a template from it, and a template's control socket (the backend
interface's :class:`~kernelexec.backends._base.KernelTemplate`, from which a backend's
:class:`~kernelexec.backends._base.KernelFamily` forks branch kernels).

See :mod:`kernelexec._branching._kernel_side` for what each process does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from kernelexec import _trees
from kernelexec._branching import _kernel_side as kernel_side
from kernelexec._exceptions import BranchError
from kernelexec._protocol._install import KernelModule, install_request
from kernelexec.backends._base import KernelConnection, KernelFamily, Stalled
from kernelexec.backends._base import ask as ask_kernel

KERNEL_MODULE = KernelModule(kernel_side.MODULE_NAME, kernel_side.__name__)
"""Branching's kernel half, installed afresh in each live kernel that is forked from."""


async def ask(
    conn: KernelConnection,
    msg_type: str,
    content: dict[str, Any],
    reply_type: str,
    timeout: float,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one shell request and return its reply's content (through
    :func:`kernelexec.backends._base.ask`).

    Raises:
        BranchError: the kernel died or did not answer within ``timeout`` seconds.
    """
    got = await ask_kernel(
        conn, msg_type, content, reply_type=reply_type, timeout=timeout, metadata=metadata
    )
    if isinstance(got, Stalled):
        if got.died is not None:
            raise BranchError(f"the kernel died while forking ({got.died.reason})")
        raise BranchError(f"the kernel did not answer a {msg_type} in {timeout:g} s")
    return got.content


async def install(conn: KernelConnection, timeout: float) -> None:
    """Install the kernel side of branching in a live kernel.

    Raises:
        BranchError: it could not be installed (the reply says why).
    """
    request = install_request([KERNEL_MODULE])
    reply = await ask(
        conn,
        request.msg_type,
        request.content(),
        request.reply_type,
        timeout,
        metadata=request.metadata,
    )
    if reply.get("status") != "ok":
        raise BranchError(
            f"could not make the kernel forkable: {reply.get('ename')}: {reply.get('evalue')}"
        )


@dataclass(frozen=True)
class Forked:
    """What the live kernel said after forking a template."""

    pid: int
    kernel: int
    threads: list[str] = field(default_factory=list)
    fork_s: float = 0.0
    paused_s: float = 0.0


async def fork_template(conn: KernelConnection, control: str, timeout: float) -> Forked:
    """Ask the live kernel to fork a template listening at ``control``.

    Raises:
        BranchError: the kernel could not fork.
    """
    reply = await ask(
        conn,
        kernel_side.REQUEST,
        {"control": control, "host": os.getpid()},
        kernel_side.REPLY,
        timeout,
    )
    if reply.get("status") != "ok" or not isinstance(reply.get("pid"), int):
        raise BranchError(f"the kernel could not fork: {reply.get('evalue', 'no reason given')}")
    return Forked(
        int(reply["pid"]),
        int(reply["kernel"]),
        list(reply.get("threads") or []),
        float(reply["fork_s"]),
        float(reply.get("paused_s", 0.0)),
    )


class Template:
    """A frozen copy of a kernel (a fork that runs nothing), which forks branch kernels.

    Args:
        pid: The template's process id.
        control: The path of its listening socket.
        tdir: Its private directory (removed by :meth:`close`).
        threads: The user's threads of the kernel it was forked from.
        family: How that kernel runs (its branches run the same way).
        fork_s: How long the kernel was paused for the ``fork()``.
        listener: The kernel that made the listening socket (and handed it to the template):
            the only process whose socket the host may talk to at ``control``.

    Raises:
        BranchError: the template is gone, or another process answered at ``control``.
    """

    def __init__(
        self,
        pid: int,
        control: str,
        tdir: str,
        threads: list[str],
        family: KernelFamily,
        fork_s: float = 0.0,
        listener: int | None = None,
    ) -> None:
        self.pid = pid
        self.tdir = tdir
        self.threads = threads
        self.family = family
        self.fork_s = fork_s
        self.extra_dirs: list[str] = []
        """More directories to remove with the template (a snapshot's copy of the files)."""
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            raise BranchError("the template exited at once") from None
        chan = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            chan.connect(control)
            fmt = "3i"
            cred = chan.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))
            peer = struct.unpack(fmt, cred)[0]
        except OSError as exc:
            peer, problem = 0, f"could not reach the template: {exc}"
        else:
            expected = listener if listener is not None else pid
            problem = "" if peer == expected else f"process {peer}, not the template, answered"
        if problem:
            chan.close()
            self._close_pidfd()
            raise BranchError(problem)
        self._chan: socket.socket | None = chan

    async def ready(self, timeout: float) -> None:
        """Wait for the template to say it no longer dies with its kernel
        (:data:`~kernelexec._branching._kernel_side.READY`): from then on the kernel may die.

        Raises:
            BranchError: it ended first, or did not say so within ``timeout`` seconds.
        """
        chan = self._chan
        if chan is None:
            raise BranchError("the snapshot is closed")
        chan.setblocking(False)
        try:
            said = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(chan, 64), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise BranchError(f"the template did not start: {exc!r}") from None
        finally:
            chan.setblocking(True)
        if said != kernel_side.READY:
            raise BranchError("the template ended before it was ready")

    def alive(self) -> bool:
        """Whether the template still runs."""
        fd = self._pidfd
        if fd is None or self._chan is None:
            return False
        return not _readable(fd)

    def _call(self, req: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        with self._lock:
            chan = self._chan
            if chan is None:
                raise BranchError("the snapshot is closed")
            try:
                socket.send_fds(chan, [json.dumps(req).encode()], list(fds))
                data = chan.recv(1 << 16)
            except OSError as exc:
                raise BranchError(f"the template is gone ({exc})") from None
        if not data:
            raise BranchError("the template is gone")
        reply: dict[str, Any] = json.loads(data)
        return reply

    def fork(self, req: dict[str, Any], stderr: int) -> tuple[int, float]:
        """Fork a branch kernel (blocking); its pid and how long the ``fork()`` took."""
        reply = self._call({"op": "fork", **req}, (stderr,))
        return int(reply["pid"]), float(reply.get("fork_s", 0.0))

    def status(self, pid: int) -> int | None:
        """Reap the template's ended child ``pid``; its exit status (None: unknown)."""
        try:
            value = self._call({"op": "status", "pid": pid}).get("status")
        except BranchError:
            return None
        return int(value) if value is not None else None

    def close(self) -> None:
        """Kill the template and remove its directory (its branches die with it)."""
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            self._close_pidfd()
        for path in [self.tdir, *self.extra_dirs]:
            with contextlib.suppress(OSError):
                _trees.remove(path)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _readable(fd: int) -> bool:
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
