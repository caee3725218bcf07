"""``Confinement``: the confinement steps of one local kernel, in the order the local backend
asks for them (``kernelexec.backends._local``).

Before a launch (:meth:`Confinement.begin`) a kernel at ``"process"`` or ``"bwrap"`` on a root
host gets a user of its own (who then owns its private directory, capped where the plan says),
a cgroup where the host allows (its memory group in the executor's budget), and what the
launcher takes from the plan (:meth:`SandboxPlan.prepare`). A branch (a fork of a kernel) runs as
its family's user (:meth:`Confinement.begin_branch`). While it runs, the session's working
directories are handed to it (:meth:`Confinement.enter`) and host directories lent to it
(:meth:`Confinement.lend`). When it ends (:meth:`Confinement.end`, then
:meth:`Confinement.end_user` once its processes and files are gone) its cgroup goes, its capped
directories are copied back to the disk (kept mounted across a restart: the next kernel enters
them at once) and what its user owns there is handed back to the host.

A working directory is given back only by the kernel that holds it: the last one to have entered
it. A kernel kept for its branches and shut down later (a closed snapshot's) has handed it on to
its session's next kernel, and leaves it alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from collections.abc import Callable

from kernelexec._exceptions import KernelStartError
from kernelexec._sandbox import _cgroups, _disk, _lend, _uids, _users
from kernelexec._sandbox._plan import KernelSetup, SandboxPlan

log = logging.getLogger("kernelexec")

_HOLDERS: dict[str, Confinement] = {}
"""Each working directory entered by a kernel of this process: the confinement of the kernel
that entered it last (the one that gives it back)."""
_cgroups_swept = False


class Confinement:
    """One kernel's confinement on this host: its user, cgroup, capped and handed-over
    directories (module docstring). One per local connection, for each kernel it runs in turn.

    Args:
        plan: How kernels of its launch are confined.
        budget: The executor's memory budget group, when it has one.
    """

    def __init__(self, plan: SandboxPlan, budget: _cgroups.BudgetGroup | None = None) -> None:
        self.plan = plan
        self.budget = budget
        self.uid: int | None = None
        """The user the kernel runs as; None when it runs as the host's."""
        self.cgroup: _cgroups.KernelCgroup | None = None
        self._owns_uid = False  # a branch runs as its family's uid: the first kernel's
        self._in_budget = False
        self._entered: set[str] = set()  # working directories handed to the kernel's user
        self._kept_capped: set[str] = set()  # capped across a restart, uncapped at the end

    @property
    def confined(self) -> bool:
        """Whether the kernel runs under kernelexec's launcher (any level but ``"none"``)."""
        return self.plan.confined

    async def begin(
        self, kdir: str, python: str, env: dict[str, str], workdir: str | None
    ) -> KernelSetup:
        """Confine a kernel about to be launched in its fresh private directory ``kdir``; what
        its launch takes from the plan.

        Raises:
            KernelStartError: a step could not be taken (the message says which).
        """
        plan = self.plan
        if plan.own_user:
            self.uid = await asyncio.to_thread(_uids.allocate)
            self._owns_uid = True
            _users.hand_over(kdir, self.uid)
            await self._cap(kdir, home=True)  # before the kernel's namespace: it sees the mount
            if workdir:
                _users.allow_search(workdir)
        if plan.use_cgroup:
            self._new_cgroup("kernel")
        procs = self.cgroup.procs_files if self.cgroup else []
        return plan.prepare(python, env, kdir, workdir, uid=self.uid, procs=procs)

    def begin_branch(self, kdir: str, uid: int | None) -> dict[str, str]:
        """Confine a branch about to be forked into its private directory ``kdir``, as its
        family's user ``uid``; the environment it adds.

        Raises:
            KernelStartError: its cgroup could not be made.
        """
        self.uid = uid
        if uid is not None:
            _users.hand_over(kdir, uid)  # the kernel binds its sockets here
        if not self.plan.confined:
            return {}
        if self.plan.use_cgroup:
            self._new_cgroup("branch")
        return {"HOME": kdir, "IPYTHONDIR": os.path.join(kdir, "ipython")}

    def join(self, pid: int) -> None:
        """Move the forked branch ``pid`` into its cgroup (it may be gone already)."""
        if self.cgroup is None:
            return
        for procs in self.cgroup.procs_files:
            try:
                with open(procs, "w") as fh:
                    fh.write(str(pid))
            except OSError:
                pass

    def killed_for(self) -> str:
        """The limit an ended kernel was killed for (``"memory_mb=256"``), or ``""``."""
        cgroup, budget = self.cgroup, self.budget
        if cgroup is None or not cgroup.oom_kills():
            return ""
        # Killed by the OOM killer without ever reaching its own limit: the budget's.
        if budget is not None and not cgroup.reached_own_limit():
            return f"memory_budget_mb={budget.budget_mb:g} (the executor's kernels together)"
        return self.plan.limit_of("memory_mb")

    async def enter(self, path: str, kernel_pid: Callable[[], int | None]) -> None:
        """Hand the working directory ``path`` to the kernel's user, capped where the plan
        says so (shown to the kernel, whose pid ``kernel_pid`` finds, in its namespace).

        Raises:
            KernelStartError: it could not be capped or shown to the kernel.
        """
        if self.uid is None:
            return
        os.makedirs(path, exist_ok=True)
        self._entered.add(path)
        _HOLDERS[_key(path)] = self
        capped = await self._cap(path)
        await asyncio.to_thread(_users.hand_over, path, self.uid)
        if capped:
            pid = kernel_pid()
            if pid is None:
                raise KernelStartError("the kernel ended before it could enter its directory")
            try:
                await asyncio.to_thread(_disk.show_to, pid, path)
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelStartError(
                    f"could not cap the working directory {path}: {exc}"
                ) from None

    async def lend(
        self,
        loan: _lend.Loan,
        workdir: str,
        kernel_pid: Callable[[], int | None],
        ended: Callable[[], bool],
    ) -> None:
        """Show the directory of ``loan`` to the kernel (whose pid ``kernel_pid`` finds;
        nothing once it has ``ended``: its session lends the directory to the kernel replacing
        it).

        Raises:
            KernelStartError: it could not be shown to a kernel that still runs.
        """
        if self.uid is None:
            return
        pid = kernel_pid()
        if pid is None or ended():
            return
        try:
            await asyncio.to_thread(_lend.lend, pid, loan, self.uid, workdir)
        except OSError as exc:
            if ended():
                return
            why = exc.strerror or str(exc)
            raise KernelStartError(f"could not lend {loan.path} to the kernel: {why}") from None

    async def end(self, *, restarting: bool = False) -> None:
        """The kernel has stopped: remove its cgroup (its last processes killed), leave the
        budget, and give back the working directories it holds (copied back to the disk; kept
        capped when ``restarting``). Every step runs even when one before it failed (each
        failure is logged)."""
        if self.cgroup is not None:
            cgroup, self.cgroup = self.cgroup, None
            try:
                await asyncio.to_thread(cgroup.remove)
            except Exception as exc:
                log.warning("removing a kernel's cgroup failed: %r", exc)
        if self._in_budget and self.budget is not None:
            self._in_budget = False
            try:
                self.budget.leave()
            except Exception as exc:
                log.warning("removing the executor's memory budget group failed: %r", exc)
        entered, self._entered = {p for p in self._entered if self._holds(p)}, set()
        if restarting:
            self._kept_capped |= entered
        else:
            for path in self._kept_capped - entered:  # kept for a kernel that never came
                if self._holds(path):
                    await _uncap(path)
            for path in self._kept_capped | entered:
                self._let_go(path)
            self._kept_capped = set()
        if self.uid is None:
            return
        for path in entered:
            if not restarting:
                await _uncap(path)
            try:
                await asyncio.to_thread(_users.hand_back, path, self.uid)
            except Exception as exc:
                log.warning("handing %s back failed: %r", path, exc)

    async def end_user(self) -> None:
        """Release the kernel's own user, once its processes are gone and its files handed
        back or removed (a branch's, its family's, is left to the family's first kernel)."""
        uid, self.uid = self.uid, None
        owned, self._owns_uid = self._owns_uid, False
        if uid is None or not owned:
            return
        shared = not self.plan.scratch_mb
        try:
            await asyncio.to_thread(_uids.release, uid, shared)
        except Exception as exc:
            log.warning("releasing uid %d failed: %r", uid, exc)

    def _holds(self, path: str) -> bool:
        """Whether this kernel (or none) entered ``path`` last: only then is it its to give
        back."""
        return _HOLDERS.get(_key(path), self) is self

    def _let_go(self, path: str) -> None:
        if _HOLDERS.get(_key(path)) is self:
            del _HOLDERS[_key(path)]

    def _new_cgroup(self, what: str) -> None:
        """Make the kernel's cgroup (its memory group in the executor's budget).

        Raises:
            KernelStartError: the group could not be made.
        """
        global _cgroups_swept
        if not _cgroups_swept:
            _cgroups_swept = True
            _cgroups.sweep_stale()  # groups that killed hosts left (their processes are gone)
        try:
            if self.budget is not None and not self._in_budget:
                self.budget.enter()
                self._in_budget = True
            self.cgroup = _cgroups.KernelCgroup.create(self.plan.cgroup_limits, self.budget)
        except OSError as exc:
            raise KernelStartError(f"could not set up the {what}'s cgroup: {exc}") from exc

    async def _cap(self, path: str, *, home: bool = False) -> bool:
        """Make ``path`` a tmpfs of ``max_disk_mb`` for the kernel's user where the plan says
        so (:mod:`kernelexec._sandbox._disk`); whether it did."""
        size = self.plan.disk_cap_mb(home=home) if self.plan.confined else 0
        if not size or self.uid is None:
            return False
        try:
            await asyncio.to_thread(_disk.cap, path, size, self.uid)
        except OSError as exc:
            raise KernelStartError(f"could not cap the directory {path}: {exc}") from None
        return True


async def _uncap(path: str) -> None:
    try:
        await asyncio.to_thread(_disk.uncap, path)
    except Exception as exc:
        log.warning("copying %s back to the disk failed: %r", path, exc)


def _key(path: str) -> str:
    return os.path.realpath(path)
