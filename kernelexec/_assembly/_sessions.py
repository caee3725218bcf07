"""``SessionAssembly``: makes an executor's sessions and keeps track of them.

A session is a kernel lease of the core with the features wired in: its directory, the
notebook recording, the live-attach registration, durable state and the replayer, branching
(children adopted as sessions of their own), and code mode's bounds. The assembly also keeps
the executor's registry up to date: a session whose kernel was evicted is parked (held weakly),
one that got a kernel again is held again (the registry entry, a watcher of the lease), a
closed or collected one is forgotten.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from kernelexec._assembly._dirs import SessionDirs
from kernelexec._assembly._durable import DurableSessions
from kernelexec._assembly._forking import SessionBranches, copy_workdir
from kernelexec._assembly._known import Key, KnownSessions, RegistryEntry
from kernelexec._branching._family import Brancher
from kernelexec._codemode._calls import HostCallBounds
from kernelexec._codemode._session import SessionCodeMode
from kernelexec._core._attach import SessionRegistration
from kernelexec._core._executor import Env, ExecutorCore
from kernelexec._core._features import SessionFeatures
from kernelexec._core._lease import KernelLease
from kernelexec._core._pipeline import RunLimits
from kernelexec._core._session import AsyncSession
from kernelexec._durable._handoff import AgentClaim
from kernelexec._exceptions import ConfigError
from kernelexec._files._commands import AsyncSessionCommands
from kernelexec._files._link import KernelLink
from kernelexec._files._session import AsyncSessionFiles
from kernelexec._notebooks._io import safe_filename
from kernelexec._recording import SessionRecorder
from kernelexec.backends._base import KernelConnection


class SessionAssembly:
    """The sessions of one executor (module docstring).

    Args:
        core: The executor's kernels.
        brancher: Forks the processes of sessions' kernels (the core's pools' keeper).

    Raises:
        ConfigError: ``checkpoint="after_call"`` with a ``state_dir`` where the backend's
            kernels do not see this host's filesystem.
    """

    def __init__(self, core: ExecutorCore, brancher: Brancher) -> None:
        self._core = core
        cfg = core.config
        self._registry = KnownSessions(core.state, self._released)
        self._dirs = SessionDirs()
        self.durable: DurableSessions | None = None
        if cfg.state_dir is not None:
            self.durable = DurableSessions(cfg, core.backend.name, core.backend.host_filesystem)
        self.brancher = brancher
        self._branches = SessionBranches(
            brancher,
            core.budget,
            core.bootstrap,
            cfg.start_timeout,
            core.backend.name,
            self._adopt_branch,
        )
        self._env_of: dict[str, Env] = {}  # fingerprint -> environment (for children)
        self._branch_counts: dict[str, int] = {}  # agent id -> children forked so far

    def open(self) -> None:
        """Make the recordings' directory and open the state store (the executor starts).

        Raises:
            ConfigError: ``record_dir`` cannot be made.
        """
        record_dir = self._core.config.record_dir
        if record_dir is not None:
            try:
                os.makedirs(record_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"record_dir {record_dir}: {exc.strerror}") from None
        if self.durable is not None:
            self.durable.open()

    def by_key(self) -> dict[Key, AsyncSession]:
        """Every session held, by (agent id, environment fingerprint)."""
        return self._registry.by_key()

    def get(self, key: Key) -> AsyncSession | None:
        """The session of ``key``, if one is held."""
        return self._registry.get(key)

    def live(self) -> list[AsyncSession]:
        """The sessions that have a kernel (or had one and are held by their caller)."""
        return self._registry.live()

    async def session(self, agent_id: str, env: Env, setup_code: str | None) -> AsyncSession:
        """The session of ``agent_id`` in ``env``, made on first use; see
        :meth:`kernelexec.AsyncKernelExecutor.session` (the caller checked the arguments and
        started the executor)."""
        core = self._core
        core.state.check()
        fingerprint = core.fingerprint_of(env)
        key = (agent_id, fingerprint)
        existing = self._registry.get(key)
        setup = tuple(c for c in (core.config.setup_code, setup_code) if c)
        if existing is not None:
            if setup_code is not None and existing.setup_code != setup:
                raise ConfigError(
                    f"session {agent_id!r} exists with another setup_code; close it first"
                )
            if existing.durable is not None:
                await existing.durable.hold_agent()
            return existing
        core.check_env(env)
        claim = None
        if self.durable is not None:
            claim = await self.durable.claim(agent_id, "" if env == core.env else fingerprint)
            if (existing := self._registry.get(key)) is not None:
                return existing  # made meanwhile by a concurrent call
        self._env_of[fingerprint] = env
        session = self._make(agent_id, env, fingerprint, setup, claim)
        self._registry.add(session)
        return session

    def _make(
        self,
        agent_id: str,
        env: Env,
        fingerprint: str,
        setup: tuple[str, ...],
        claim: AgentClaim | None,
    ) -> AsyncSession:
        core = self._core
        cfg = core.config
        default = env == core.env
        recorder = self._recorder(agent_id, env, fingerprint, default)
        assert core.workdir is not None
        workdir = self._dirs.take(core.workdir, agent_id)
        lease = KernelLease(
            agent_id,
            lambda: core.pool_for(env),
            str(workdir),
            env=cfg.env_vars if core.backend.filters_env else None,
            private=tuple(
                str(d) for d in (core.workdir, cfg.state_dir, cfg.record_dir) if d is not None
            ),
        )
        key = (agent_id, fingerprint)
        lease.carry_lost(self._registry.take_lost(key))
        isolation = core.isolation_of(env)
        # The features watch the lease, in this order: the live-attach entry first, durable
        # state before the registry entry (which may let the session go once it is parked).
        if cfg.attachable:
            lease.subscribe(SessionRegistration(agent_id, fingerprint, core.backend.name))
        durable = None
        if self.durable is not None:
            assert claim is not None
            durable = self.durable.keeper(
                agent_id,
                "" if default else fingerprint,
                workdir,
                lease,
                same_user=isolation.level == "none",
                recorder=recorder,
                claim=claim,
            )
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
        lease.subscribe(RegistryEntry(self._registry, core.budget, key, lease))
        core.budget.register(lease)
        features = SessionFeatures(
            files=AsyncSessionFiles(link),
            commands=AsyncSessionCommands(link),
            code_mode=code_mode,
            durable=durable,
            recorder=recorder,
        )
        return AsyncSession(
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
            isolation=isolation,
            backend=core.backend.name,
            on_close=self._forget,
            setup_code=setup,
            branches=self._branches,
            env=env if core.backend.host_filesystem else None,
        )

    def _recorder(
        self, agent_id: str, env: Env, fingerprint: str, default: bool
    ) -> SessionRecorder | None:
        """The session's notebook recording (``record``), in ``record_dir`` if set."""
        cfg = self._core.config
        if not cfg.record:
            return None
        path = None
        if cfg.record_dir is not None:
            name = safe_filename(agent_id)
            if not default:
                name = f"{name}@{fingerprint[:8]}"
            path = Path(cfg.record_dir) / f"{name}.ipynb"
        return SessionRecorder(agent_id, path, fingerprint, env.model_dump(mode="json"))

    async def _adopt_branch(self, parent: AsyncSession, conn: KernelConnection) -> AsyncSession:
        """The child session of ``parent`` around ``conn``, a fork of its kernel: a new agent
        id, a copy of the parent's files, a recording that says where it branched from."""
        count = self._branch_counts.get(parent.agent_id, 0)
        while True:
            count += 1
            agent_id = f"{parent.agent_id}~{count}"
            if (agent_id, parent.fingerprint) not in self._registry:
                break
        self._branch_counts[parent.agent_id] = count
        pool = parent.lease.pool
        assert pool is not None  # the parent has a kernel
        own = parent.setup_code[1:] if self._core.config.setup_code else parent.setup_code
        child = await self.session(
            agent_id,
            self._env_of.get(parent.fingerprint, self._core.env),
            own[0] if own else None,  # the parent's, for the child's fresh kernels
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
        self._dirs.give_back(lease.workdir)

    async def _forget(self, session: AsyncSession) -> None:
        """A session closed: the executor no longer knows it (the agent id may be used again)."""
        self._registry.forget(session)
        self._core.budget.forget(session.lease)
        self._dirs.give_back(session.workdir)

    async def close(self) -> None:
        """The executor is closing: hibernate what can be (durable), then mark every session
        closed; the kernels are shut down by the core after this."""
        sessions = self._registry.every()
        if self.durable is not None:
            await asyncio.shield(self.durable.hibernate_all(sessions))
        self._registry.clear()
        for session in sessions:
            session.mark_closed()

    async def delete_state(self, agent_id: str, env: Env) -> bool:
        """Delete the saved state of ``agent_id`` in ``env``; see
        :meth:`kernelexec.AsyncKernelExecutor.delete_state`.

        Raises:
            ConfigError: the executor has no ``state_dir``.
        """
        if self.durable is None:
            raise ConfigError("delete_state() needs an executor with a state_dir")
        fingerprint = self._core.fingerprint_of(env)
        key = "" if env == self._core.env else fingerprint
        live = self._registry.get((agent_id, fingerprint))
        return await self.durable.delete(agent_id, key, live)
