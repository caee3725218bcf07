"""``ExecutorCore``: an executor's kernels: its configuration, backend, one warm pool per
environment, the kernel budget, the background tasks and the lifecycle.

Sessions are not made here: :mod:`kernelexec._assembly` wires the session features (durable
state, branching, code mode, files, the recording) around the kernels this core hands out.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, Protocol

from kernelexec._config import ExecutorConfig
from kernelexec._core._budget import KernelBudget
from kernelexec._core._pool import KernelKeeper, KernelPool
from kernelexec._core._state import Lifecycle
from kernelexec._core._tasks import TaskSupervisor
from kernelexec._envs._builder import EnvBuilder, ProgressCallback
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._exceptions import ConfigError
from kernelexec._models import Isolation
from kernelexec._protocol._host import bootstrap_request
from kernelexec._sandbox import _disk
from kernelexec._sandbox._build import BuildConfinement
from kernelexec._tempdirs import make_owned_dir, remove_tree, sweep_once
from kernelexec._tools._tool import Tool
from kernelexec.backends._base import KernelBackend, KernelLaunch
from kernelexec.backends._registry import get_backend

Env = LocalEnv | VenvEnv


def kernel_env(config: ExecutorConfig) -> dict[str, str]:
    """The exact environment a kernel gets: allowlisted host variables plus ``env_vars``."""
    env = {k: os.environ[k] for k in config.env_allowlist if k in os.environ}
    env.update(config.env_vars)
    return env


class ClosingKeeper(KernelKeeper, Protocol):
    """A pool's keeper of kernels (the brancher), closed once the pools are."""

    async def aclose(self) -> None:
        """Shut down what it keeps."""


