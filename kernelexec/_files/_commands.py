"""``AsyncSessionCommands``: shell commands that run in the background in a session's kernel.

A command started here runs as a child of the kernel (with the kernel's user, limits and
namespaces) while the session's lock is free: the session's other calls, a file read while a
long build runs for one, go on meanwhile. Each step (start, poll, signal) is one short request
through the session's :class:`~kernelexec._files._link.KernelLink`.

The host keeps at most ``max_output`` bytes of each stream (the first ones; default
:data:`MAX_OUTPUT`): the rest is read from the kernel, so the command never blocks on a full
pipe, counted and dropped, and the result says so (a marker line and ``*_dropped``). A tenant's
command printing without end costs the host that much memory, not what it printed.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from kernelexec._aio import finish_shielded
from kernelexec._exceptions import FileTransferError
from kernelexec._files._link import KernelLink
from kernelexec._files._wire import COMMAND_REPLY, COMMAND_REQUEST
from kernelexec._public import public

MAX_OUTPUT = 16 << 20
"""Bytes of each stream of a command the host keeps by default (the kernel side holds as much
between two polls)."""

_POLL_WAIT = 0.25
"""Seconds one poll may wait in the kernel for the command to end. The kernel's shell is busy
meanwhile, so this is also the longest a call of the session waits behind a poll."""


class CommandResult(BaseModel):
    """How a command ended.

    Attributes:
        exit_code: Its exit status (negative: killed by that signal, as after a timeout;
            127: no such program).
        stdout: Its standard output, decoded as UTF-8 (undecodable bytes as U+FFFD); where
            more than ``max_output`` bytes came, the first ones and a line saying how many
            more were dropped (:func:`cut_marker`).
        stderr: Its standard error, the same way.
        timed_out: Whether it was killed for running past its timeout.
        stdout_dropped: Bytes of standard output dropped past ``max_output``.
        stderr_dropped: Bytes of standard error dropped the same way.
    """

    model_config = ConfigDict(frozen=True)

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_dropped: int = 0
    stderr_dropped: int = 0

    @property
    def truncated(self) -> bool:
        """Whether any output was dropped."""
        return bool(self.stdout_dropped or self.stderr_dropped)


def cut_marker(kept: int, dropped: int) -> str:
    """The line that ends a stream cut after ``kept`` bytes, ``dropped`` more not kept."""
    return f"\n[kernelexec: output cut after {kept} bytes; {dropped} more bytes dropped]\n"


class BackgroundCommand:
    """A command running in the background in a session's kernel (from
    :meth:`AsyncSessionCommands.start`). Its output is gathered as it is polled.

    Attributes:
        pid: Its supervisor's process id in the kernel's namespace (also its process group).
        exit_code: Its exit status once it ended, else None.
        max_output: Bytes of each stream kept; the rest is dropped and counted.
        stdout_dropped: Bytes of standard output dropped so far.
        stderr_dropped: Bytes of standard error dropped so far.
    """

    def __init__(
        self,
        link: KernelLink,
        key: str,
        pid: int,
        generation: int,
        max_output: int = MAX_OUTPUT,
    ) -> None:
        self._link = link
        self._key = key
        self._generation = generation
        self.pid = pid
        self.exit_code: int | None = None
        self.max_output = max_output
        self._out = bytearray()
        self._err = bytearray()
        self.stdout_dropped = 0
        self.stderr_dropped = 0
        self._done = False

    @property
    def stdout(self) -> bytes:
        """Standard output gathered so far."""
        return bytes(self._out)

    @property
    def stderr(self) -> bytes:
        """Standard error gathered so far."""
        return bytes(self._err)

    @property
    def running(self) -> bool:
        """Whether it had not ended at the last poll."""
        return not self._done

    async def poll(self, wait: float = 0.0) -> int | None:
        """Gather its new output; its exit code once it ended (after all its output), else
        None. ``wait`` (at most 1 s) lets the kernel wait that long for it to end."""
        if self._done:
            return self.exit_code
        async with self._link.lease.hold():
            conn = await self._link.connect()
            if self._link.lease.generation != self._generation:
                self._done = True
                raise FileTransferError(
                    "the command's kernel was replaced (restart, crash or eviction); "
                    "the command ended with it"
                )
            content = {"op": "poll", "id": self._key, "wait": wait}
            got = await self._link.ask(conn, COMMAND_REQUEST, COMMAND_REPLY, content)
        if got.content.get("status") != "ok":
            raise FileTransferError(f"polling the command failed: {got.content.get('message')}")
        if len(got.buffers) == 2:
            self.stdout_dropped += _keep(self._out, got.buffers[0], self.max_output)
            self.stderr_dropped += _keep(self._err, got.buffers[1], self.max_output)
        code = got.content.get("exit_code")
        if code is not None:
            self._done = True
            self.exit_code = int(code)
        return self.exit_code

    async def wait(self, timeout: float | None = None) -> int | None:
        """Poll until it ends; its exit code, or None when ``timeout`` seconds passed first
        (it keeps running). The session's other calls run between the polls."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = math.inf if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            await self.poll(wait=min(_POLL_WAIT, left))
        return self.exit_code

    async def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to its whole process group (nothing when it already ended)."""
        if self._done:
            return
        async with self._link.lease.hold():
            if self._link.lease.generation != self._generation:
                return  # its kernel, and so the command, is gone
            conn = await self._link.connect()
            content = {"op": "signal", "id": self._key, "signal": int(sig)}
            await self._link.ask(conn, COMMAND_REQUEST, COMMAND_REPLY, content)

    def result(self, *, timed_out: bool = False) -> CommandResult:
        """What was gathered, as a :class:`CommandResult`."""
        return CommandResult(
            exit_code=self.exit_code,
            stdout=_text(self._out, self.stdout_dropped),
            stderr=_text(self._err, self.stderr_dropped),
            timed_out=timed_out,
            stdout_dropped=self.stdout_dropped,
            stderr_dropped=self.stderr_dropped,
        )


def _keep(kept: bytearray, data: bytes | memoryview, limit: int) -> int:
    """Add to ``kept`` what fits under ``limit`` of ``data``; how many bytes did not."""
    room = max(0, limit - len(kept))
    kept += data[:room]
    return max(0, len(data) - room)


def _text(kept: bytearray, dropped: int) -> str:
    text = kept.decode("utf-8", "replace")
    return text + cut_marker(len(kept), dropped) if dropped else text


class AsyncSessionCommands:
    """Shell commands in the session's kernel, in the background: ``session.commands``.

    ``command`` is an argument list, or a string run by ``/bin/sh -c``. It runs in the
    session's working directory (``cwd`` is relative to it), with the kernel's environment plus
    ``env``, stdin at end of file, and ``python`` on its ``PATH`` being the kernel's own
    interpreter. It never outlives its kernel.
    """

    def __init__(self, link: KernelLink) -> None:
        self._link = link

    async def start(
        self,
        command: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = ".",
        max_output: int = MAX_OUTPUT,
    ) -> BackgroundCommand:
        """Start ``command`` and return at once; the host keeps at most ``max_output`` bytes
        of each of its streams."""
        argv = _argv(command)
        if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0:
            raise ValueError(f"max_output must be a number of bytes, not {max_output!r}")
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise TypeError("env must map str to str")
        async with self._link.lease.hold():
            conn = await self._link.connect()
            content = {"op": "start", "argv": argv, "env": dict(env or {}), "cwd": cwd}
            got = await self._link.ask(conn, COMMAND_REQUEST, COMMAND_REPLY, content)
            generation = self._link.lease.generation
        if got.content.get("status") != "ok":
            raise FileTransferError(f"starting {argv[0]!r} failed: {got.content.get('message')}")
        return BackgroundCommand(
            self._link, str(got.content["id"]), int(got.content["pid"]), generation, max_output
        )

    async def run(
        self,
        command: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = ".",
        timeout: float | None = None,
        max_output: int = MAX_OUTPUT,
    ) -> CommandResult:
        """Run ``command`` to its end (killed after ``timeout`` seconds, or when the caller
        cancels) and return how it ended, at most ``max_output`` bytes of each stream kept.
        Other calls of the session run meanwhile."""
        proc = await self.start(command, env=env, cwd=cwd, max_output=max_output)
        try:
            code = await proc.wait(timeout)
        except asyncio.CancelledError:
            await finish_shielded(proc.kill())
            raise
        if code is None and proc.running:
            await proc.kill()
            await proc.wait()
            return proc.result(timed_out=True)
        return proc.result()


def _argv(command: str | Sequence[str]) -> list[str]:
    if isinstance(command, str):
        if not command.strip():
            raise ValueError("the command is empty")
        return ["/bin/sh", "-c", command]
    argv = list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError("command must be a str or a non-empty sequence of str")
    return argv


public(__name__)
