"""``LocalConnection``: a kernel process on this machine with its zmq channels, and
``LocalFamily``, how its kernel is forked (the backend interface's optional branching
capability).

Each kernel gets a fresh private directory holding its connection file and its ipc sockets
(``_local_dirs``), so no TCP port is opened; its stderr goes to an unlinked temporary file that
the host reads through its own descriptor. The process is started and stopped by
``_local_process``, its confinement's steps are the sandbox's :class:`Confinement`'s, and its
messages go through ``_wire`` (framing, signatures, the receive queue). A connection runs one
kernel after another: a restart shuts the kernel down and launches a fresh one the plain way
(or from the fork server), whatever the first one was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

from kernelexec._sandbox._cgroups import BudgetGroup
from kernelexec._sandbox._confinement import Confinement
from kernelexec._sandbox._lend import Loan
from kernelexec._sandbox._plan import NO_SANDBOX, SandboxPlan
from kernelexec._sandbox._users import hand_over
from kernelexec.backends import _local_dirs
from kernelexec.backends._base import (
    KernelConnection,
    KernelDied,
    KernelFamily,
    KernelMessage,
    KernelTemplate,
)
from kernelexec.backends._forkservers import ForkServers
from kernelexec.backends._local_process import (
    KERNEL_FLAGS,
    KernelProcess,
    describe_exit,
)
from kernelexec.backends._wire import KernelWire

log = logging.getLogger("kernelexec")


@dataclass(frozen=True)
class LocalFamily(KernelFamily):
    """How a local kernel runs, for forks of it: how it was launched, its confinement, and
    the user it runs as (a family's processes all run as its first kernel's)."""

    python: str
    extra_args: tuple[str, ...]
    env: dict[str, str]
    plan: SandboxPlan
    workdir: str | None
    uid: int | None
    directory: str
    budget: BudgetGroup | None = None
    own_dir: str = ""
    """The private directory of the kernel this was taken from (its channels, sealed)."""
    forks_outlive: bool = True
    """Not at a launcher's own kernel (isolation ``"process"``: the launcher kills every
    descendant when its kernel ends); a branch's launcher is its family's first kernel's."""

    def hand_over(self, path: str) -> None:
        if self.uid is not None:
            hand_over(path, self.uid)

    def seal(self) -> None:
        _local_dirs.seal(self.own_dir or self.directory, self.uid)

    async def branch(self, template: KernelTemplate, origin: str) -> KernelConnection:
        conn = LocalConnection(
            self.python,
            self.extra_args,
            self.env,
            self.plan,
            self.workdir,
            budget=self.budget,
            template=(template, origin, self),
        )
        try:
            await conn.launch()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(conn.shutdown())
            raise
        return conn


