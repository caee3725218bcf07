"""``AsyncKernelExecutor``: the async executor users make: the core's kernels
(:class:`~kernelexec._core._executor.ExecutorCore`) and the sessions assembled on them
(:class:`~kernelexec._assembly._sessions.SessionAssembly`), one agent's session per
environment."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from kernelexec._assembly._sessions import SessionAssembly
from kernelexec._branching._family import Brancher
from kernelexec._codemode._exposure import HostFunctions
from kernelexec._config import ExecutorConfig, ExecutorOptions, make_config
from kernelexec._core._executor import Env, ExecutorCore
from kernelexec._core._outputs import OutputCallback
from kernelexec._core._session import AsyncSession
from kernelexec._envs._builder import EnvBuilder, ProgressCallback
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._models import Execution, Isolation, ToolResult
from kernelexec._observability._otel import telemetry
from kernelexec._public import public
from kernelexec._tools._tool import Tool
from kernelexec.backends._base import KernelBackend

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pydantic's own dependency
    from typing_extensions import Unpack

DEFAULT_AGENT = "default"


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
        settings = make_config(**config)
        brancher = Brancher(settings.start_timeout)
        self._core = ExecutorCore(
            settings,
            backend=backend,
            backend_options=backend_options,
            on_progress=on_progress,
            keeper=brancher,
        )
        self.config: ExecutorConfig = settings
        self.backend: KernelBackend = self._core.backend
        self.builder: EnvBuilder = self._core.builder
        self._sessions = SessionAssembly(self._core, brancher)
        self._core.hold()  # last: when anything above refuses, nothing is held

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the executor runs on (None until started); code on other threads
        hands it calls with ``asyncio.run_coroutine_threadsafe``."""
        return self._core.loop

    @property
    def env(self) -> Env:
        """The default environment of sessions and calls."""
        return self._core.env

    @property
    def fingerprint(self) -> str:
        """The default environment's fingerprint (``ToolResult.sandbox_config_fingerprint``)."""
        return self._core.fingerprint_of(self._core.env)

    def fingerprint_of(self, env: Env) -> str:
        """The fingerprint of ``env`` as this executor's backend runs it."""
        return self._core.fingerprint_of(env)

    def isolation_of(self, env: Env) -> Isolation:
        """What kernels of ``env`` get: the level and the mechanism of each limit and boundary."""
        return self._core.isolation_of(env)

    def env_for(self, tool: Tool | None, env: Env | None = None) -> Env:
        """The environment a call runs in: ``env`` if given; for a tool with
        ``pip_requirements``, a venv with exactly those (built from the default env's
        interpreter); else the executor's default."""
        return self._core.env_for(tool, env)

    async def __aenter__(self) -> AsyncKernelExecutor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the executor (start prewarming). Called by ``async with`` and on first use."""
        self._core.state.check()
        if self._core.state.is_open:
            return
        self._sessions.open()
        await self._core.start()
        if self._sessions.durable is not None:
            self._core.spawn("handoff", self._sessions.durable.handoff.serve)
        telemetry().watch(self)

    async def warm_up(self, env: Env | None = None) -> None:
        """Get ``env`` (default: the executor's) ready ahead of need: build its venv if needed
        and wait until its ``prewarm`` kernels are started.

        Raises:
            EnvSetupError: the venv could not be built.
        """
        await self.start()
        pool = await self._core.pool_for(env or self.env, self.config.prewarm)
        await pool.wait_warm()

    @property
    def sessions(self) -> dict[str, AsyncSession]:
        """The open sessions of the default environment by agent id (a copy); a session whose
        kernel was evicted is listed while its caller still holds it."""
        default = self.fingerprint
        held = self._sessions.by_key()
        return {agent: s for (agent, fp), s in held.items() if fp == default}

    @property
    def kernel_count(self) -> int:
        """Kernels alive or starting, prewarmed ones included, over every environment."""
        return self._core.budget.count

    def kernel_states(self) -> dict[str, int]:
        """Live kernels by state: ``busy`` (a session's, running a call), ``idle`` (a
        session's, waiting) and ``warm`` (prewarmed, no session yet); for the metrics."""
        states = {"busy": 0, "idle": 0, "warm": self._core.warm}
        for session in self._sessions.live():
            if session.has_kernel:
                states["busy" if session.busy else "idle"] += 1
        return states

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
        return await self._sessions.session(agent_id, env or self.env, setup_code)

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
        if not self._core.state.close():
            return
        await self._sessions.close()
        try:
            await self._core.aclose()
        finally:
            if self._sessions.durable is not None:
                self._sessions.durable.close()

    async def delete_state(self, agent_id: str, env: Env | None = None) -> bool:
        """Delete the saved state of ``agent_id`` (in ``env``, default: the executor's) from
        the ``state_dir``; whether there was any. A live session keeps its kernel's state.

        Raises:
            ConfigError: the executor has no ``state_dir``.
        """
        return await self._sessions.delete_state(agent_id, env or self.env)


public(__name__)
