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
import tempfile
from pathlib import Path
from typing import Any

from kernelexec._config import ExecutorConfig, make_config
from kernelexec._exceptions import ConfigError, ExecutorClosedError
from kernelexec._models import Execution, ToolResult
from kernelexec._pool import KernelPool
from kernelexec._record import SessionRecorder, safe_filename
from kernelexec._session import AsyncSession
from kernelexec._tools import Tool
from kernelexec.backends._base import ExecuteRequest, KernelBackend
from kernelexec.backends._local import LocalBackend

DEFAULT_AGENT = "default"


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


def _bootstrap_request(max_output_chars: int) -> ExecuteRequest:
    source = importlib.resources.files("kernelexec").joinpath("_kernel_side.py").read_text()
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
        metadata={"kernelexec": {"source": source, "max_output_chars": max_output_chars}},
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

    def __init__(self, *, backend: KernelBackend | None = None, **config: Any) -> None:
        self.config = make_config(**config)
        self.backend = backend or LocalBackend()
        self._state = _State.UNOPENED
        self._sessions: dict[str, AsyncSession] = {}
        self._dirs_used: set[str] = set()
        self._pool: KernelPool | None = None
        self._own_workdir = False
        self._workdir: Path | None = None
        self.fingerprint = hashlib.sha256(
            f"{self.backend.describe()}|{sys.version}".encode()
        ).hexdigest()[:16]

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
        if cfg.workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="kernelexec-"))
            self._own_workdir = True
        else:
            self._workdir = Path(cfg.workdir)
            self._workdir.mkdir(parents=True, exist_ok=True)
        if cfg.record_dir is not None:
            try:
                os.makedirs(cfg.record_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"record_dir {cfg.record_dir}: {exc.strerror}") from None
        self._pool = KernelPool(
            self.backend,
            env=kernel_env(cfg),
            bootstrap=_bootstrap_request(cfg.max_output_chars),
            max_kernels=cfg.max_kernels,
            prewarm=cfg.prewarm,
            start_timeout=cfg.start_timeout,
            idle_timeout=cfg.idle_timeout,
            sessions=lambda: list(self._sessions.values()),
        )
        self._state = _State.OPEN
        self._pool.open()

    async def warm_up(self) -> None:
        """Wait until the ``prewarm`` kernels are started and ready."""
        await self.start()
        assert self._pool is not None
        await self._pool.wait_warm()

    @property
    def sessions(self) -> dict[str, AsyncSession]:
        """The open sessions by agent id (a copy)."""
        return dict(self._sessions)

    @property
    def kernel_count(self) -> int:
        """Kernels alive or starting, prewarmed ones included."""
        return self._pool.size if self._pool else 0

    async def session(self, agent_id: str = DEFAULT_AGENT) -> AsyncSession:
        """The session of ``agent_id``, created on first use (its kernel starts lazily)."""
        if not isinstance(agent_id, str) or not agent_id:
            raise TypeError("agent_id must be a non-empty str")
        await self.start()
        if self._state is not _State.OPEN:
            raise ExecutorClosedError("the executor is closed")
        existing = self._sessions.get(agent_id)
        if existing is not None:
            return existing
        assert self._pool is not None and self._workdir is not None
        cfg = self.config
        recorder = None
        if cfg.record:
            path = None
            if cfg.record_dir is not None:
                path = Path(cfg.record_dir) / f"{safe_filename(agent_id)}.ipynb"
            recorder = SessionRecorder(agent_id, path, self.fingerprint)
        session = AsyncSession(
            agent_id,
            self._pool,
            self._session_dir(agent_id),
            fingerprint=self.fingerprint,
            default_timeout=cfg.default_timeout,
            interrupt_grace=cfg.interrupt_grace,
            output_grace=cfg.output_grace,
            max_output_chars=cfg.max_output_chars,
            max_result_chars=cfg.max_result_chars,
            recorder=recorder,
        )
        self._sessions[agent_id] = session
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
        **kwargs: Any,
    ) -> ToolResult:
        """Call a tool in the session of ``agent_id``; see :meth:`AsyncSession.call_tool`."""
        session = await self.session(agent_id or DEFAULT_AGENT)
        return await session.call_tool(tool, args, **kwargs)

    async def run_code(self, code: str, *, agent_id: str | None = None, **kwargs: Any) -> Execution:
        """Run code in the session of ``agent_id``; see :meth:`AsyncSession.run_code`."""
        session = await self.session(agent_id or DEFAULT_AGENT)
        return await session.run_code(code, **kwargs)

    async def aclose(self) -> None:
        """Shut down every kernel and remove the executor's temporary files. Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for session in sessions:
            session._closed = True
        if self._pool is not None:
            await asyncio.shield(self._pool.aclose())
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
