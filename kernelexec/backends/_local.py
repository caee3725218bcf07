"""The local backend: ipykernel processes on this machine, driven by jupyter-client.

At ``isolation="process"`` and ``"bwrap"`` the kernel runs under kernelexec's launcher
(``_sandbox._launcher``) in a cgroup of its own where the host allows, with its limits, as its
own user on a root host (who then owns its directory), and under ``"bwrap"`` inside bubblewrap.

At ``"none"`` and ``"process"`` kernels are forked from a fork server (``_forkserver``) of their
interpreter when one can run, which saves the interpreter's start-up and imports; under
``"bwrap"`` (a new process in new namespaces) and whenever the server cannot start, the kernel is
launched the plain way, a fresh interpreter per kernel.

This module decides how kernels of a launch are confined (the sandbox plan, once per launch) and
started; each kernel is a :class:`~kernelexec.backends._local_connection.LocalConnection`, whose
process is ``_local_process``'s, whose confinement steps are the sandbox's ``Confinement``'s, and
whose kernels can be forked (the backend interface's optional ``KernelFamily``).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, ClassVar

import zmq

from kernelexec._exceptions import ConfigError, KernelStartError
from kernelexec._models import Isolation, IsolationLevel
from kernelexec._sandbox import _cgroups, _nshelper
from kernelexec._sandbox._plan import SandboxPlan, make_plan
from kernelexec.backends import _hostlimits, _local_dirs, _wire
from kernelexec.backends._base import KernelBackend, KernelConnection, KernelLaunch
from kernelexec.backends._forkservers import FORKED_LEVELS, ForkServers, enabled
from kernelexec.backends._local_connection import LocalConnection

__all__ = ["LocalBackend", "LocalConnection"]


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
        _local_dirs.remove_left()
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
        self.check(launch)
        python = launch.interpreter or self.python
        plan = self.plan(launch)
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
