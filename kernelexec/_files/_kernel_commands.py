"""The background-commands helper that kernelexec installs inside a kernel with the files helper.

A kernel module (installed as text by ``kernelexec._protocol._install``) run in the kernel as
``__kernelexec_commands__``; standard library only. It serves :data:`COMMAND_REQUEST`: ``start``
a command in the background (its own process group, stdin at EOF, stdout and stderr read from
pipes into the kernel's memory, at most 16 MiB each between polls), ``poll`` it (its exit code
once it ended, and the output since the last poll, as binary buffers), and ``signal`` its
process group. Every request returns at once (``poll`` waits at most a moment for the command to
end), so the session's other calls, a file read for one, run while a command does.

Commands never outlive their kernel, however it ends: each runs under a small supervisor
(``_kernel_supervisor.py``, its code handed over at install) that kills the command's process
group when the kernel is gone; at ``"process"`` and ``"bwrap"`` kernelexec also reaps every
descendant of a kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

MODULE_NAME = "__kernelexec_commands__"
COMMAND_REQUEST = "kernelexec_command_request"
COMMAND_REPLY = "kernelexec_command_reply"

_MAX_READ = 4 << 20  # output bytes per stream per poll
_MAX_BUFFERED = 16 << 20  # output bytes per stream held in the kernel between polls
_LINGER = 1.0  # seconds after a command ended that its pipes may stay open
_Reply = tuple[dict[str, Any], list[Any]]


_supervisor: list[str] = []  # the supervisor's code (``_kernel_supervisor.py``), from install
_alive: list[int] = []  # the write end of the kernel's liveness pipe, once made


class _Command:
    """One background command: its supervisor process, and its output read from pipes by two
    threads into buffers that each poll empties (so nothing of it is ever left on disk)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        if not _alive:
            read_end, write_end = os.pipe()  # neither is inherited unless passed
            _alive[:] = [read_end, write_end]
        supervisor = [sys.executable, "-I", "-S", "-c", _supervisor[0], str(_alive[0])]
        self.proc = subprocess.Popen(
            [*supervisor, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=(_alive[0],),
        )
        self.buffers = [bytearray(), bytearray()]
        self.open = 2  # pipes not yet at end of file
        self.changed = threading.Condition()
        self.ended_at: float | None = None
        for index, pipe in enumerate((self.proc.stdout, self.proc.stderr)):
            threading.Thread(
                target=self._drain,
                args=(index, pipe),
                name="kernelexec command output",
                daemon=True,
            ).start()

    def _drain(self, index: int, pipe: Any) -> None:
        """Read one pipe to its end; stop reading while its buffer is full (the command then
        waits to write, as it would on a pipe, until the host polls)."""
        fd = pipe.fileno()
        try:
            while True:
                with self.changed:
                    while len(self.buffers[index]) >= _MAX_BUFFERED:
                        self.changed.wait()
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                with self.changed:
                    self.buffers[index] += data
        finally:
            pipe.close()
            with self.changed:
                self.open -= 1
                self.changed.notify_all()

    def take(self, index: int, limit: int) -> bytes:
        with self.changed:
            buffer = self.buffers[index]
            data = bytes(buffer[:limit])
            del buffer[:limit]
            self.changed.notify_all()
        return data

    def drained(self, wait: float) -> bool:
        """Whether all its output has been read from its pipes, waiting up to ``wait`` s. A
        process it left behind may hold them open: then, a second after it ended, what came
        is all there is."""
        if self.ended_at is None:
            self.ended_at = time.monotonic()
        with self.changed:
            self.changed.wait_for(lambda: self.open == 0, wait)
            return self.open == 0 or time.monotonic() - self.ended_at > _LINGER

    def kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


_commands: dict[str, _Command] = {}


def _kill_all() -> None:
    for command in list(_commands.values()):
        if command.proc.poll() is None:
            command.kill_group(signal.SIGKILL)


def install(supervisor: str) -> bool:
    """Register the handler of :data:`COMMAND_REQUEST`, whose commands run under the
    ``supervisor`` code; False when this ipykernel has no handler table."""
    from IPython import get_ipython

    _supervisor[:] = [supervisor]

    kernel = get_ipython().kernel
    handlers = getattr(kernel, "shell_handlers", None)
    if not isinstance(handlers, dict):
        return False

    def handler(stream: Any, ident: Any, parent: Any) -> None:
        reply, out = serve(parent.get("content") or {})
        kernel.session.send(stream, COMMAND_REPLY, reply, parent, ident=ident, buffers=out)

    handlers[COMMAND_REQUEST] = handler
    atexit.register(_kill_all)
    return True


def serve(content: dict[str, Any]) -> _Reply:
    """Run one request; return the reply's content and buffers. Never raises."""
    try:
        op = content.get("op")
        if op == "start":
            return _start(content)
        command = _commands.get(str(content.get("id")))
        if command is None:
            return _error("unknown", "no such command (the kernel was restarted?)"), []
        if op == "poll":
            return _poll(content, command)
        if op == "signal":
            command.kill_group(int(content.get("signal", signal.SIGKILL)))
            return {"status": "ok"}, []
        return _error("invalid", f"unknown command operation {op!r}"), []
    except OSError as exc:
        return _error("os_error", f"{type(exc).__name__}: {exc}"), []
    except Exception as exc:
        return _error("internal", f"{type(exc).__name__}: {exc}"), []


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"status": "error", "kind": kind, "message": message}


def _start(content: dict[str, Any]) -> _Reply:
    argv = [str(a) for a in content.get("argv") or []]
    if not argv:
        return _error("invalid", "no command given"), []
    env = dict(os.environ)
    python_dir = os.path.dirname(sys.executable)
    path = env.get("PATH", os.defpath).split(os.pathsep)
    if python_dir not in path:  # ``python`` is the kernel's own interpreter
        env["PATH"] = os.pathsep.join([python_dir, *path])
    env.update({str(k): str(v) for k, v in (content.get("env") or {}).items()})
    cwd = content.get("cwd") or "."
    root = getattr(sys.modules.get("__kernelexec__"), "_state", {}).get("workdir")
    if root and not os.path.isabs(cwd):
        cwd = os.path.join(root, cwd)
    command = _Command(argv, env, cwd)
    key = uuid.uuid4().hex
    _commands[key] = command
    return {"status": "ok", "id": key, "pid": command.proc.pid}, []


def _poll(content: dict[str, Any], command: _Command) -> _Reply:
    wait = min(max(float(content.get("wait") or 0), 0.0), 1.0)
    try:
        code = command.proc.wait(wait) if wait else command.proc.poll()
    except subprocess.TimeoutExpired:
        code = None
    done = code is not None and command.drained(wait)
    limit = int(content.get("limit") or _MAX_READ)
    out = command.take(0, limit)
    err = command.take(1, limit)
    done = done and not (len(out) == limit or len(err) == limit)
    if done:
        del _commands[str(content["id"])]
    reply = {"status": "ok", "exit_code": code if done else None, "running": code is None}
    return reply, [out, err]
