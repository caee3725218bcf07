"""``KernelProcess``: one local kernel's process, started one of three ways, and stopped.

A kernel is launched the plain way (a fresh interpreter per kernel, through jupyter-client's
manager), forked from a fork server of its interpreter (``_forkserver``), or forked from a
template of a live kernel (a branch: the template comes from ``kernelexec._branching`` through
the backend interface's :class:`~kernelexec.backends._base.KernelTemplate`). Under isolation
the host's process is the launcher (``_sandbox._launcher``), and the kernel is found below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import tempfile
from typing import IO, Any

import psutil
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from kernelexec import _proctitle
from kernelexec._exceptions import BranchError, KernelStartError
from kernelexec._sandbox._plan import KernelSetup
from kernelexec.backends import _wire
from kernelexec.backends._base import KernelTemplate
from kernelexec.backends._forkserver import ForkedProcess
from kernelexec.backends._forkservers import ForkServers, stop_forked
from kernelexec.backends._stderr import stderr_tail

log = logging.getLogger("kernelexec")

# Flags that trim start-up: no history database (nothing written under ~/.ipython), and the
# 0.5 ms sleep ipykernel inserts before every reply turned off.
KERNEL_FLAGS = (
    "--HistoryManager.enabled=False",
    "--IPythonKernel._execute_sleep=0",
    "--Application.log_level=WARN",
)

# ipykernel_launcher, minus ipykernel's debugger: importing debugpy is about 110 ms of a 0.3 s
# kernel start (python -X importtime), and kernelexec does not speak the debug protocol. The
# block is lifted once ipykernel is up (kernel side ``install``), so tools may import debugpy.
LEAN_LAUNCHER = (
    "import sys\n"
    "if sys.path and sys.path[0] in ('', '.'):\n"
    "    del sys.path[0]\n"
    "sys.modules.setdefault('debugpy', None)\n"
    "from ipykernel import kernelapp\n"
    "kernelapp.launch_new_instance()\n"
)


def lean_launcher(title: str) -> str:
    """The lean launcher's text for a plain kernel that shows ``title`` in ``ps``."""
    comm = _proctitle.COMMS[_proctitle.KERNEL]
    return f"{_proctitle.SOURCE}kx_set_title({title!r}, {comm!r})\n{LEAN_LAUNCHER}"


