"""The fork server: one process per kernel interpreter that has imported ipykernel and IPython
once and forks a fresh kernel on request, so a new kernel skips its interpreter's start-up and
imports (about 0.25 s of a 0.3 s start here).

The server is standard-library Python run as text (``python -c``) by the kernel's own
interpreter. It creates no zmq context, thread or event loop before forking: every child starts
its kernel (``IPKernelApp``) from scratch, with its own connection file and key, working
directory, environment (the kernel's, set before anything of the kernel runs), session and
standard streams. The server compiles the kernel side's source once, and its kernels run that
code when they install it. At ``isolation="process"`` the child first runs kernelexec's launcher
(``_sandbox._launcher``, the same text and the same ``setup()`` as the plain launch), so the
kernel gets its cgroups, rlimits and own user under a subreaper that kills every descendant.

Lifetimes form a chain of ``PR_SET_PDEATHSIG``: the host's death kills the server (SIGKILL),
the server's death ends its launchers (SIGTERM, they kill their kernels) and its direct kernels
(``"none"``: SIGKILL). The server never reaps a child on its own: the host asks for a child's
exit status (``status``) once the child's pidfd says it has ended, so a pid the host holds is
never reused under it. Closing the host's end of the socket ends the server.

What cannot change after a fork is fixed per server, and kernels that differ in it get another
server (:func:`server_key`): the interpreter, the variables Python and the C library read at
start-up (``PYTHON*``, locale, ``MALLOC_*``, ``LD_*``) and whether the user site directory is
used. Forked kernels of one server share the server's hash seed (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import IO, Any

from kernelexec import _proctitle
from kernelexec._protocol import _host as protocol
from kernelexec._protocol import _kernel_side as kernel_side
from kernelexec._sandbox import _launcher
from kernelexec.backends._stderr import stderr_tail

log = logging.getLogger("kernelexec")

SOURCE = (
    "# kernelexec fork server\n"
    + _proctitle.SOURCE
    + f"kx_set_title({_proctitle.FORK_SERVER!r}, {_proctitle.COMMS[_proctitle.FORK_SERVER]!r})\n"
    + f"KERNEL_COMM = {_proctitle.COMMS[_proctitle.KERNEL]!r}\n"
    + f"COMPILED = {kernel_side.COMPILED_MODULE_NAME!r}\n"
    + r"""
import ctypes, gc, json, os, signal, socket, sys
# No collection while the server imports, and what it imported frozen before the first fork:
# a child's collections then never write to the pages it shares with the server.
gc.disable()
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
host, fd = int(sys.argv[1]), int(sys.argv[2])
launcher_code = compile(sys.argv[3], "<kernelexec launcher>", "exec")  # once, shared by forks
if os.getppid() != host:
    sys.exit(1)
chan = socket.socket(fileno=fd)
server = os.getpid()
chan.send(json.dumps({"hello": server}).encode())
if sys.path and sys.path[0] in ('', '.'):
    del sys.path[0]
sys.modules.setdefault('debugpy', None)
from ipykernel import kernelapp
import ipykernel.ipkernel, ipykernel.zmqshell, ipykernel.iostream, ipykernel.heartbeat
import ipykernel.comm, ipykernel.eventloops, IPython.core.completer
# What a kernel imports while it starts (IPython's debugger, storemagic, tornado's queues...)
# and the standard modules kernelexec's kernel side uses: imported once here, not per kernel.
import IPython.core.completerlib, IPython.core.debugger, IPython.core.oinspect
import IPython.extensions.storemagic, IPython.utils.wildcard, faulthandler, pdb, unicodedata
import tornado.gen, tornado.locks, tornado.platform.asyncio, tornado.queues
import base64, dataclasses, decimal, enum, linecache, pathlib, select, uuid
try:
    import ipykernel.debugger
except ImportError:
    pass