class LocalConnection(KernelConnection):
    """A kernel process on this machine with its zmq channels (ipc sockets in a private dir).

    Args:
        template: Fork the first kernel from this template of ``family`` (a branch, for
            ``origin``), rather than launching it.
    """

    def __init__(
        self,
        python: str,
        extra_args: tuple[str, ...],
        env: dict[str, str],
        plan: SandboxPlan | None = None,
        workdir: str | None = None,
        forks: ForkServers | None = None,
        budget: BudgetGroup | None = None,
        template: tuple[KernelTemplate, str, LocalFamily] | None = None,
    ) -> None:
        self._python = python
        self._forks = forks
        self._extra_args = extra_args
        self._env = dict(env)
        self._sandbox = plan or NO_SANDBOX
        self._confinement = Confinement(self._sandbox, budget)
        self._workdir = workdir
        self._template = template
        self._family: LocalFamily | None = None  # a branch's: its family's first kernel's
        self._dir = ""
        self._restarting = False
        self._kernel_pid_seen: int | None = None  # this launch's kernel, once found (ended)
        self._process = KernelProcess(confined=self._sandbox.confined, forks=forks)
        self._wire = KernelWire()
        self._died: KernelDied | None = None

    @property
    def launched_by(self) -> str:
        """How the current kernel was started: ``"plain"``, ``"fork server"`` or
        ``"branch"``."""
        return self._process.launched_by

    @property
    def fork_s(self) -> float:
        """How long the template's ``fork()`` of this branch took (seconds; 0 otherwise)."""
        return self._process.fork_s

    @property
    def dropped(self) -> int:
        """Messages dropped for a bad signature, a replay or garbage (since the start)."""
        return self._wire.dropped

    async def launch(self) -> None:
        """Start the process in a fresh private directory and connect its channels."""
        self._process = KernelProcess(confined=self._sandbox.confined, forks=self._forks)
        template, self._template = self._template, None
        if template is not None:
            await self._branch(*template)
            return await self._connect()
        self._family = None
        self._dir = kdir = _local_dirs.make()
        setup = await self._confinement.begin(kdir, self._python, self._env, self._workdir)
        kernel_args = ["-f", "{connection_file}", *KERNEL_FLAGS, *self._extra_args]
        owner = self._confinement.uid
        if not await self._process.start_forked(self._python, setup, kernel_args, kdir, owner):
            await self._process.start_plain(self._python, setup, kernel_args, kdir, owner)
        await self._connect()

    async def _branch(self, template: KernelTemplate, origin: str, family: LocalFamily) -> None:
        """Fork the kernel from ``template``, in the family's first kernel's directory (a
        branch lives in that kernel's mount namespace)."""
        self._family = family
        self._dir = kdir = tempfile.mkdtemp(prefix="b", dir=family.directory)
        env = self._confinement.begin_branch(kdir, family.uid)
        req = {"origin": origin, "threads": template.threads}
        pid = await self._process.start_branch(template, req, kdir, env)
        self._confinement.join(pid)
        self._process.adopt_branch(pid, template)

    async def _connect(self) -> None:
        km = self._process.km
        assert km is not None
        self._wire.open(km)
        self._died = None
        self._kernel_pid_seen = None

    def diagnostics(self, limit: int = 2000) -> str:
        return self._process.diagnostics(limit)

    def family(self) -> LocalFamily:
        """How this kernel runs, for a fork of it (see :class:`LocalFamily`)."""
        if self._family is not None and self.launched_by == "branch":
            return dataclasses.replace(self._family, own_dir=self._dir, forks_outlive=True)
        return LocalFamily(
            self._python,
            self._extra_args,
            dict(self._env),
            self._sandbox,
            self._workdir,
            self._confinement.uid,
            self._dir,
            self._confinement.budget,
            self._dir,
            forks_outlive=not self._sandbox.confined,
        )

    def connection_info(self) -> dict[str, Any] | None:
        km = self._process.km
        if km is None:
            return None
        info = dict(km.get_connection_info(session=False))
        key = info.get("key", b"")
        info["key"] = key.decode() if isinstance(key, bytes) else str(key)
        info["kernel_name"] = ""
        return info

    def kernel_pid(self) -> int | None:
        return self._process.kernel_pid()

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
        proc = self._process.process()
        if proc is None:
            self._died = KernelDied("the kernel is shut down")
            return self._died
        code = proc.poll()
        if code is None:
            return None
        limit = self._confinement.killed_for()
        self._died = KernelDied(describe_exit(code), self.diagnostics(), limit)
        return self._died

    async def enter_workdir(self, path: str) -> None:
        await self._confinement.enter(path, self.kernel_pid)

    async def lend(self, loan: Loan, workdir: str) -> None:
        await self._confinement.lend(
            loan, workdir, self.kernel_pid, lambda: self._check_process() is not None
        )

    async def interrupt(self) -> None:
        await self._process.interrupt()

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
        try:
            self._wire.close()
        except Exception as exc:
            log.warning("closing a kernel's channels failed: %r", exc)
        self._died = KernelDied("the kernel is shut down")
        try:
            await self._process.stop()
        except Exception as exc:
            log.warning("stopping a kernel failed: %r", exc)
        finally:
            await self._release()

    async def _release(self) -> None:
        """What the kernel held on this host: its confinement (cgroup, directories handed to
        its user), the process record, its stderr and directory, then its user."""
        await self._confinement.end(restarting=self._restarting)
        await self._process.close()
        if self._dir:
            _local_dirs.remove(self._dir)
            self._dir = ""
        # Only now: the uid's processes are gone and its files handed back or removed.
        await self._confinement.end_user()
        _local_dirs.remove_left()
