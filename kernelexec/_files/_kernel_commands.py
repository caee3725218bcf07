"""The background-commands helper that kernelexec installs inside a kernel with the files helper.

Sent as text and run in the kernel as the module ``__kernelexec_commands__``; standard library
only. It serves :data:`COMMAND_REQUEST`: ``start`` a command in the background (its own process
group, stdin at EOF, stdout and stderr to files in a private directory), ``poll`` it (its exit
code once it ended, and the output written since the last poll, as binary buffers), and
``signal`` its process group. Every request returns at once (``poll`` waits at most a moment for
the command to end), so the session's other calls, a file read for one, run while a command
does.

Commands never outlive their kernel, however it ends: each runs under a small supervisor
(:data:`SUPERVISOR`) that kills the command's process group when the kernel is gone; at
``"process"`` and ``"bwrap"`` kernelexec also reaps every descendant of a kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Any

MODULE_NAME = "__kernelexec_commands__"
COMMAND_REQUEST = "kernelexec_command_request"
COMMAND_REPLY = "kernelexec_command_reply"

_MAX_READ = 4 << 20  # output bytes per stream per poll
_Reply = tuple[dict[str, Any], list[Any]]


SUPERVISOR = """# kernelexec command supervisor
import os, select, signal, subprocess, sys
alive = int(sys.argv[1])
try:
    child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
except FileNotFoundError as exc:
    sys.stderr.write(f"{sys.argv[2]}: command not found ({exc.strerror})\\n")
    sys.exit(127)
except PermissionError as exc:
    sys.stderr.write(f"{sys.argv[2]}: {exc.strerror}\\n")
    sys.exit(126)
watch = [alive]
try:
    watch.append(os.pidfd_open(child.pid))
except (AttributeError, OSError):
    pass
while child.poll() is None:
    ready, _, _ = select.select(watch, [], [], None if len(watch) > 1 else 0.5)
    if alive in ready:
        os.killpg(0, signal.SIGKILL)
code = child.returncode
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""
"""Runs one command as its child, in the process group the supervisor leads, and kills that
group when the kernel dies (the read end of a pipe whose write end only the kernel holds
reaches end of file): a command never outlives its kernel, whatever killed the kernel. Exits
as the command did; 127 when the program does not exist."""

_alive: list[int] = []  # the write end of the kernel's liveness pipe, once made


class _Command:
    """One background command: its process, its output files and how far they were read."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        if not _alive:
            read_end, write_end = os.pipe()  # neither is inherited unless passed
            _alive[:] = [read_end, write_end]
        self.dir = tempfile.mkdtemp(prefix="kx-cmd-")
        self.paths = [os.path.join(self.dir, "stdout"), os.path.join(self.dir, "stderr")]
        self.offsets = [0, 0]
        supervisor = [sys.executable, "-I", "-S", "-c", SUPERVISOR, str(_alive[0])]
        with open(self.paths[0], "wb") as out, open(self.paths[1], "wb") as err:
            self.proc = subprocess.Popen(
                [*supervisor, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                start_new_session=True,
                pass_fds=(_alive[0],),
            )

    def read(self, stream: int, limit: int) -> bytes:
        with open(self.paths[stream], "rb") as f:
            f.seek(self.offsets[stream])
            data = f.read(limit)
        self.offsets[stream] += len(data)
        return data

    def kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def forget(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)


_commands: dict[str, _Command] = {}


def _kill_all() -> None:
    for command in list(_commands.values()):
        if command.proc.poll() is None:
            command.kill_group(signal.SIGKILL)
        command.forget()


def install() -> bool:
    """Register the handler of :data:`COMMAND_REQUEST`; False when this ipykernel has none."""
    from IPython import get_ipython

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
    limit = int(content.get("limit") or _MAX_READ)
    out = command.read(0, limit)
    err = command.read(1, limit)
    more = len(out) == limit or len(err) == limit
    done = code is not None and not more
    if done:
        del _commands[str(content["id"])]
        command.forget()
    reply = {"status": "ok", "exit_code": code if done else None, "running": code is None}
    return reply, [out, err]