# The kernel side's sources, compiled once here: a kernel that installs the same text runs
# this code instead of compiling it (a quarter of a forked kernel's start-up CPU).
import types
compiled = types.ModuleType(COMPILED)
compiled.codes = {}
for text in sys.argv[4:]:
    try:
        compiled.codes[text] = compile(text, "<kernelexec>", "exec")
    except Exception:
        pass  # the kernel compiles it itself and reports what is wrong
sys.modules[COMPILED] = compiled
gc.collect()
gc.freeze()

def run_kernel(req):
    import atexit, tempfile, time, traceback
    kx_set_title(req["title"], KERNEL_COMM)
    gc.enable()  # in the kernel only: the launcher allocates little and lives long
    tempfile.tempdir = None
    time.tzset()
    sys.argv = ["-c"] + req["argv"]
    code = 0
    try:
        kernelapp.IPKernelApp.launch_instance(argv=req["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)

def child(req, fds):
    chan.close()
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(fds[0] if fds else null, 2)
    for extra in [null, *fds]:
        if extra > 2:
            os.close(extra)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    if req["launcher"] is None:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server:
            os._exit(1)
        run_kernel(req)
    sys.argv = ["-c", json.dumps(req["launcher"])]
    space = {"__name__": "__kx_launcher__", "run_kernel": lambda: run_kernel(req)}
    exec(launcher_code, space)

def answer(reply):
    chan.send(json.dumps(reply).encode())

while True:
    try:
        data, fds, _, _ = socket.recv_fds(chan, 1 << 20, 4)
    except InterruptedError:
        continue
    if not data:
        os._exit(0)
    req = json.loads(data)
    if req["op"] == "fork":
        try:
            pid = os.fork()
        except OSError as exc:
            pid = -1
            answer({"error": repr(exc)})
        if pid == 0:
            code = 127
            try:
                child(req, fds)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException as exc:
                os.write(2, ("kernelexec fork server: " + repr(exc) + "\n").encode())
            os._exit(code)
        for extra in fds:
            os.close(extra)
        if pid > 0:
            answer({"pid": pid})
    elif req["op"] == "status":
        try:
            _, status = os.waitpid(req["pid"], 0)
            answer({"status": os.waitstatus_to_exitcode(status)})
        except ChildProcessError:
            answer({"status": None})
"""
)

# Read by Python or the C library when the interpreter starts: a fork cannot change them.
_STARTUP_PREFIXES = ("PYTHON", "LC_", "MALLOC_", "LD_", "GLIBC_")
_STARTUP_NAMES = ("LANG", "LANGUAGE", "HOME")


def startup_env(env: dict[str, str], user_site: bool) -> dict[str, str]:
    """The variables of a kernel's ``env`` that its interpreter reads at start-up (``HOME``
    only when the user site directory is used): a fork server runs with these and no others."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_STARTUP_PREFIXES) or (k in _STARTUP_NAMES and (user_site or k != "HOME"))
    }


def server_key(python: str, env: dict[str, str], user_site: bool) -> tuple[Any, ...]:
    """What kernels of one fork server share; kernels that differ in it need another server.

    Keyed by thread too: ``PR_SET_PDEATHSIG`` follows the thread that started the server, so
    each event-loop thread gets servers of its own.
    """
    return (
        python,
        tuple(sorted(startup_env(env, user_site).items())),
        user_site,
        threading.get_ident(),
    )


HELLO_TIMEOUT = 0.5
"""Seconds a new server has to say hello (before its imports: an interpreter start, about
20 ms here) unless it is visibly the interpreter; one that does not is given up and the kernel
launched the plain way."""

HELLO_PATIENCE = 30.0
"""Seconds the interpreter itself has to say hello (a machine under heavy load)."""


def supported() -> bool:
    """Whether this host can run fork servers (Linux with pidfds)."""
    return hasattr(os, "pidfd_open") and hasattr(socket, "send_fds") and hasattr(os, "fork")


_ARG_MAX = 100_000
"""The longest source text passed on the server's command line (Linux refuses one argument
past 128 KiB); a longer one is compiled by each kernel."""


