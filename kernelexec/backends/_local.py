"""The local backend: an ipykernel process on this machine, driven by jupyter-client.

Each kernel gets a fresh private directory holding its connection file and its ipc sockets, so
no TCP port is opened; its stderr goes to an unlinked temporary file that the host reads through
its own descriptor, so nothing is re-read by path from a directory the kernel can write.
Shutting the kernel down removes the directory.

At ``isolation="process"`` and ``"bwrap"`` the kernel runs under kernelexec's launcher
(``_sandbox._launcher``) in a cgroup of its own where the host allows, with its limits, as its
own user on a root host (who then owns the directory), and under ``"bwrap"`` inside bubblewrap.

At ``"none"`` and ``"process"`` kernels are forked from a fork server (``_forkserver``) of their
interpreter when one can run, which saves the interpreter's start-up and imports; under
``"bwrap"`` (a new process in new namespaces) and whenever the server cannot start, the kernel is
launched the plain way, a fresh interpreter per kernel.

This module controls the process; its messages go through ``_wire`` (framing, signatures,
the receive queue), and what its confinement needs comes from the sandbox plan's ``prepare``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import IO, Any, ClassVar, Literal

import psutil
import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from kernelexec import _proctitle
from kernelexec._exceptions import ConfigError, KernelStartError
from kernelexec._models import Isolation, IsolationLevel
from kernelexec._sandbox import _cgroups, _disk, _lend, _nshelper, _uids, _users
from kernelexec._sandbox._plan import NO_SANDBOX, KernelSetup, SandboxPlan, make_plan
from kernelexec._tempdirs import make_owned_dir, remove_tree
from kernelexec.backends import _hostlimits, _wire
from kernelexec.backends._base import (
    KernelBackend,
    KernelConnection,
    KernelDied,
    KernelLaunch,
    KernelMessage,
)
from kernelexec.backends._forkserver import ForkedProcess
from kernelexec.backends._forkservers import (
    FORKED_LEVELS,
    ForkServers,
    enabled,
    stop_forked,
)
from kernelexec.backends._stderr import stderr_tail
from kernelexec.backends._wire import KernelWire

# Flags that trim start-up: no history database (nothing written under ~/.ipython), and the
# 0.5 ms sleep ipykernel inserts before every reply turned off.
_KERNEL_FLAGS = (
    "--HistoryManager.enabled=False",
    "--IPythonKernel._execute_sleep=0",
    "--Application.log_level=WARN",
)


# ipykernel_launcher, minus ipykernel's debugger: importing debugpy is about 110 ms of a 0.3 s
# kernel start (python -X importtime), and kernelexec does not speak the debug protocol. The
# block is lifted once ipykernel is up (kernel side ``install``), so tools may import debugpy.
_LEAN_LAUNCHER = (
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
    return f"{_proctitle.SOURCE}kx_set_title({title!r}, {comm!r})\n{_LEAN_LAUNCHER}"


log = logging.getLogger("kernelexec")
_cgroups_swept = False


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


class LocalBackend(KernelBackend):
    """Starts ipykernel processes on this machine.

    Args:
        python: The interpreter that runs kernels when the launch names none; it must have
            ipykernel installed. Defaults to the interpreter running kernelexec.
        extra_args: Extra command-line arguments for ipykernel.
        fork_server: Fork new kernels at isolation ``"none"`` and ``"process"`` from a fork
            server of their interpreter (``_forkserver``); False, or ``KERNELEXEC_NO_FORK_SERVER=1``
            in the environment, launches every kernel the plain way.

    Raises:
        ConfigError: ``fork_server`` is not a bool.
    """

    name = "local"
    host_filesystem = True
    default_isolation: ClassVar[IsolationLevel] = "process"

    def __init__(
        self,
        python: str | None = None,
        extra_args: tuple[str, ...] = (),
        fork_server: bool = True,
    ) -> None:
        self.python = python or sys.executable
        self.extra_args = tuple(extra_args)
        if not isinstance(fork_server, bool):
            raise ConfigError(f"fork_server must be True or False, not {fork_server!r}")
        self.fork_server = enabled(fork_server)
        self._plans: dict[tuple[Any, ...], SandboxPlan] = {}
        self.forks = ForkServers()
        self._budgets: dict[float, _cgroups.BudgetGroup] = {}
        self._reserved: list[int] = []  # max_kernels of each executor holding the backend

    def hold(self) -> None:
        self.forks.hold()
        _nshelper.hold()

    def reserve(self, kernels: int) -> None:
        total = _hostlimits.reserve(kernels)
        self._reserved.append(kernels)
        _wire.reserve_sockets(total)

    async def release(self) -> None:
        self.forks.release()
        await asyncio.to_thread(_nshelper.let_go)
        _remove_left_dirs()
        if self._reserved:
            _hostlimits.unreserve(self._reserved.pop())

    def launch_kind(self, launch: KernelLaunch) -> str:
        """How kernels of ``launch`` are started: ``"fork server"`` or ``"plain"``."""
        if self.fork_server and launch.isolation in FORKED_LEVELS:
            return "fork server"
        return "plain"

    def describe(self) -> str:
        return f"local:{self.python}"

    def plan(self, launch: KernelLaunch) -> SandboxPlan:
        """How kernels of ``launch`` are confined on this host (decided once per launch).

        Raises:
            ConfigError: the level, a limit or the network setting cannot be enforced here.
        """
        python = launch.interpreter or self.python
        limits = tuple(sorted(launch.limits.items()))
        key = (launch.isolation, limits, launch.network, python, launch.workdir)
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(
                launch.isolation, dict(launch.limits), launch.network, python, launch.workdir
            )
            self._plans[key] = plan
        return plan

    def check(self, launch: KernelLaunch) -> None:
        # Interpreters (venvs), isolation levels, limits and the network are this backend's.
        if launch.kernel_name is not None:
            raise ConfigError(f"the {self.name!r} backend does not support kernel_name")
        self.plan(launch)

    def isolation(self, launch: KernelLaunch) -> Isolation:
        plan = self.plan(launch)
        launched = (
            "forked from a fork server of the interpreter (a plain launch when none can start)"
            if self.launch_kind(launch) == "fork server"
            else "a new interpreter per kernel (plain launch)"
        )
        bounds = {**plan.boundaries, "launch": launched}
        return Isolation(level=plan.level, limits=plan.limits_text, boundaries=bounds)

    def fingerprint(self, launch: KernelLaunch, base: str) -> str:
        # A local kernel at the default level is exactly its environment (whose fingerprint
        # names the interpreter), so results keep the environment's fingerprint; another level,
        # explicit limits or a network setting give another one.
        default = KernelLaunch(
            env=launch.env,
            interpreter=launch.interpreter,
            workdir=launch.workdir,
            isolation=self.default_isolation,
        )
        if launch == default and self.python == sys.executable:
            return base
        return super().fingerprint(launch, base)

    async def start(self, launch: KernelLaunch, *, timeout: float) -> KernelConnection:
        global _cgroups_swept
        self.check(launch)
        python = launch.interpreter or self.python
        plan = self.plan(launch)
        if plan.use_cgroup and not _cgroups_swept:
            _cgroups_swept = True
            _cgroups.sweep_stale()  # groups that killed hosts left (their processes are gone)
        budget = None
        if plan.budget_mb:
            budget = self._budgets.setdefault(plan.budget_mb, _cgroups.BudgetGroup(plan.budget_mb))
        conn = LocalConnection(
            python,
            self.extra_args,
            launch.env,
            plan,
            launch.workdir,
            forks=self.forks if self.launch_kind(launch) == "fork server" else None,
            budget=budget,
        )
        try:
            await asyncio.wait_for(conn.launch(), timeout)
        except asyncio.TimeoutError:
            detail = conn.diagnostics()
            await asyncio.shield(conn.shutdown())
            raise KernelStartError(f"kernel did not start within {timeout:g} s{detail}") from None
        except (OSError, zmq.ZMQError) as exc:
            # Out of descriptors or processes, say: a start that failed, not a crash.
            await asyncio.shield(conn.shutdown())
            raise KernelStartError(f"could not start a kernel: {exc}") from exc
        except BaseException:
            await asyncio.shield(conn.shutdown())
            raise
        return conn


@dataclass(frozen=True)
class KernelTenant:
    """What a fork of a local kernel shares with it (read by ``kernelexec._branching``): how
    it was launched, its confinement, and the user it runs as."""

    python: str
    extra_args: tuple[str, ...]
    env: dict[str, str]
    plan: SandboxPlan | None
    workdir: str | None
    uid: int | None
    kdir: str
    budget: _cgroups.BudgetGroup | None = None


class LocalConnection(KernelConnection):
    """A kernel process on this machine with its zmq channels (ipc sockets in a private dir)."""

    def __init__(
        self,
        python: str,
        extra_args: tuple[str, ...],
        env: dict[str, str],
        plan: SandboxPlan | None = None,
        workdir: str | None = None,
        forks: ForkServers | None = None,
        budget: _cgroups.BudgetGroup | None = None,
    ) -> None:
        self._python = python
        self._budget = budget
        self._in_budget = False
        self._owns_uid = False  # a branch runs as its family's uid: the first kernel's
        self._forks = forks
        self._forked: ForkedProcess | None = None
        self.launched_by = ""
        """How the current kernel was started: ``"fork server"`` or ``"plain"``."""
        self._extra_args = extra_args
        self._env = dict(env)
        self._sandbox = plan or NO_SANDBOX
        self._workdir = workdir
        self._dir = ""
        self._uid: int | None = None
        self._entered: set[str] = set()  # working directories handed to the kernel's user
        self._restarting = False
        self._kept_capped: set[str] = set()  # capped across a restart, uncapped at the end
        self._kernel_pid_seen: int | None = None  # this launch's kernel, once found (ended)
        self._cgroup: _cgroups.KernelCgroup | None = None
        self._km: AsyncKernelManager | None = None
        self._wire = KernelWire()
        self._stderr: IO[bytes] | None = None
        self._died: KernelDied | None = None

    @property
    def _plan(self) -> SandboxPlan | None:
        """The kernel's confinement; None at ``"none"`` (no launcher)."""
        return self._sandbox if self._sandbox.confined else None

    @property
    def dropped(self) -> int:
        """Messages dropped for a bad signature, a replay or garbage (since the start)."""
        return self._wire.dropped

    async def launch(self) -> None:
        """Start the process in a fresh private directory and connect its channels."""
        _check_socket_room()
        self._dir = kdir = make_owned_dir("kx-")
        plan = self._sandbox
        if plan.own_user:
            self._uid = await asyncio.to_thread(_uids.allocate)
            self._owns_uid = True
            _users.hand_over(kdir, self._uid)
            await self._cap(kdir, home=True)  # before the kernel's namespace: it sees the mount
            if self._workdir:
                _users.allow_search(self._workdir)
        if plan.use_cgroup:
            self._new_cgroup(plan, "kernel")
        procs = self._cgroup.procs_files if self._cgroup else []
        setup = plan.prepare(
            self._python, self._env, kdir, self._workdir, uid=self._uid, procs=procs
        )
        kernel_args = ["-f", "{connection_file}", *_KERNEL_FLAGS, *self._extra_args]
        if await self._fork(setup, kernel_args, kdir):
            return await self._connect()
        kernel = [self._python, "-c", lean_launcher(setup.title), *kernel_args]
        spec = KernelSpec(
            argv=setup.argv(kernel, os.getpid()),
            display_name="kernelexec",
            language="python",
            interrupt_mode=setup.interrupt_mode,
            metadata={},
            env={},
        )
        km = self._manager(kdir, spec)
        self._km = km
        # Kernel stdout gets fd-level output that ipykernel also forwards as messages; it must
        # never be a pipe nobody drains. stderr is kept (bounded by the kernel's lifetime) so a
        # failed start can be explained.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            await km.start_kernel(
                env=setup.env, cwd=kdir, stdout=subprocess.DEVNULL, stderr=self._stderr
            )
        except Exception as exc:
            raise KernelStartError(f"could not launch {self._python}: {exc}") from exc
        self.launched_by = "plain"
        await self._connect()

    def _manager(self, kdir: str, spec: KernelSpec | None = None) -> _Manager:
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
        km.kernel_uid = self._uid
        return km

    async def _fork(self, setup: KernelSetup, kernel_args: list[str], kdir: str) -> bool:
        """Start the kernel from a fork server; False when there is none to use (then the
        caller launches it the plain way)."""
        forks = self._forks
        if forks is None:
            return False
        server = forks.server_for(self._python, setup.env, setup.level)
        if server is None:
            return False
        assert server.pid is not None  # server_for hands out started servers only
        km = self._manager(kdir)
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
        self._km = km
        self._forked = forked
        self.launched_by = "fork server"
        return True

    async def _connect(self) -> None:
        km = self._km
        assert km is not None
        self._wire.open(km)
        self._died = None
        self._kernel_pid_seen = None

    def _new_cgroup(self, plan: SandboxPlan, what: str) -> None:
        """Make the kernel's cgroup (its memory group in the executor's budget).

        Raises:
            KernelStartError: the group could not be made.
        """
        try:
            if self._budget is not None and not self._in_budget:
                self._budget.enter()
                self._in_budget = True
            self._cgroup = _cgroups.KernelCgroup.create(plan.cgroup_limits, self._budget)
        except OSError as exc:
            raise KernelStartError(f"could not set up the {what}'s cgroup: {exc}") from exc

    def diagnostics(self, limit: int = 2000) -> str:
        return stderr_tail(self._stderr, "kernel stderr", limit)

    def tenant(self) -> KernelTenant:
        """How this kernel runs, for a fork of it (see :class:`KernelTenant`)."""
        return KernelTenant(
            self._python,
            self._extra_args,
            dict(self._env),
            self._plan,
            self._workdir,
            self._uid,
            self._dir,
            self._budget,
        )

    def connection_info(self) -> dict[str, Any] | None:
        km = self._km
        if km is None:
            return None
        info = dict(km.get_connection_info(session=False))
        key = info.get("key", b"")
        info["key"] = key.decode() if isinstance(key, bytes) else str(key)
        info["kernel_name"] = ""
        return info

    def _process(self) -> Any:
        """The process the host started for the kernel (a ``Popen``, or the
        :class:`ForkedProcess` a fork server made): the launcher under isolation, else the
        kernel; None once shut down."""
        if self._forked is not None:
            return self._forked
        km = self._km
        return getattr(km.provisioner, "process", None) if km is not None else None

    def kernel_pid(self) -> int | None:
        proc = self._process()
        pid = getattr(proc, "pid", None)
        if pid is None or not self._sandbox.confined:
            return pid
        if self._forked is not None:
            # The launcher's first child is the kernel: orphans it adopts come after it.
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as fh:
                    kids = fh.read().split()
            except OSError:
                return None
            return int(kids[0]) if kids else None
        # Under the launcher (and bubblewrap) the kernel is a process running the lean
        # launcher's code (bubblewrap's command line holds it too).
        try:
            found = [
                p for p in psutil.Process(pid).children(recursive=True) if _is_kernel(p.cmdline())
            ]
        except psutil.Error:
            return None
        # The kernel's own forks (branches: ``kernelexec._branching``) run the same code
        # below it: the kernel is the one whose parent is not such a Python process.
        pids = {p.pid: p for p in found}

        def wrapper(proc: psutil.Process) -> bool:
            return os.path.basename(str(proc.cmdline()[0])) == "bwrap"

        try:
            kernels = [
                p
                for p in found
                if not wrapper(p) and (p.ppid() not in pids or wrapper(pids[p.ppid()]))
            ]
        except (psutil.Error, IndexError):
            return None
        return kernels[0].pid if kernels else None

    async def send(
        self,
        channel: Literal["shell", "control"],
        msg_type: str,
        content: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        buffers: tuple[bytes, ...] = (),
    ) -> str:
        return await self._wire.send(channel, msg_type, content, metadata=metadata, buffers=buffers)

    def limit_messages(self, msg_type: str, max_bytes: int) -> None:
        self._wire.limit(msg_type, max_bytes)

    async def receive(self, timeout: float) -> KernelMessage | KernelDied | None:
        return await self._wire.receive(timeout, self._died, self._check_process)

    def ended(self) -> bool | None:
        if self._died is not None or self._check_process() is not None:
            return True
        if not self._sandbox.confined:
            return False  # the process checked is the kernel itself
        # Under a launcher the kernel may be gone before it: its pid, found once per kernel
        # (a search of the launcher's children when there is no fork server).
        pid = self._kernel_pid_seen
        if pid is None:
            pid = self._kernel_pid_seen = self.kernel_pid()
        if pid is None:
            return None  # not found: cannot tell
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state in (b"Z", b"X")

    def _check_process(self) -> KernelDied | None:
        proc = self._process()
        if proc is None:
            self._died = KernelDied("the kernel is shut down")
            return self._died
        code = proc.poll()
        if code is None:
            return None
        limit = ""
        cgroup, budget = self._cgroup, self._budget
        if cgroup is not None and cgroup.oom_kills():
            # Killed by the OOM killer without ever reaching its own limit: the budget's.
            if budget is not None and not cgroup.reached_own_limit():
                limit = f"memory_budget_mb={budget.budget_mb:g} (the executor's kernels together)"
            else:
                limit = self._sandbox.limit_of("memory_mb")
        self._died = KernelDied(describe_exit(code), self.diagnostics(), limit)
        return self._died

    async def enter_workdir(self, path: str) -> None:
        if self._uid is None:
            return
        os.makedirs(path, exist_ok=True)
        self._entered.add(path)
        capped = await self._cap(path)
        await asyncio.to_thread(_users.hand_over, path, self._uid)
        if capped:
            pid = self.kernel_pid()
            if pid is None:
                raise KernelStartError("the kernel ended before it could enter its directory")
            try:
                await asyncio.to_thread(_disk.show_to, pid, path)
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelStartError(
                    f"could not cap the working directory {path}: {exc}"
                ) from None

    async def lend(self, loan: _lend.Loan, workdir: str) -> None:
        if self._uid is None:
            return
        pid = self.kernel_pid()
        if pid is None or self._check_process() is not None:
            return  # it has ended: its session lends the directory to the kernel replacing it
        try:
            await asyncio.to_thread(_lend.lend, pid, loan, self._uid, workdir)
        except OSError as exc:
            if self._check_process() is not None:
                return
            why = exc.strerror or str(exc)
            raise KernelStartError(f"could not lend {loan.path} to the kernel: {why}") from None

    async def _cap(self, path: str, *, home: bool = False) -> bool:
        """Make ``path`` a tmpfs of ``max_disk_mb`` for this kernel's user where the plan says
        so (:mod:`kernelexec._sandbox._disk`); whether it did."""
        size = self._plan.disk_cap_mb(home=home) if self._plan is not None else 0
        if not size or self._uid is None:
            return False
        try:
            await asyncio.to_thread(_disk.cap, path, size, self._uid)
        except OSError as exc:
            raise KernelStartError(f"could not cap the directory {path}: {exc}") from None
        return True

    async def interrupt(self) -> None:
        km = self._km
        if self._forked is not None:
            # Signal mode, as jupyter-client does it: SIGINT to the kernel's process group
            # (a launcher ignores it).
            self._forked.send_signal(signal.SIGINT)
        elif km is not None and km.has_kernel:
            with contextlib.suppress(Exception):
                await km.interrupt_kernel()

    async def restart(self) -> None:
        # The capped directories stay mounted for the next kernel (it enters them at once):
        # copying a tree to the disk and back costs seconds per ten thousand entries.
        self._restarting = True
        try:
            await self.shutdown()
        finally:
            self._restarting = False
        await self.launch()

    async def shutdown(self) -> None:
        # Every step runs even when one before it failed (a start that failed halfway, a host
        # out of descriptors): a failure is logged, and the directory always goes.
        km, self._km = self._km, None
        try:
            self._wire.close()
        except Exception as exc:
            log.warning("closing a kernel's channels failed: %r", exc)
        self._died = KernelDied("the kernel is shut down")
        try:
            await self._stop_processes(km)
        except Exception as exc:
            log.warning("stopping a kernel failed: %r", exc)
        finally:
            await self._release(km)

    async def _stop_processes(self, km: AsyncKernelManager | None) -> None:
        forked, self._forked = self._forked, None
        if forked is not None:
            try:
                await stop_forked(forked, launcher=self._sandbox.confined)
            finally:
                if self._forks is not None:
                    self._forks.kernel_ended(forked.server)
        if km is not None:
            await self._stop_launcher(km)

    async def _release(self, km: AsyncKernelManager | None) -> None:
        """What the kernel held on this host: its cgroup (its last processes killed), the
        directories handed to its user, the process record, its stderr and directory."""
        if self._cgroup is not None:
            cgroup, self._cgroup = self._cgroup, None
            try:
                await asyncio.to_thread(cgroup.remove)
            except Exception as exc:
                log.warning("removing a kernel's cgroup failed: %r", exc)
        if self._in_budget and self._budget is not None:
            self._in_budget = False
            try:
                self._budget.leave()
            except Exception as exc:
                log.warning("removing the executor's memory budget group failed: %r", exc)
        uid, self._uid = self._uid, None
        owned, self._owns_uid = self._owns_uid, False
        entered, self._entered = self._entered, set()
        if self._restarting:
            self._kept_capped |= entered
        else:
            for path in self._kept_capped - entered:  # kept for a kernel that never came
                try:
                    await asyncio.to_thread(_disk.uncap, path)
                except Exception as exc:
                    log.warning("copying %s back to the disk failed: %r", path, exc)
            self._kept_capped = set()
        if uid is not None:
            for path in entered:
                try:
                    if not self._restarting:
                        await asyncio.to_thread(_disk.uncap, path)
                except Exception as exc:
                    log.warning("copying %s back to the disk failed: %r", path, exc)
                try:
                    await asyncio.to_thread(_users.hand_back, path, uid)
                except Exception as exc:
                    log.warning("handing %s back failed: %r", path, exc)
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
        if self._dir:
            _remove_dir(self._dir)
            self._dir = ""
        if uid is not None and owned:
            # Only now: the uid's processes are gone and its files handed back or removed.
            shared = not self._sandbox.scratch_mb
            try:
                await asyncio.to_thread(_uids.release, uid, shared)
            except Exception as exc:
                log.warning("releasing uid %d failed: %r", uid, exc)
        _remove_left_dirs()

    async def _stop_launcher(self, km: AsyncKernelManager) -> None:
        """Have the launcher kill the kernel and every descendant, and wait until it has."""
        proc = getattr(km.provisioner, "process", None)
        if not self._sandbox.confined or proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()


