"""``AsyncKernelExecutor``: the async core. It owns the backend, one warm pool per environment,
the kernel budget, the background tasks and the agents' sessions."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from kernelexec._branching._family import Brancher
from kernelexec._codemode._calls import HostCallBounds
from kernelexec._codemode._exposure import HostFunctions
from kernelexec._codemode._session import SessionCodeMode
from kernelexec._config import ExecutorConfig, ExecutorOptions, make_config
from kernelexec._core._attach import SessionRegistration
from kernelexec._core._budget import KernelBudget
from kernelexec._core._features import SessionFeatures
from kernelexec._core._forking import SessionBranches, copy_workdir
from kernelexec._core._lease import KernelLease
from kernelexec._core._outputs import OutputCallback
from kernelexec._core._pipeline import RunLimits
from kernelexec._core._pool import KernelPool
from kernelexec._core._registry import KnownSessions, RegistryEntry
from kernelexec._core._session import AsyncSession
from kernelexec._core._state import Lifecycle
from kernelexec._core._tasks import TaskSupervisor
from kernelexec._durable._handoff import Handoff
from kernelexec._durable._keeper import Replayer, Runner, SessionState
from kernelexec._durable._leases import LeaseBook
from kernelexec._durable._rebuild import replay
from kernelexec._durable._store import StateStore
from kernelexec._durable._transfer import RemoteSessionState
from kernelexec._envs._builder import EnvBuilder, ProgressCallback
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._exceptions import ConfigError
from kernelexec._files._commands import AsyncSessionCommands
from kernelexec._files._link import KernelLink
from kernelexec._files._session import AsyncSessionFiles
from kernelexec._models import Execution, Isolation, ToolResult
from kernelexec._notebooks._io import safe_filename
from kernelexec._observability._logtext import untrusted
from kernelexec._observability._otel import telemetry
from kernelexec._protocol._host import bootstrap_request
from kernelexec._public import public
from kernelexec._recording import SessionRecorder
from kernelexec._sandbox import _disk
from kernelexec._sandbox._build import BuildConfinement
from kernelexec._tempdirs import make_owned_dir, remove_tree, sweep_once
from kernelexec._tools._tool import Tool
from kernelexec.backends._base import KernelBackend, KernelConnection, KernelLaunch
from kernelexec.backends._local import LocalBackend
from kernelexec.backends._registry import get_backend

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pydantic's own dependency
    from typing_extensions import Unpack

log = logging.getLogger("kernelexec")

DEFAULT_AGENT = "default"

Env = LocalEnv | VenvEnv


def kernel_env(config: ExecutorConfig) -> dict[str, str]:
    """The exact environment a kernel gets: allowlisted host variables plus ``env_vars``."""
    env = {k: os.environ[k] for k in config.env_allowlist if k in os.environ}
    env.update(config.env_vars)
    return env


class AsyncKernelExecutor:
    """Runs tools and code in persistent Jupyter kernels, one per agent.

    Use it as an async context manager; leaving the block (also on an error or cancellation)
    shuts every kernel down and removes every temporary file::

        async with AsyncKernelExecutor(prewarm=1) as ex:
            result = await ex.call_tool(tool, {"a": 1}, agent_id="agent-1")

    Args:
        backend: Where kernels run: a :class:`~kernelexec.backends.KernelBackend`, or the name
            of an installed one (``"local"``, the default).
        backend_options: Keyword arguments for a backend given by name.
        on_progress: Called with :class:`~kernelexec.EnvProgress` events while venvs build.
        **config: Fields of :class:`~kernelexec.ExecutorConfig` (``env_vars``,
            ``default_timeout``, ``max_kernels``, ``prewarm``, ``idle_timeout``, ...), typed
            as :class:`~kernelexec.ExecutorOptions` so a type checker catches a misspelt one.

    Raises:
        ConfigError: a configuration value is invalid, or the backend cannot run the
            configured environment (the message names it).
        HostLimitError: the host cannot hold ``max_kernels`` kernels (the hard limit on open
            files is too low; the message says what to change).
    """

    def __init__(
        self,
        *,
        backend: KernelBackend | str | None = None,
        backend_options: dict[str, Any] | None = None,
        on_progress: ProgressCallback | None = None,
        **config: Unpack[ExecutorOptions],
    ) -> None:
        self.config = make_config(**config)
        self.backend = _resolve_backend(backend, backend_options)
        self._workdir: PurePath | None = None
        self._check_env(self.config.env)
        self.builder = EnvBuilder(
            self.config.cache_dir, self.config.installer, on_progress, self._confinement()
        )
        self._state = Lifecycle("the executor")
        self._registry = KnownSessions(self._state, self._released)
        self._dirs_used: set[str] = set()
        self._dirs_made: set[str] = set()  # session directories this executor made
        self._pools: dict[str, KernelPool] = {}
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._tool_envs: dict[tuple[tuple[str, ...], str | None], VenvEnv] = {}
        self._fingerprints: dict[str, str] = {}
        self._isolations: dict[str, Isolation] = {}
        self._supervisor = TaskSupervisor()
        self._budget = KernelBudget(
            self.config.max_kernels, self.config.idle_timeout, self._supervisor
        )
        self._bootstrap = bootstrap_request(
            self.config.max_output_chars, fast_calls=self.config.fast_calls
        )
        self._own_workdir = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: StateStore | None = None
        self._handoff: Handoff | None = None
        if self.config.state_dir is not None:
            if not self.backend.host_filesystem and self.config.checkpoint == "after_call":
                raise ConfigError(
                    f"checkpoint='after_call': the {self.backend.name!r} backend's kernels do "
                    "not see this host's filesystem; its durable sessions save on_evict"
                )
            self._store = StateStore(self.config.state_dir)
            self._handoff = Handoff(LeaseBook(self.config.state_dir), self.config.handoff_timeout)
        self._brancher = Brancher(self.config.start_timeout)
        self._branches = SessionBranches(
            self._brancher,
            self._budget,
            self._bootstrap,
            self.config.start_timeout,
            self.backend.name,
            self._adopt_branch,
        )
        self._env_of: dict[str, Env] = {}  # fingerprint -> environment (for children)
        self._branch_counts: dict[str, int] = {}  # agent id -> children forked so far
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
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the executor runs on (None until started); code on other threads
        hands it calls with ``asyncio.run_coroutine_threadsafe``."""
        return self._loop

    @property
    def env(self) -> Env:
        """The default environment of sessions and calls."""
        return self.config.env

    @property
    def fingerprint(self) -> str:
        """The default environment's fingerprint (``ToolResult.sandbox_config_fingerprint``)."""
        return self.fingerprint_of(self.env)

    def fingerprint_of(self, env: Env) -> str:
        """The fingerprint of ``env`` as this executor's backend runs it."""
        base = env.fingerprint
        cached = self._fingerprints.get(base)
        if cached is None:
            cached = self.backend.fingerprint(self._launch(env, interpreter=None), base)
            self._fingerprints[base] = cached
        return cached

    def isolation_of(self, env: Env) -> Isolation:
        """What kernels of ``env`` get: the level and the mechanism of each limit and boundary."""
        fingerprint = self.fingerprint_of(env)
        found = self._isolations.get(fingerprint)
        if found is None:
            launch = self._launch(env, interpreter=None)
            # Validated: a backend written for earlier versions returns the report as a dict.
            found = Isolation.model_validate(self.backend.isolation(launch))
            self._isolations[fingerprint] = found
        return found

    def _launch(self, env: Env, interpreter: str | None) -> KernelLaunch:
        if isinstance(env, VenvEnv) and interpreter is None:
            interpreter = env.interpreter
        cfg = self.config
        workdir = None
        if self.backend.host_filesystem:
            where = self._workdir or cfg.workdir
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

    def _check_env(self, env: Env) -> None:
        """Refuse, before anything is built, an environment the backend cannot run."""
        self.backend.check(self._launch(env, interpreter=None))

    async def __aenter__(self) -> AsyncKernelExecutor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the executor (start prewarming). Called by ``async with`` and on first use."""
        self._state.check()
        if self._state.is_open:
            return
        cfg = self.config
        if self.backend.host_filesystem:
            _disk.sweep_once()  # the capped directories of killed hosts, copied back
            sweep_once()  # what killed hosts left in the temp dir (once per process; quick)
            if cfg.workdir is None:
                self._workdir = Path(make_owned_dir("kernelexec-"))
                self._own_workdir = True
            else:
                self._workdir = Path(cfg.workdir)
                self._workdir.mkdir(parents=True, exist_ok=True)
        else:
            # Paths on the kernel's side, relative to where the backend starts kernels.
            self._workdir = PurePosixPath(str(cfg.workdir) if cfg.workdir else "kernelexec")
        if cfg.record_dir is not None:
            try:
                os.makedirs(cfg.record_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"record_dir {cfg.record_dir}: {exc.strerror}") from None
        self._loop = asyncio.get_running_loop()
        if self._store is not None:
            self._store.open()
        if self._handoff is not None:
            self._handoff.open()
        await self._supervisor.start()
        if self._handoff is not None:
            self._supervisor.spawn("handoff", self._handoff.serve)
        self._budget.open()
        self._state.open()
        telemetry().watch(self)
        if isinstance(cfg.env, LocalEnv):
            self._new_pool(self.fingerprint, self._launch(cfg.env, None), cfg.prewarm)

    def _new_pool(self, fingerprint: str, launch: KernelLaunch, prewarm: int) -> KernelPool:
        pool = KernelPool(
            self.backend,
            launch,
            bootstrap=self._bootstrap,
            prewarm=prewarm,
            start_timeout=self.config.start_timeout,
            budget=self._budget,
            supervisor=self._supervisor,
            keeper=self._brancher,
        )
        self._pools[fingerprint] = pool
        pool.open()
        return pool

    async def _pool_for(self, env: Env, prewarm: int | None = None) -> KernelPool:
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
            self._state.check()
            if prewarm is None:
                prewarm = self.config.prewarm if env == self.env else 0
            return self._new_pool(fingerprint, self._launch(env, interpreter), prewarm)

    async def warm_up(self, env: Env | None = None) -> None:
        """Get ``env`` (default: the executor's) ready ahead of need: build its venv if needed
        and wait until its ``prewarm`` kernels are started.

        Raises:
            EnvSetupError: the venv could not be built.
        """
        await self.start()
        pool = await self._pool_for(env or self.env, self.config.prewarm)
        await pool.wait_warm()

    @property
    def sessions(self) -> dict[str, AsyncSession]:
        """The open sessions of the default environment by agent id (a copy); a session whose
        kernel was evicted is listed while its caller still holds it."""
        default = self.fingerprint
        return {agent: s for (agent, fp), s in self._registry.by_key().items() if fp == default}

    @property
    def kernel_count(self) -> int:
        """Kernels alive or starting, prewarmed ones included, over every environment."""
        return self._budget.count

    def kernel_states(self) -> dict[str, int]:
        """Live kernels by state: ``busy`` (a session's, running a call), ``idle`` (a
        session's, waiting) and ``warm`` (prewarmed, no session yet); for the metrics."""
        states = {"busy": 0, "idle": 0, "warm": sum(p.warm for p in self._pools.values())}
        for session in self._registry.live():
            if session.has_kernel:
                states["busy" if session.busy else "idle"] += 1
        return states

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

    async def session(
        self,
        agent_id: str = DEFAULT_AGENT,
        env: Env | None = None,
        *,
        setup_code: str | None = None,
    ) -> AsyncSession:
        """The session of ``agent_id`` in ``env`` (default: the executor's), created on first
        use; its kernel (and venv) are made lazily. One agent has one session per environment.

        Args:
            agent_id: The agent whose session it is.
            env: Its environment (default: the executor's).
            setup_code: Code run in each fresh kernel of the session (after the executor's
                ``setup_code``) before its next call; see ``ExecutorConfig.setup_code``.
                Given for an existing session, it must be the one it was made with.

        Raises:
            ConfigError: the backend cannot run ``env``, or ``setup_code`` differs from an
                existing session's.
        """
        if setup_code is not None and not isinstance(setup_code, str):
            raise TypeError(f"setup_code must be str, not {type(setup_code).__name__}")
        if not isinstance(agent_id, str) or not agent_id:
            raise TypeError("agent_id must be a non-empty str")
        if env is not None and not isinstance(env, LocalEnv | VenvEnv):
            raise TypeError(f"env must be a LocalEnv or VenvEnv, not {type(env).__name__}")
        await self.start()
        self._state.check()
        env = env or self.env
        fingerprint = self.fingerprint_of(env)
        key = (agent_id, fingerprint)
        existing = self._registry.get(key)
        setup = tuple(c for c in (self.config.setup_code, setup_code) if c)
        if existing is not None:
            if setup_code is not None and existing.setup_code != setup:
                raise ConfigError(
                    f"session {agent_id!r} exists with another setup_code; close it first"
                )
            if existing.durable is not None:
                await existing.durable.hold_agent()
            return existing
        self._check_env(env)
        claim = None
        if self._handoff is not None:
            claim = self._handoff.claim(agent_id, "" if env == self.env else fingerprint)
            await claim.take()
            if (existing := self._registry.get(key)) is not None:
                return existing  # made meanwhile by a concurrent call
        self._env_of[fingerprint] = env
        cfg = self.config
        recorder = None
        if cfg.record:
            path = None
            if cfg.record_dir is not None:
                name = safe_filename(agent_id)
                if env != self.env:
                    name = f"{name}@{fingerprint[:8]}"
                path = Path(cfg.record_dir) / f"{name}.ipynb"
            recorder = SessionRecorder(agent_id, path, fingerprint, env.model_dump(mode="json"))
        workdir = self._session_dir(agent_id)
        lease = KernelLease(
            agent_id,
            lambda: self._pool_for(env),
            str(workdir),
            env=cfg.env_vars if self.backend.filters_env else None,
            private=tuple(
                str(d) for d in (self._workdir, cfg.state_dir, cfg.record_dir) if d is not None
            ),
        )
        lease.carry_lost(self._registry.take_lost(key))
        # The features watch the lease, in this order: the live-attach entry first, durable
        # state before the registry entry (which may let the session go once it is parked).
        if cfg.attachable:
            lease.subscribe(SessionRegistration(agent_id, fingerprint, self.backend.name))
        durable = None
        if self._store is not None:
            state = SessionState if self.backend.host_filesystem else RemoteSessionState
            durable = state(
                self._store,
                agent_id,
                "" if env == self.env else fingerprint,
                Path(workdir),  # a gateway's: relative, as its kernels see it
                checkpoint=cfg.checkpoint,
                limit=cfg.max_checkpoint_bytes,
                same_user=self.isolation_of(env).level == "none",
                secret_names=frozenset(cfg.env_vars),
                claim=claim,
            )
            durable.serve_handovers(lease)
            if recorder is not None:
                durable.replayer = _replayer(recorder)
            lease.subscribe(durable)
        link = KernelLink(lease, str(workdir), timeout=cfg.default_timeout)
        lease.subscribe(link)
        code_mode = SessionCodeMode(
            agent_id,
            bounds=HostCallBounds(
                calls_per_run=cfg.max_host_calls,
                result_chars=cfg.max_result_chars,
                call_bytes=cfg.max_host_call_bytes,
                in_flight=cfg.max_host_calls_in_flight,
            ),
            install_timeout=cfg.default_timeout,
        )
        lease.subscribe(code_mode)
        lease.subscribe(RegistryEntry(self._registry, self._budget, key, lease))
        self._budget.register(lease)
        features = SessionFeatures(
            files=AsyncSessionFiles(link),
            commands=AsyncSessionCommands(link),
            code_mode=code_mode,
            durable=durable,
            recorder=recorder,
        )
        session = AsyncSession(
            agent_id,
            lease,
            workdir,
            features,
            fingerprint=fingerprint,
            default_timeout=cfg.default_timeout,
            limits=RunLimits(
                interrupt_grace=cfg.interrupt_grace,
                output_grace=cfg.output_grace,
                max_output_chars=cfg.max_output_chars,
            ),
            max_result_chars=cfg.max_result_chars,
            isolation=self.isolation_of(env),
            backend=self.backend.name,
            on_close=self._forget,
            setup_code=setup,
            branches=self._branches,
            env=env if self.backend.host_filesystem else None,
        )
        self._registry.add(session)
        return session

    async def _adopt_branch(self, parent: AsyncSession, conn: KernelConnection) -> AsyncSession:
        """The child session of ``parent`` around ``conn``, a fork of its kernel: a new agent
        id, a copy of the parent's files, a recording that says where it branched from."""
        count = self._branch_counts.get(parent.agent_id, 0)
        while True:
            count += 1
            agent_id = f"{parent.agent_id}~{count}"
            key = (agent_id, parent.fingerprint)
            if key not in self._registry:
                break
        self._branch_counts[parent.agent_id] = count
        pool = parent.lease.pool
        assert pool is not None  # the parent has a kernel
        own = parent.setup_code[1:] if self.config.setup_code else parent.setup_code
        child = await self.session(
            agent_id,
            self._env_of.get(parent.fingerprint, self.env),
            setup_code=own[0] if own else None,  # the parent's, for the child's fresh kernels
        )
        if isinstance(parent.workdir, Path) and isinstance(child.workdir, Path):
            await asyncio.to_thread(copy_workdir, parent.workdir, child.workdir)
        pool.adopt(conn)
        await child.lease.adopt(conn, pool, parent.lease.names)
        if child.recorder is not None:
            child.recorder.note_branch(parent.agent_id, parent.notebook)
        return child

    def _released(self, lease: KernelLease, recorder: SessionRecorder | None) -> None:
        """A parked session nobody held was collected: let its file and names go."""
        if recorder is not None:
            recorder.close()
        lease.gone()  # the features watching it (an attachable session's registry entry)
        self._dirs_used.discard(PurePath(lease.workdir).name)

    async def _forget(self, session: AsyncSession) -> None:
        """A session closed: the executor no longer knows it (the agent id may be used again)."""
        self._registry.forget(session)
        self._budget.forget(session.lease)
        self._dirs_used.discard(PurePath(session.workdir).name)

    def _session_dir(self, agent_id: str) -> PurePath:
        """A session's directory: ``<workdir>/<agent id>``, or ``<agent id>-2``... when that
        name is in use. On the host's filesystem the directory is made by this executor: one
        that exists already (another executor sharing the workdir, or an earlier run) is never
        taken over, so two executors never share a session's files."""
        assert self._workdir is not None
        base = safe_filename(agent_id)
        n = 1
        while True:
            name = base if n == 1 else f"{base}-{n}"
            n += 1
            if name in self._dirs_used:
                continue
            path = self._workdir / name
            if isinstance(path, Path) and name not in self._dirs_made:
                try:
                    path.mkdir()
                except FileExistsError:
                    continue
                self._dirs_made.add(name)
            self._dirs_used.add(name)
            return path

    async def call_tool(
        self,
        tool: Tool,
        args: dict[str, Any] | None = None,
        *,
        agent_id: str | None = None,
        env: Env | None = None,
        agent_state: Any = None,
        env_vars: dict[str, str] | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
        host_functions: HostFunctions | None = None,
        atomic: bool = False,
    ) -> ToolResult:
        """Call a tool in the session of ``agent_id``; see :meth:`AsyncSession.call_tool`.

        The call runs in ``env`` if given, else (for a tool with ``pip_requirements``) in the
        venv for those requirements, else in the executor's default environment.
        """
        if not isinstance(tool, Tool):
            raise TypeError(f"tool must be a kernelexec.Tool, not {type(tool).__name__}")
        session = await self.session(agent_id or DEFAULT_AGENT, self.env_for(tool, env))
        return await session.call_tool(
            tool,
            args,
            agent_state=agent_state,
            env_vars=env_vars,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            host_functions=host_functions,
            atomic=atomic,
        )

    async def run_code(
        self,
        code: str,
        *,
        agent_id: str | None = None,
        env: Env | None = None,
        env_vars: dict[str, str] | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
        host_functions: HostFunctions | None = None,
        atomic: bool = False,
    ) -> Execution:
        """Run code in the session of ``agent_id`` (in ``env``, default: the executor's);
        see :meth:`AsyncSession.run_code`."""
        session = await self.session(agent_id or DEFAULT_AGENT, env)
        return await session.run_code(
            code,
            env_vars=env_vars,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            host_functions=host_functions,
            atomic=atomic,
        )

    async def aclose(self) -> None:
        """Shut down every kernel and remove the executor's temporary files. Idempotent.

        Raises:
            BackgroundTaskError: background work failed while the executor ran (everything
                is shut down first).
        """
        if not self._state.close():
            return
        sessions = self._registry.every()
        if self._store is not None:
            await asyncio.shield(self._hibernate_all(sessions))
        self._registry.clear()
        for session in sessions:
            session.mark_closed()
        pools = list(self._pools.values())
        self._pools.clear()
        try:
            await asyncio.shield(self._supervisor.aclose())
        finally:
            await asyncio.shield(asyncio.gather(*(p.aclose() for p in pools)))
            await asyncio.shield(self._brancher.aclose())
            await asyncio.shield(self.backend.release())
            if self._handoff is not None:
                self._handoff.close()
            if self._store is not None:
                self._store.close()
            if self._own_workdir and isinstance(self._workdir, Path):
                remove_tree(str(self._workdir))

    async def _hibernate_all(self, sessions: list[AsyncSession]) -> None:
        """Save every session that has a kernel before the kernels go; a session busy now
        cannot be saved: its names are reported lost on resume (with ``after_call``, its last
        completed call's checkpoint stays)."""

        async def one(session: AsyncSession) -> None:
            lease = session.lease
            keeper = session.durable
            if keeper is None or not lease.has_kernel:
                return
            if not lease.busy:
                await lease.evict()
            elif keeper.checkpoint == "on_evict":
                await keeper.tombstone(
                    list(lease.names), "the session was busy when its executor closed"
                )

        results = await asyncio.gather(*(one(s) for s in sessions), return_exceptions=True)
        for session, result in zip(sessions, results, strict=True):
            if isinstance(result, Exception):
                log.warning(
                    "agent %r: not hibernated at close: %s", session.agent_id, untrusted(result)
                )

    async def delete_state(self, agent_id: str, env: Env | None = None) -> bool:
        """Delete the saved state of ``agent_id`` (in ``env``, default: the executor's) from
        the ``state_dir``; whether there was any. A live session keeps its kernel's state.

        Raises:
            ConfigError: the executor has no ``state_dir``.
        """
        if self._store is None:
            raise ConfigError("delete_state() needs an executor with a state_dir")
        env = env or self.env
        fingerprint = self.fingerprint_of(env)
        key = "" if env == self.env else fingerprint
        session = self._registry.get((agent_id, fingerprint))
        if session is not None and session.durable is not None:
            session.durable.deleted()
        return await asyncio.to_thread(self._store.delete, agent_id, key)


def _replayer(recorder: SessionRecorder) -> Replayer:
    """Rebuilds names from the cells ``recorder`` holds."""

    async def rebuild(names: list[str], run: Runner) -> list[str]:
        cells = recorder.notebook.cells
        return await replay((c.source for c in cells if c.cell_type == "code"), names, run)

    return rebuild


def _resolve_backend(
    backend: KernelBackend | str | None, options: dict[str, Any] | None
) -> KernelBackend:
    if isinstance(backend, KernelBackend):
        if options:
            raise ConfigError("backend_options apply only to a backend given by name")
        return backend
    if backend is None:
        return LocalBackend(**(options or {})) if options else LocalBackend()
    if isinstance(backend, str):
        return get_backend(backend, **(options or {}))
    raise ConfigError(
        f"backend must be a KernelBackend or a backend name, not {type(backend).__name__}"
    )


public(__name__)