def _precompiled() -> list[str]:
    """The kernel side's source texts the server compiles once for its kernels."""
    return [t for t in protocol.kernel_side_sources().values() if len(t.encode()) <= _ARG_MAX]


class ForkServerError(RuntimeError):
    """The fork server could not fork (it is gone, or never came up)."""


class ForkServer:
    """The host's handle on one fork server process (see the module docstring)."""

    def __init__(self, python: str, env: dict[str, str], user_site: bool) -> None:
        self.python = python
        self._env = startup_env(env, user_site)
        self._user_site = user_site
        self._proc: subprocess.Popen[bytes] | None = None
        self._chan: socket.socket | None = None
        self._stderr: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._greeted = False
        self.live = 0
        """Kernels forked and not yet reaped (counted by :class:`ForkedProcess`, on the event
        loop's thread)."""
        self.failed = ""
        """Why the server is unusable (it could not start, or died), or ``""``."""

    @property
    def pid(self) -> int | None:
        """The server's process id, or None before it started."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the server runs (or has not been started yet and has not failed)."""
        if self.failed:
            return False
        return self._proc is None or self._proc.poll() is None

    def start(self) -> None:
        """Start the server process; it imports in the background and forks once ready.

        Must run on the thread whose end should end the server (the event loop's).

        Raises:
            OSError: the interpreter could not be run.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        argv = [self.python, *([] if self._user_site else ["-s"]), "-c", SOURCE]
        try:
            self._proc = subprocess.Popen(
                [
                    *argv,
                    str(os.getpid()),
                    str(theirs.fileno()),
                    _launcher.SOURCE,
                    *_precompiled(),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                env=self._env,
                cwd="/",
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            self._stderr.close()
            self._stderr = None
            raise
        finally:
            theirs.close()
        self._chan = ours

    def _request(self, req: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        with self._lock:
            chan = self._chan
            if chan is None:
                raise ForkServerError("the fork server is closed")
            if not self._greeted:
                self._greet(chan)
            try:
                if fds:
                    socket.send_fds(chan, [json.dumps(req).encode()], list(fds))
                else:
                    chan.send(json.dumps(req).encode())
                data = chan.recv(1 << 16)
            except OSError as exc:
                data = b""
                self.failed = f"the fork server is gone ({exc})"
            if not data:
                self.failed = self.failed or f"the fork server exited{self.diagnostics()}"
                raise ForkServerError(self.failed)
            reply: dict[str, Any] = json.loads(data)
            return reply

    def _greet(self, chan: socket.socket) -> None:
        """Wait for the server's first words (sent before its imports; the caller holds the
        lock). Past :data:`HELLO_TIMEOUT`, waiting goes on only while the process is the
        interpreter itself (a loaded machine), so that anything else (a wrapper that runs
        something else, a fake interpreter) is given up on quickly."""
        started = time.monotonic()
        data = b""
        try:
            while True:
                chan.settimeout(0.1)
                try:
                    data = chan.recv(1 << 16)
                    break
                except TimeoutError:
                    waited = time.monotonic() - started
                    if waited > HELLO_PATIENCE or (
                        waited > HELLO_TIMEOUT and not self._is_interpreter()
                    ):
                        self.failed = f"the fork server did not answer in {waited:.1f} s"
                        break
        except OSError as exc:
            self.failed = f"the fork server did not answer ({exc})"
        finally:
            with contextlib.suppress(OSError):
                chan.settimeout(None)
        try:
            hello = json.loads(data) if data else {}
        except ValueError:
            hello = {}
        if not isinstance(hello, dict) or hello.get("hello") != self.pid:
            self.failed = self.failed or f"the fork server did not start{self.diagnostics()}"
            raise ForkServerError(self.failed)
        self._greeted = True

    def _is_interpreter(self) -> bool:
        """Whether the server process runs the interpreter's own executable."""
        try:
            running = os.path.realpath(f"/proc/{self.pid}/exe")
        except OSError:
            return False
        return running == os.path.realpath(self.python) and self.alive()

    def fork(
        self,
        *,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        stderr: int,
        launcher: dict[str, Any] | None,
        title: str,
    ) -> int:
        """Fork a kernel: ``argv`` for ``IPKernelApp``, run under the launcher with the
        configuration ``launcher`` (its ``host`` is this server), or directly when None; the
        kernel shows ``title`` in ``ps``.
        Blocking (the first fork waits until the server has imported ipykernel).

        Raises:
            ForkServerError: the server is gone or could not fork.
        """
        if self._proc is None:
            raise ForkServerError("the fork server is not started")
        req = {
            "op": "fork",
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "launcher": launcher,
            "title": title,
        }
        reply = self._request(req, (stderr,))
        if "pid" not in reply:
            raise ForkServerError(f"the fork server could not fork: {reply.get('error')}")
        return int(reply["pid"])

    def status(self, pid: int) -> int | None:
        """Reap the server's child ``pid`` and return its exit status (Popen's convention:
        ``-N`` for signal N), waiting until it has ended; None when unknown."""
        try:
            value = self._request({"op": "status", "pid": pid}).get("status")
        except ForkServerError:
            return None
        return int(value) if value is not None else None

    def diagnostics(self, limit: int = 2000) -> str:
        """The tail of the server's stderr, or ``""``."""
        return stderr_tail(self._stderr, "fork server stderr", limit)

    def close(self) -> None:
        """End the server (its kernels end with it) and wait until it has exited."""
        # Not under the lock: a fork may be waiting for the server; shutdown() wakes it.
        chan, self._chan = self._chan, None
        if chan is not None:
            with contextlib.suppress(OSError):
                chan.shutdown(socket.SHUT_RDWR)
            chan.close()  # the server reads EOF and exits
        proc, self._proc = self._proc, None
        if proc is not None:
            if not self._greeted:
                proc.kill()  # perhaps no fork server at all (it never said hello)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self.failed = self.failed or "the fork server is closed"


