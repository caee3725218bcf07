"""The fork servers of one local backend: which server a kernel comes from, when servers start
and end, and forking a kernel from one without leaking it when its caller gives up.

A server is started on the event loop's thread by the first kernel start of its kind (see
:func:`~kernelexec.backends._forkserver.server_key`) and ends when the last executor holding
the backend closes, or, for a backend no executor holds (used directly, or wrapped by another
backend), with its last kernel. A server that fails is dropped; after ``RETRIES`` failed
servers of one kind, kernels of that kind are launched the plain way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from typing import Any

from kernelexec._models import IsolationLevel
from kernelexec.backends._forkserver import (
    ForkedProcess,
    ForkServer,
    ForkServerError,
    server_key,
    supported,
)

log = logging.getLogger("kernelexec")

NO_FORK_SERVER_ENV = "KERNELEXEC_NO_FORK_SERVER"
"""Set to ``1`` to launch every kernel the plain way (as ``fork_server=False`` does)."""

FORKED_LEVELS: tuple[IsolationLevel, ...] = ("none", "process")
"""Isolation levels whose kernels come from a fork server (``"bwrap"`` starts a new process in
new namespaces, which a fork of the server cannot be)."""

RETRIES = 2
"""Fork servers of one kind that may fail before kernels of that kind stay on plain launches."""


def enabled(asked: bool) -> bool:
    """Whether fork servers are used: asked for, not switched off by
    :data:`NO_FORK_SERVER_ENV`, and possible on this host."""
    return asked and supported() and os.environ.get(NO_FORK_SERVER_ENV, "") in ("", "0")


class ForkServers:
    """The fork servers of one backend (see the module docstring)."""

    def __init__(self) -> None:
        self._servers: dict[tuple[Any, ...], ForkServer] = {}
        self._failures: dict[tuple[Any, ...], int] = {}
        self._holders = 0

    def hold(self) -> None:
        """An executor starts using the backend."""
        self._holders += 1

    def release(self) -> None:
        """An executor that held the backend has closed: the last one ends every server."""
        self._holders = max(0, self._holders - 1)
        if self._holders == 0:
            self.close()

    def close(self) -> None:
        """End every server (kernels forked from them end too)."""
        servers = list(self._servers.values())
        self._servers.clear()
        for server in servers:
            server.close()

    def server_for(
        self, python: str, env: dict[str, str], level: IsolationLevel
    ) -> ForkServer | None:
        """The running fork server for kernels of ``python`` with ``env`` at ``level``
        (started here, on the event loop's thread), or None to launch the plain way."""
        if level not in FORKED_LEVELS:
            return None
        user_site = level == "none"  # at "process" HOME is the kernel's own, empty directory
        key = server_key(python, env, user_site)
        server = self._servers.get(key)
        if server is not None and server.alive():
            return server
        if server is not None:
            del self._servers[key]
            self._failures[key] = self._failures.get(key, 0) + 1
            log.info("fork server for %s ended: %s", python, server.failed or "it exited")
            server.close()
        if self._failures.get(key, 0) >= RETRIES:
            return None
        server = ForkServer(python, env, user_site)
        try:
            server.start()
        except OSError as exc:
            self._failures[key] = RETRIES
            log.warning("could not start a fork server for %s (%s): plain launches", python, exc)
            return None
        self._servers[key] = server
        return server

    def kernel_ended(self, server: ForkServer) -> None:
        """A kernel forked by ``server`` has ended, or a fork failed: a server that failed is
        dropped, and so is one no executor holds once its last kernel has ended."""
        if server.failed or (self._holders == 0 and server.live == 0):
            for key, known in list(self._servers.items()):
                if known is server:
                    del self._servers[key]
                    if server.failed:
                        self._failures[key] = self._failures.get(key, 0) + 1
            server.close()

    async def fork(
        self,
        server: ForkServer,
        *,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        stderr: int,
        launcher: dict[str, Any] | None,
        title: str,
    ) -> ForkedProcess | None:
        """Fork a kernel from ``server`` (see :meth:`ForkServer.fork`; ``stderr`` is duplicated
        for the call); None when the server is unusable (it is dropped; launch the plain way).

        Cancelled while the server forks, the kernel it makes anyway is killed and reaped.
        """
        errfd = os.dup(stderr)  # the worker thread's own: the caller may close its file

        def blocking() -> int:
            try:
                return server.fork(
                    argv=argv, env=env, cwd=cwd, stderr=errfd, launcher=launcher, title=title
                )
            finally:
                os.close(errfd)

        call = asyncio.get_running_loop().run_in_executor(None, blocking)
        try:
            pid = await asyncio.shield(call)
        except ForkServerError as exc:
            log.warning("fork server unusable, launching the plain way: %s", exc)
            self.kernel_ended(server)
            return None
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: _discard_late_fork(done, server))
            raise
        return ForkedProcess(pid, server)


async def stop_forked(proc: ForkedProcess, *, launcher: bool) -> None:
    """End a forked kernel as a plain one is ended: its launcher asked to kill it and every
    descendant (SIGTERM), or the kernel's process group killed; then reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if launcher else signal.SIGKILL)
        if not await proc.wait_async(5.0):
            proc.kill()
            await proc.wait_async(5.0)
    proc.close()


def _discard_late_fork(done: asyncio.Future[int], server: ForkServer) -> None:
    """A fork whose caller gave up: kill and reap the kernel it made, if it made one."""
    if done.cancelled() or done.exception() is not None:
        return
    proc = ForkedProcess(done.result(), server)
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    proc.close()