def describe_exit(code: int | None) -> str:
    """An exit status in words: ``killed by SIGKILL``, ``exit code 1``."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Manager(AsyncKernelManager):
    """jupyter-client's manager, handing the connection file to the kernel's own user."""

    kernel_uid: int | None = None

    def write_connection_file(self, **kwargs: Any) -> None:
        super().write_connection_file(**kwargs)
        if self.kernel_uid is not None:
            os.chown(self.connection_file, self.kernel_uid, self.kernel_uid)


class _FixedSpecs(KernelSpecManager):
    """Hands jupyter-client our in-memory kernelspec instead of searching the disk."""

    def __init__(self, spec: KernelSpec) -> None:
        super().__init__()
        self._spec = spec

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return self._spec


class BranchProcess(ForkedProcess):
    """A branch kernel's process, shaped as the fork server's :class:`ForkedProcess` (its
    end seen through a pidfd; its exit status from the template, which reaps it).

    Raises:
        ProcessLookupError: it has already ended (before a handle could be opened).
    """

    def __init__(self, pid: int, template: KernelTemplate) -> None:
        self.pid = pid
        self.template = template
        self.returncode: int | None = None
        self._done = False
        self._pidfd: int | None = os.pidfd_open(pid)

    def _reap(self) -> None:
        status = self.template.status(self.pid)
        # None: the template that reaps it is gone too (a branch that ended its family's first
        # kernel ends with it); it has ended all the same, and "still running" would leave its
        # calls waiting out their deadline.
        self.returncode = -signal.SIGKILL if status is None else status
        self._done = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._done = True


class KernelProcess:
    """One kernel's process (module docstring): started once by one of the ``start_*``
    methods, then :meth:`stop` and :meth:`close`.

    Args:
        confined: Whether the host's process is the kernel's launcher (any level but
            ``"none"``).
        forks: The fork servers to fork a kernel from, or None to launch it the plain way.
    """

    def __init__(self, *, confined: bool, forks: ForkServers | None = None) -> None:
        self.km: AsyncKernelManager | None = None
        self.launched_by = ""
        """How the kernel was started: ``"plain"``, ``"fork server"`` or ``"branch"``."""
        self.fork_s = 0.0
        """How long a template's ``fork()`` of a branch took (seconds)."""
        self._confined = confined
        self._forks = forks
        self._forked: ForkedProcess | None = None
        self._stopping: AsyncKernelManager | None = None  # taken off by stop(), for close()
        self._stderr: IO[bytes] | None = None

    # -- starting -----------------------------------------------------------------------------

    async def start_plain(
        self, python: str, setup: KernelSetup, kernel_args: list[str], kdir: str, owner: int | None
    ) -> None:
        """Launch a fresh interpreter running the kernel in ``kdir`` (its connection file
        handed to ``owner``).

        Raises:
            KernelStartError: it could not be launched.
        """
        kernel = [python, "-c", lean_launcher(setup.title), *kernel_args]
        spec = KernelSpec(
            argv=setup.argv(kernel, os.getpid()),
            display_name="kernelexec",
            language="python",
            interrupt_mode=setup.interrupt_mode,
            metadata={},
            env={},
        )
        km = self._manager(kdir, owner, spec)
        self.km = km
        # Kernel stdout gets fd-level output that ipykernel also forwards as messages; it must
        # never be a pipe nobody drains. stderr is kept (bounded by the kernel's lifetime) so a
        # failed start can be explained.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            await km.start_kernel(
                env=setup.env, cwd=kdir, stdout=subprocess.DEVNULL, stderr=self._stderr
            )
        except Exception as exc:
            raise KernelStartError(f"could not launch {python}: {exc}") from exc
        self.launched_by = "plain"

    async def start_forked(
        self, python: str, setup: KernelSetup, kernel_args: list[str], kdir: str, owner: int | None
    ) -> bool:
        """Fork the kernel from a fork server of ``python``; False when there is none to use
        (then the caller launches it the plain way)."""
        forks = self._forks
        if forks is None:
            return False
        server = forks.server_for(python, setup.env, setup.level)
        if server is None:
            return False
        assert server.pid is not None  # server_for hands out started servers only
        km = self._manager(kdir, owner)
        km.write_connection_file()
        host = os.getpid()
        args = [a.replace("{connection_file}", km.connection_file) for a in kernel_args]
        args.append(f"--IPKernelApp.parent_handle={host}")
        self._stderr = stderr = tempfile.TemporaryFile()  # noqa: SIM115
        forked = await forks.fork(
            server,
            argv=args,
            env={**setup.env, "JPY_PARENT_PID": str(host)},
            cwd=kdir,
            stderr=stderr.fileno(),
            launcher=setup.launcher(server.pid),
            title=setup.title,
        )
        if forked is None:
            stderr.close()
            self._stderr = None
            km.cleanup_connection_file()
            return False
        self.km = km
        self._forked = forked
        self.launched_by = "fork server"
        return True

    async def start_branch(
        self, template: KernelTemplate, request: dict[str, Any], kdir: str, env: dict[str, str]
    ) -> int:
        """Fork a branch kernel from ``template`` into ``kdir`` (blocking the template's
        control socket in a thread); its pid. ``request`` adds to the fork request what the
        kernel is told besides its connection, directory and environment.

        Raises:
            BranchError: the branch exited at once, or the template is gone.
        """
        km = self._manager(kdir, None)  # root-owned connection file: the key stays the host's
        km.write_connection_file()
        self.km = km
        info = dict(km.get_connection_info(session=False))
        key = info.get("key", b"")
        info["key"] = key.decode() if isinstance(key, bytes) else str(key)
        self._stderr = stderr = tempfile.TemporaryFile()  # noqa: SIM115
        req = {"info": info, "cwd": kdir, "env": env, **request}
        pid, self.fork_s = await asyncio.to_thread(template.fork, req, stderr.fileno())
        return pid

    def adopt_branch(self, pid: int, template: KernelTemplate) -> None:
        """Take the branch ``pid`` forked by :meth:`start_branch` as this kernel.

        Raises:
            BranchError: it has already exited.
        """
        try:
            self._forked = BranchProcess(pid, template)
        except ProcessLookupError:
            raise BranchError(f"the branch kernel exited at once{self.diagnostics()}") from None
        self.launched_by = "branch"

    def _manager(self, kdir: str, owner: int | None, spec: KernelSpec | None = None) -> _Manager:
        extra: dict[str, Any] = {"kernel_spec_manager": _FixedSpecs(spec)} if spec else {}
        km = _Manager(
            **extra,
            kernel_name="kernelexec",
            transport="ipc",
            ip=os.path.join(kdir, "s"),
            connection_file=os.path.join(kdir, "kernel.json"),
            # Ours: by default each manager makes a zmq context of its own (two threads and
            # five descriptors per kernel in this process) for its one control socket.
            context=_wire.context(),
        )
        km.kernel_uid = owner
        return km

    # -- while it runs ------------------------------------------------------------------------

    def diagnostics(self, limit: int = 2000) -> str:
        """The tail of the kernel's stderr, for a failed start or a death."""
        return stderr_tail(self._stderr, "kernel stderr", limit)

    def process(self) -> Any:
        """The process the host started for the kernel (a ``Popen``, or the
        :class:`ForkedProcess` a fork server or template made): the launcher under isolation,
        else the kernel; None once shut down."""
        if self._forked is not None:
            return self._forked
        km = self.km
        return getattr(km.provisioner, "process", None) if km is not None else None

    def kernel_pid(self) -> int | None:
        """The kernel's own pid (below its launcher under isolation), or None when not found."""
        proc = self.process()
        pid = getattr(proc, "pid", None)
        if pid is None or self.launched_by == "branch" or not self._confined:
            return pid  # a branch has no launcher
        if self._forked is not None:
            # The launcher's first child is the kernel: orphans it adopts come after it.
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as fh:
                    kids = fh.read().split()
            except OSError:
                return None
            return int(kids[0]) if kids else None
        return _plain_kernel_below(pid)

    async def interrupt(self) -> None:
        """SIGINT to the kernel, as jupyter-client's signal mode does it."""
        km = self.km
        if self._forked is not None:
            # Signal mode, as jupyter-client does it: SIGINT to the kernel's process group
            # (a launcher ignores it).
            self._forked.send_signal(signal.SIGINT)
        elif km is not None and km.has_kernel:
            with contextlib.suppress(Exception):
                await km.interrupt_kernel()

    # -- teardown -----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop the kernel's processes: a forked one as a plain one is, a launcher asked to
        kill the kernel and every descendant (and waited for)."""
        km, self.km = self.km, None
        self._stopping = km
        forked, self._forked = self._forked, None
        if forked is not None:
            try:
                await stop_forked(forked, launcher=self._confined)
            finally:
                if self._forks is not None:
                    self._forks.kernel_ended(forked.server)
        if km is not None:
            await self._stop_launcher(km)

    async def close(self) -> None:
        """Shut jupyter-client's manager down (the process group killed when that fails) and
        close the kernel's stderr."""
        km = self._stopping or self.km
        self._stopping = self.km = None
        if km is not None:
            if km.has_kernel:
                try:
                    await km.shutdown_kernel(now=True)
                except Exception:
                    await _kill_process_group(km)
            with contextlib.suppress(Exception):
                await km.cleanup_resources()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    async def _stop_launcher(self, km: AsyncKernelManager) -> None:
        """Have the launcher kill the kernel and every descendant, and wait until it has."""
        proc = getattr(km.provisioner, "process", None)
        if not self._confined or proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()


