"""``AsyncKernelExecutor``: the async core that owns a pool of kernels and the agents' sessions."""

from __future__ import annotations

import asyncio
import enum
import hashlib
import importlib.resources
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from kernelexec._config import ExecutorConfig, make_config
from kernelexec._core._pool import KernelPool
from kernelexec._core._session import REPORT_EXPRESSION, AsyncSession
from kernelexec._envs._builder import EnvBuilder, ProgressCallback
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._exceptions import ConfigError, ExecutorClosedError
from kernelexec._models import Execution, ToolResult
from kernelexec._notebooks._recording import SessionRecorder, safe_filename
from kernelexec._tempdirs import make_owned_dir, sweep_once
from kernelexec._tools._tool import Tool
from kernelexec.backends._base import ExecuteRequest, KernelBackend
from kernelexec.backends._local import LocalBackend

DEFAULT_AGENT = "default"


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


def _bootstrap_request(max_output_chars: int) -> ExecuteRequest:
    source = (
        importlib.resources.files("kernelexec._protocol").joinpath("_kernel_side.py").read_text()
    )
    code = (
        "def __kx_install():\n"
        "    import sys, types\n"
        "    from IPython import get_ipython\n"
        "    meta = get_ipython().kernel.get_parent()['metadata']['kernelexec']\n"
        "    mod = types.ModuleType('__kernelexec__')\n"
        "    sys.modules['__kernelexec__'] = mod\n"
        "    exec(compile(meta['source'], '<kernelexec>', 'exec'), mod.__dict__)\n"
        "    mod.install()\n"
        "__kx_install(); del __kx_install\n"
    )
    return ExecuteRequest(
        code=code,
        silent=True,
        store_history=False,
        metadata={
            "kernelexec": {
                "source": source,
                "max_output_chars": max_output_chars,
                "report_expression": REPORT_EXPRESSION,
                "fast_paths": os.environ.get("KERNELEXEC_NO_FAST_PATHS") != "1",
            }
        },
    )


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
        backend: Where kernels run (default: :class:`~kernelexec.backends.LocalBackend`).
        **config: Fields of :class:`~kernelexec.ExecutorConfig` (``env_vars``,
            ``default_timeout``, ``max_kernels``, ``prewarm``, ``idle_timeout``, ...).

    Raises:
        ConfigError: a configuration value is invalid (the message names it).
    """

    def __init__(
        self,
        *,
        backend: KernelBackend | None = None,
        on_progress: ProgressCallback | None = None,
        **config: Any,
    ) -> None:
        self.config = make_config(**config)
        if backend is not None and isinstance(self.config.env, VenvEnv):
            raise ConfigError("env=VenvEnv(...) needs the local backend; do not pass backend=")
        self.backend = backend or LocalBackend()
        self.builder = EnvBuilder(self.config.cache_dir, self.config.installer, on_progress)
        self._state = _State.UNOPENED
        self._sessions: dict[tuple[str, str], AsyncSession] = {}
        self._dirs_used: set[str] = set()
        self._pools: dict[str, KernelPool] = {}
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._tool_envs: dict[tuple[tuple[str, ...], str | None], VenvEnv] = {}
        self._own_workdir = False
        self._workdir: Path | None = None
        if backend is None:
            self._local_fingerprint = LocalEnv().fingerprint
        else:
            text = f"{self.backend.describe()}|{sys.version}"
            self._local_fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def env(self) -> LocalEnv | VenvEnv:
        """The default environment of sessions and calls."""
        return self.config.env

    @property
    def fingerprint(self) -> str:
        """The default environment's fingerprint (``ToolResult.sandbox_config_fingerprint``)."""
        return self.fingerprint_of(self.env)

    def fingerprint_of(self, env: LocalEnv | VenvEnv) -> str:
        """The fingerprint of ``env`` as this executor runs it."""
        return self._local_fingerprint if isinstance(env, LocalEnv) else env.fingerprint

    async def __aenter__(self) -> AsyncKernelExecutor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the executor (start prewarming). Called by ``async with`` and on first use."""
        if self._state is _State.CLOSED:
            raise ExecutorClosedError("the executor is closed")
        if self._state is _State.OPEN:
            return
        cfg = self.config
        sweep_once()  # what killed hosts left in the temp dir (once per process; quick)
        if cfg.workdir is None:
            self._workdir = Path(make_owned_dir("kernelexec-"))
            self._own_workdir = True
        else:
            self._workdir = Path(cfg.workdir)
            self._workdir.mkdir(parents=True, exist_ok=True)
        if cfg.record_dir is not None:
            try:
                os.makedirs(cfg.record_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"record_dir {cfg.record_dir}: {exc.strerror}") from None
        self._state = _State.OPEN
        if isinstance(cfg.env, LocalEnv):
            self._new_pool(self.fingerprint, self.backend, cfg.prewarm)

    def _new_pool(self, fingerprint: str, backend: KernelBackend, prewarm: int) -> KernelPool:
        cfg = self.config
        pool = KernelPool(
            backend,
            env=kernel_env(cfg),
            bootstrap=_bootstrap_request(cfg.max_output_chars),
            max_kernels=cfg.max_kernels,
            prewarm=prewarm,
            start_timeout=cfg.start_timeout,
            idle_timeout=cfg.idle_timeout,
            sessions=lambda: list(self._sessions.values()),
            total=lambda: self.kernel_count,
        )
        self._pools[fingerprint] = pool
        pool.open()
        return pool

    async def _pool_for(self, env: LocalEnv | VenvEnv, prewarm: int | None = None) -> KernelPool:
        """The pool of kernels for ``env``, building its venv first if needed."""
        fingerprint = self.fingerprint_of(env)
        pool = self._pools.get(fingerprint)
        if pool is not None:
            return pool
        async with self._pool_locks.setdefault(fingerprint, asyncio.Lock()):
            pool = self._pools.get(fingerprint)
            if pool is not None:
                return pool
            if isinstance(env, LocalEnv):
                backend: KernelBackend = self.backend
            else:
                built = await self.builder.ensure(env)
                backend = LocalBackend(python=str(built.python))
            if self._state is not _State.OPEN:
                raise ExecutorClosedError("the executor is closed")
            if prewarm is None:
                prewarm = self.config.prewarm if env == self.env else 0
            return self._new_pool(fingerprint, backend, prewarm)

    async def warm_up(self, env: LocalEnv | VenvEnv | None = None) -> None:
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
        """The open sessions of the default environment by agent id (a copy)."""
        default = self.fingerprint
        return {agent: s for (agent, fp), s in self._sessions.items() if fp == default}

    @property
    def kernel_count(self) -> int:
        """Kernels alive or starting, prewarmed ones included, over every environment."""
        return sum(pool.size for pool in self._pools.values())

    def env_for(
        self, tool: Tool | None, env: LocalEnv | VenvEnv | None = None
    ) -> LocalEnv | VenvEnv:
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
        self, agent_id: str = DEFAULT_AGENT, env: LocalEnv | VenvEnv | None = None
    ) -> AsyncSession:
        """The session of ``agent_id`` in ``env`` (default: the executor's), created on first
        use; its kernel (and venv) are made lazily. One agent has one session per environment."""
        if not isinstance(agent_id, str) or not agent_id:
            raise TypeError("agent_id must be a non-empty str")
        if env is not None and not isinstance(env, LocalEnv | VenvEnv):
            raise TypeError(f"env must be a LocalEnv or VenvEnv, not {type(env).__name__}")
        if isinstance(env, VenvEnv) and not isinstance(self.backend, LocalBackend):
            raise ConfigError("a VenvEnv needs the local backend")
        await self.start()
        if self._state is not _State.OPEN:
            raise ExecutorClosedError("the executor is closed")
        env = env or self.env
        fingerprint = self.fingerprint_of(env)
        existing = self._sessions.get((agent_id, fingerprint))
        if existing is not None:
            return existing
        assert self._workdir is not None
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
        session = AsyncSession(
            agent_id,
            lambda: self._pool_for(env),
            self._session_dir(agent_id),
            fingerprint=fingerprint,
            default_timeout=cfg.default_timeout,
            interrupt_grace=cfg.interrupt_grace,
            output_grace=cfg.output_grace,
            max_output_chars=cfg.max_output_chars,
            max_result_chars=cfg.max_result_chars,
            recorder=recorder,
        )
        self._sessions[(agent_id, fingerprint)] = session
        return session

    def _session_dir(self, agent_id: str) -> Path:
        assert self._workdir is not None
        base = re.sub(r"[^A-Za-z0-9._-]", "_", agent_id)[:64].strip(".") or "agent"
        name, n = base, 1
        while name in self._dirs_used:
            n += 1
            name = f"{base}-{n}"
        self._dirs_used.add(name)
        path = self._workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def call_tool(
        self,
        tool: Tool,
        args: dict[str, Any] | None = None,
        *,
        agent_id: str | None = None,
        env: LocalEnv | VenvEnv | None = None,
        **kwargs: Any,
    ) -> ToolResult:
        """Call a tool in the session of ``agent_id``; see :meth:`AsyncSession.call_tool`.

        The call runs in ``env`` if given, else (for a tool with ``pip_requirements``) in the
        venv for those requirements, else in the executor's default environment.
        """
        if not isinstance(tool, Tool):
            raise TypeError(f"tool must be a kernelexec.Tool, not {type(tool).__name__}")
        session = await self.session(agent_id or DEFAULT_AGENT, self.env_for(tool, env))
        return await session.call_tool(tool, args, **kwargs)

    async def run_code(
        self,
        code: str,
        *,
        agent_id: str | None = None,
        env: LocalEnv | VenvEnv | None = None,
        **kwargs: Any,
    ) -> Execution:
        """Run code in the session of ``agent_id`` (in ``env``, default: the executor's);
        see :meth:`AsyncSession.run_code`."""
        session = await self.session(agent_id or DEFAULT_AGENT, env)
        return await session.run_code(code, **kwargs)

    async def aclose(self) -> None:
        """Shut down every kernel and remove the executor's temporary files. Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for session in sessions:
            session.mark_closed()
        pools = list(self._pools.values())
        self._pools.clear()
        await asyncio.shield(asyncio.gather(*(p.aclose() for p in pools)))
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