class ExecutorCore:
    """The kernels of one executor (module docstring); the public executor and the session
    assembly are built on it.

    Args:
        config: The executor's configuration.
        backend: A backend, or the name of an installed one (``"local"``, the default).
        backend_options: Keyword arguments for a backend given by name.
        on_progress: Called with :class:`~kernelexec.EnvProgress` events while venvs build.
        keeper: Told before a pool shuts a kernel down or replaces it (the brancher keeps a
            kernel with living branches); closed after the pools.

    Raises:
        ConfigError: the backend cannot be had, or cannot run the configured environment.
    """

    def __init__(
        self,
        config: ExecutorConfig,
        *,
        backend: KernelBackend | str | None,
        backend_options: dict[str, Any] | None,
        on_progress: ProgressCallback | None,
        keeper: ClosingKeeper | None = None,
    ) -> None:
        self.config = config
        self.backend = _resolve_backend(backend, backend_options)
        self.workdir: PurePath | None = None
        """The executor's working directory (set by :meth:`start`): the sessions' directories
        lie in it."""
        self.check_env(self.config.env)
        self.builder = EnvBuilder(
            self.config.cache_dir, self.config.installer, on_progress, self._confinement()
        )
        self.state = Lifecycle("the executor")
        self._pools: dict[str, KernelPool] = {}
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._tool_envs: dict[tuple[tuple[str, ...], str | None], VenvEnv] = {}
        self._fingerprints: dict[str, str] = {}
        self._isolations: dict[str, Isolation] = {}
        self._supervisor = TaskSupervisor()
        self.budget = KernelBudget(
            self.config.max_kernels, self.config.idle_timeout, self._supervisor
        )
        self.bootstrap = bootstrap_request(
            self.config.max_output_chars, fast_calls=self.config.fast_calls
        )
        self._keeper = keeper
        self._own_workdir = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def hold(self) -> None:
        """Have the backend hold what its kernels need (released by :meth:`aclose`); called
        once everything that may refuse the configuration has accepted it.

        Raises:
            HostLimitError: the host cannot hold ``max_kernels`` kernels.
        """
        # Room for max_kernels first: when the host cannot hold them, nothing is held yet.
        self.backend.reserve(self.config.max_kernels)
        self.backend.hold()

    def _confinement(self) -> BuildConfinement:
        """How tool-named requirements are built: under the kernels' own isolation."""
        cfg = self.config
        level = cfg.isolation or self.backend.default_isolation
        network = cfg.network if cfg.network is not None else level != "bwrap"
        return BuildConfinement(level=level, network=network)

    @property
    def env(self) -> Env:
        """The default environment of sessions and calls."""
        return self.config.env

    def fingerprint_of(self, env: Env) -> str:
        """The fingerprint of ``env`` as this executor's backend runs it."""
        base = env.fingerprint
        cached = self._fingerprints.get(base)
        if cached is None:
            cached = self.backend.fingerprint(self.launch(env, interpreter=None), base)
            self._fingerprints[base] = cached
        return cached

    def isolation_of(self, env: Env) -> Isolation:
        """What kernels of ``env`` get: the level and the mechanism of each limit and boundary."""
        fingerprint = self.fingerprint_of(env)
        found = self._isolations.get(fingerprint)
        if found is None:
            launch = self.launch(env, interpreter=None)
            # Validated: a backend written for earlier versions returns the report as a dict.
            found = Isolation.model_validate(self.backend.isolation(launch))
            self._isolations[fingerprint] = found
        return found

    def launch(self, env: Env, interpreter: str | None) -> KernelLaunch:
        """How the backend starts a kernel of ``env`` (``interpreter``: a built venv's)."""
        if isinstance(env, VenvEnv) and interpreter is None:
            interpreter = env.interpreter
        cfg = self.config
        workdir = None
        if self.backend.host_filesystem:
            where = self.workdir or cfg.workdir
            workdir = str(where) if where is not None else None
        return KernelLaunch(
            env=kernel_env(cfg),
            interpreter=interpreter,
            isolation=cfg.isolation or self.backend.default_isolation,
            limits={
                **(cfg.limits.given() if cfg.limits is not None else {}),
                **(
                    {"memory_budget_mb": float(cfg.memory_budget_mb)}
                    if cfg.memory_budget_mb is not None
                    else {}
                ),
            },
            network=cfg.network,
            workdir=workdir,
        )

    def check_env(self, env: Env) -> None:
        """Refuse, before anything is built, an environment the backend cannot run."""
        self.backend.check(self.launch(env, interpreter=None))

    async def start(self) -> None:
        """Make the working directory, open the budget and the background tasks, and start
        prewarming the default environment's pool. Idempotent.

        Raises:
            ExecutorClosedError: the executor was closed.
        """
        self.state.check()
        if self.state.is_open:
            return
        cfg = self.config
        if self.backend.host_filesystem:
            _disk.sweep_once()  # the capped directories of killed hosts, copied back
            sweep_once()  # what killed hosts left in the temp dir (once per process; quick)
            if cfg.workdir is None:
                self.workdir = Path(make_owned_dir("kernelexec-"))
                self._own_workdir = True
            else:
                self.workdir = Path(cfg.workdir)
                self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            # Paths on the kernel's side, relative to where the backend starts kernels.
            self.workdir = PurePosixPath(str(cfg.workdir) if cfg.workdir else "kernelexec")
        self.loop = asyncio.get_running_loop()
        await self._supervisor.start()
        self.budget.open()
        self.state.open()
        if isinstance(cfg.env, LocalEnv):
            self._new_pool(self.fingerprint_of(cfg.env), self.launch(cfg.env, None), cfg.prewarm)

    def spawn(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job()`` under the executor's background tasks (started by :meth:`start`)
        until it returns or the executor closes; a failure surfaces at close."""
        self._supervisor.spawn(name, job)

    def _new_pool(self, fingerprint: str, launch: KernelLaunch, prewarm: int) -> KernelPool:
        pool = KernelPool(
            self.backend,
            launch,
            bootstrap=self.bootstrap,
            prewarm=prewarm,
            start_timeout=self.config.start_timeout,
            budget=self.budget,
            supervisor=self._supervisor,
            keeper=self._keeper,
        )
        self._pools[fingerprint] = pool
        pool.open()
        return pool

    async def pool_for(self, env: Env, prewarm: int | None = None) -> KernelPool:
        """The pool of kernels for ``env``, building its venv first if needed."""
        fingerprint = self.fingerprint_of(env)
        pool = self._pools.get(fingerprint)
        if pool is not None:
            return pool
        async with self._pool_locks.setdefault(fingerprint, asyncio.Lock()):
            pool = self._pools.get(fingerprint)
            if pool is not None:
                return pool
            interpreter = None
            if isinstance(env, VenvEnv):
                built = await self.builder.ensure(env)
                interpreter = str(built.python)
            self.state.check()
            if prewarm is None:
                prewarm = self.config.prewarm if env == self.env else 0
            return self._new_pool(fingerprint, self.launch(env, interpreter), prewarm)

    @property
    def warm(self) -> int:
        """Prewarmed kernels waiting for a session, over every environment."""
        return sum(p.warm for p in self._pools.values())

    def env_for(self, tool: Tool | None, env: Env | None = None) -> Env:
        """The environment a call runs in: ``env`` if given; for a tool with
        ``pip_requirements``, a venv with exactly those (built from the default env's
        interpreter); else the executor's default."""
        if env is not None:
            return env
        if tool is not None and tool.pip_requirements:
            python = self.env.python if isinstance(self.env, VenvEnv) else None
            key = (tuple(tool.pip_requirements), python)
            venv = self._tool_envs.get(key)  # parsed and fingerprinted once, not per call
            if venv is None:
                try:
                    venv = VenvEnv(requirements=key[0], python=python)
                except ValueError as exc:
                    raise ConfigError(f"tool {tool.name!r}: bad pip_requirements: {exc}") from None
                self._tool_envs[key] = venv
            return venv
        return self.env

    async def aclose(self) -> None:
        """Shut every kernel down (the background tasks first, then the pools, the keeper's
        kernels and the backend's hold) and remove the executor's own working directory. The
        caller closed :attr:`state` already.

        Raises:
            BackgroundTaskError: background work failed while the executor ran.
        """
        pools = list(self._pools.values())
        self._pools.clear()
        try:
            await asyncio.shield(self._supervisor.aclose())
        finally:
            await asyncio.shield(asyncio.gather(*(p.aclose() for p in pools)))
            if self._keeper is not None:
                await asyncio.shield(self._keeper.aclose())
            await asyncio.shield(self.backend.release())
            if self._own_workdir and isinstance(self.workdir, Path):
                remove_tree(str(self.workdir))


def _resolve_backend(
    backend: KernelBackend | str | None, options: dict[str, Any] | None
) -> KernelBackend:
    """The backend given, or the one registered under the name given (``"local"`` when none
    is): the core reaches every backend, its own too, through the registry."""
    if isinstance(backend, KernelBackend):
        if options:
            raise ConfigError("backend_options apply only to a backend given by name")
        return backend
    if backend is None:
        backend = "local"
    if isinstance(backend, str):
        return get_backend(backend, **(options or {}))
    raise ConfigError(
        f"backend must be a KernelBackend or a backend name, not {type(backend).__name__}"
    )
