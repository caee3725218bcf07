"""``BranchConnection``: a local kernel that is a fork of a template, with its own private
directory, connection file and key, stderr, and (at ``"process"``) its own cgroup with its
parent's limits, running as its parent's user.

Once shut down it is an ordinary :class:`~kernelexec.backends._local.LocalConnection`: a
restart (the session's kernel died or was reset) launches a fresh kernel the plain way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile

from kernelexec._branching._process import BranchProcess, Template
from kernelexec._exceptions import BranchError
from kernelexec._sandbox import _users
from kernelexec.backends._local import KernelTenant, LocalConnection


class BranchConnection(LocalConnection):
    """A kernel forked from ``template``; :meth:`launch` forks it (once).

    Args:
        tenant: How the kernel the template was made from runs.
        template: The frozen copy to fork.
        origin: The agent id of the session it branches from (for the threads warning).
    """

    def __init__(self, tenant: KernelTenant, template: Template, origin: str) -> None:
        super().__init__(
            tenant.python,
            tenant.extra_args,
            tenant.env,
            tenant.plan,
            tenant.workdir,
            forks=None,
            budget=tenant.budget,
        )
        self._tenant = tenant
        self._template: Template | None = template
        self._origin = origin
        self.fork_s = 0.0
        """How long the template's ``fork()`` of this kernel took (seconds)."""

    @property
    def kdir(self) -> str:
        """The branch's own private directory (its sockets and connection file)."""
        return self._dir

    def tenant(self) -> KernelTenant:
        if self.launched_by == "branch":
            return self._tenant  # a family's processes all nest in its first kernel's dir
        return super().tenant()

    def kernel_pid(self) -> int | None:
        if self.launched_by == "branch" and self._forked is not None:
            return self._forked.pid  # the kernel itself: a branch has no launcher
        return super().kernel_pid()

    async def launch(self) -> None:
        template, self._template = self._template, None
        if template is None:
            await super().launch()  # a restart: a fresh kernel, not a branch
            return
        # In the family's first kernel's directory (see the snapshot's): a branch lives in
        # that kernel's mount namespace.
        self._dir = kdir = tempfile.mkdtemp(prefix="b", dir=self._tenant.kdir)
        uid = self._tenant.uid
        if uid is not None:
            _users.hand_over(kdir, uid)  # the kernel binds its sockets here
        km = self._manager(kdir)  # root-owned connection file: the key stays the host's
        km.write_connection_file()
        self._km = km
        self._uid = uid
        plan = self._plan
        env = {}
        if plan is not None:
            env = {"HOME": kdir, "IPYTHONDIR": os.path.join(kdir, "ipython")}
            if plan.use_cgroup:
                self._new_cgroup(plan, "branch")
        info = dict(km.get_connection_info(session=False))
        key = info.get("key", b"")
        info["key"] = key.decode() if isinstance(key, bytes) else str(key)
        self._stderr = stderr = tempfile.TemporaryFile()  # noqa: SIM115
        req = {
            "info": info,
            "cwd": kdir,
            "env": env,
            "origin": self._origin,
            "threads": template.threads,
        }
        pid, self.fork_s = await asyncio.to_thread(template.fork, req, stderr.fileno())
        if self._cgroup is not None:
            _join(self._cgroup.procs_files, pid)
        try:
            self._forked = BranchProcess(pid, template)
        except ProcessLookupError:
            raise BranchError(f"the branch kernel exited at once{self.diagnostics()}") from None
        self.launched_by = "branch"
        await self._connect()


def _join(procs_files: list[str], pid: int) -> None:
    """Move ``pid`` into the cgroups whose ``cgroup.procs`` files are given (it may be gone)."""
    for procs in procs_files:
        with contextlib.suppress(OSError), open(procs, "w") as fh:
            fh.write(str(pid))