def _plain_kernel_below(pid: int) -> int | None:
    """The kernel below the launcher ``pid`` of a plain launch: a process running the lean
    launcher's code (bubblewrap's command line holds it too)."""
    try:
        found = [p for p in psutil.Process(pid).children(recursive=True) if _is_kernel(p.cmdline())]
    except psutil.Error:
        return None
    # The kernel's own forks (branches: ``kernelexec._branching``) run the same code
    # below it: the kernel is the one whose parent is not such a Python process.
    pids = {p.pid: p for p in found}

    def wrapper(proc: psutil.Process) -> bool:
        return os.path.basename(str(proc.cmdline()[0])) == "bwrap"

    try:
        kernels = [
            p for p in found if not wrapper(p) and (p.ppid() not in pids or wrapper(pids[p.ppid()]))
        ]
    except (psutil.Error, IndexError):
        return None
    return kernels[0].pid if kernels else None


def _is_kernel(cmdline: list[str]) -> bool:
    """Whether a process is a plain-launched kernel: titled one, or still running the lean
    launcher's code (the moment before it titles itself)."""
    return " ".join(cmdline).startswith(_proctitle.KERNEL) or any(
        "from ipykernel import kernelapp" in arg for arg in cmdline
    )


async def _kill_process_group(km: AsyncKernelManager) -> None:
    proc = getattr(km.provisioner, "process", None)
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)