class ForkedProcess:
    """A process a fork server forked for this host, shaped like :class:`subprocess.Popen`
    where kernelexec uses it (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``).

    Its end is seen through a pidfd (it is not the host's child); its exit status comes from
    the server, which reaps it.
    """

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.server = server
        self.returncode: int | None = None
        self._done = False
        self._pidfd: int | None = os.pidfd_open(pid)
        server.live += 1

    def _ended(self, timeout: float | None) -> bool:
        """Whether the process has ended, waiting at most ``timeout`` seconds (None: no
        limit)."""
        fd = self._pidfd
        if fd is None:
            return True
        # poll(), not select(): select cannot take a descriptor above 1023 (the 128th kernel).
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))

    def poll(self) -> int | None:
        """The exit status once the process has ended (reaping it), else None."""
        if self._done:
            return self.returncode
        if not self._ended(0):
            return None
        self._reap()
        return self.returncode

    def _reap(self) -> None:
        self.returncode = self.server.status(self.pid)
        self.server.live -= 1
        self._done = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until the process has ended (at most ``timeout`` seconds); its status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if not self._done:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self._reap()
        return self.returncode

    async def wait_async(self, timeout: float) -> bool:
        """Wait without blocking the event loop; True once ended (and reaped)."""
        fd = self._pidfd
        if fd is not None and not self._done:
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[None] = loop.create_future()

            def readable() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(fd, readable)
            try:
                await asyncio.wait_for(ended, timeout)
            except asyncio.TimeoutError:
                return False
            finally:
                loop.remove_reader(fd)
        self.poll()
        return self._done

    def send_signal(self, signum: int) -> None:
        """Signal the process's group (it leads a session of its own)."""
        if self._done:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)  # not reaped yet: the pid cannot have been reused

    def kill(self) -> None:
        """SIGKILL the process's group."""
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Forget the process (reaped, or left to its server, which reaps it when it goes)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if not self._done:
            self.server.live -= 1
        self._done = True