async def _kill_process_group(km: AsyncKernelManager) -> None:
    proc = getattr(km.provisioner, "process", None)
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


_LEFT_DIRS: set[str] = set()
"""Kernel directories that could not be removed (the host was out of descriptors): tried again
at every later shutdown and when the backend is released."""


def _remove_dir(path: str) -> None:
    remove_tree(path)
    if os.path.lexists(path):
        _LEFT_DIRS.add(path)


def _remove_left_dirs() -> None:
    for path in list(_LEFT_DIRS):
        remove_tree(path)
        if not os.path.lexists(path):
            _LEFT_DIRS.discard(path)


def _is_kernel(cmdline: list[str]) -> bool:
    """Whether a process is a plain-launched kernel: titled one, or still running the lean
    launcher's code (the moment before it titles itself)."""
    return " ".join(cmdline).startswith(_proctitle.KERNEL) or any(
        "from ipykernel import kernelapp" in arg for arg in cmdline
    )


# An ipc socket's path must fit in sun_path: 108 bytes with the terminating NUL. Ours are
# <tempdir>/kx-XXXXXXXX/s-<n>: jupyter-client numbers a kernel's ipc sockets 1 to 5.
_SUN_PATH_MAX = 107
_SOCKET_SUFFIX = "kx-XXXXXXXX/s-5"


def _check_socket_room() -> None:
    """Refuse, with the fix, a temp directory too long to hold a kernel's ipc sockets (zmq
    would fail deep in jupyter-client with "File name too long")."""
    root = tempfile.gettempdir()
    needed = len(os.fsencode(os.path.join(root, _SOCKET_SUFFIX)))
    if needed > _SUN_PATH_MAX:
        raise KernelStartError(
            f"the temp directory {root!r} is too long for a kernel's ipc sockets: their paths "
            f"would be {needed} bytes, and a Unix socket path may have at most {_SUN_PATH_MAX}. "
            "Point TMPDIR at a shorter directory (for example TMPDIR=/tmp)."
        )
