"""A drop-in for Letta's local tool sandbox: ``AsyncToolSandboxKernel`` on persistent kernels.

A Letta server (or a fork) runs a tool by constructing ``AsyncToolSandboxLocal(...)`` and
awaiting ``sandbox.run(agent_state=..., additional_env_vars=...)``. Constructing
:class:`AsyncToolSandboxKernel` with the same arguments instead runs the tool in the agent's
persistent kernel (one per agent id, behind one process-wide executor) and returns a
:class:`ToolExecutionResult` with Letta's field names, types and semantics::

    from kernelexec.compat.letta import AsyncToolSandboxKernel

    sandbox = AsyncToolSandboxKernel(tool.name, args, actor, tool_id=tool.id,
                                     agent_id=agent_state.id, tool_object=tool,
                                     sandbox_config=sandbox_config,
                                     sandbox_env_vars=sandbox_env_vars)
    result = await sandbox.run(agent_state=agent_state)

Nothing here imports Letta: tools, configs, requirements and agent states are read by their
attributes. The README lists what differs from Letta's sandbox on purpose.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._config import make_config
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._exceptions import ConfigError, EnvSetupError, ExecutionTimeout
from kernelexec._models import ToolResult
from kernelexec._paths import within
from kernelexec.compat._letta_config import (
    TIMEOUT_ENV_VAR,
    LocalConfig,
    layered_env,
    letta_default_sandbox_dir,
    read_sandbox_config,
    requirement_line,
    requirements_txt,
    timeout_from_env,
)
from kernelexec.compat._letta_wrapper import LettaTool, read_tool
from kernelexec.compat._runner import ExecutorThread

log = logging.getLogger("kernelexec")

__all__ = [
    "TOOL_SANDBOX_TIMEOUT",
    "AsyncToolSandboxKernel",
    "ToolExecutionResult",
    "configure",
    "shutdown",
]

TOOL_SANDBOX_TIMEOUT = TIMEOUT_ENV_VAR
"""The environment variable holding the per-run timeout in seconds (Letta's
``tool_sandbox_timeout`` setting; 180 when unset). It is read at every ``run()``."""

DEFAULT_AGENT = "letta"
"""The session of runs that name no agent (no ``agent_state`` and no ``agent_id``)."""

_MAX_ERROR_CHARS = 1000  # Letta's MAX_ERROR_MESSAGE_CHAR_LIMIT
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ToolExecutionResult(BaseModel):
    """The result of a run, shaped like Letta's ``ToolExecutionResult``.

    Attributes:
        status: ``"success"`` or ``"error"``.
        func_return: The return value converted as Letta converts it (a pydantic dump, then
            JSON with ``default=str``); on an error, Letta's message
            ``"Error executing function NAME: EName: message"``.
        agent_state: The agent state after the run, as the class passed in; None when the
            tool takes no ``agent_state`` or the run failed.
        stdout: The tool's standard output as one string (empty list when there was none).
        stderr: Its standard error, with the traceback on an error (empty list when none).
        sandbox_config_fingerprint: Letta's fingerprint of the sandbox config.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    status: Literal["success", "error"]
    func_return: Any = None
    agent_state: Any = None
    stdout: list[str] = Field(default_factory=list)
    stderr: list[str] = Field(default_factory=list)
    sandbox_config_fingerprint: str | None = None

    @property
    def success_flag(self) -> bool:
        """Whether the run succeeded."""
        return self.status == "success"


_lock = threading.Lock()
_thread: ExecutorThread | None = None
_config: dict[str, Any] = {}
_roots: tuple[str, ...] | None = None


def configure(
    *, sandbox_roots: Iterable[str | os.PathLike[str]] | None = None, **config: Any
) -> None:
    """Set the process-wide executor's configuration (fields of
    :class:`~kernelexec.ExecutorConfig`: ``env_vars``, ``env_allowlist``, ``max_kernels``,
    ``prewarm``, ``idle_timeout``, ``record_dir``, ``cache_dir``, ...), and the directories
    whose ``sandbox_dir`` a tool may use as its own.

    A running executor is shut down first (its kernels and their state go); the next
    ``run()`` starts one with these settings.

    Args:
        sandbox_roots: Directories the operator means for tools (None: Letta's default,
            ``~/.letta/tool_execution_dir``). Where kernels run as users of their own, a
            ``sandbox_dir`` in one of them is lent to the agent's kernel as its own (it reads
            and edits the host user's files there, copy on write); any other ``sandbox_dir``
            is lent as any local user sees it, and must be one that any local user can reach.
        **config: ``ExecutorConfig`` fields.

    Raises:
        ConfigError: a field is unknown or invalid.
    """
    make_config(**config)
    roots = None
    if sandbox_roots is not None:
        if isinstance(sandbox_roots, str | os.PathLike):
            raise ConfigError("sandbox_roots must be a list of directories, not one path")
        roots = tuple(os.path.realpath(os.fspath(root)) for root in sandbox_roots)
    global _config, _roots
    with _lock:
        _config = dict(config)
        _roots = roots
    shutdown()


def shutdown() -> None:
    """Shut the process-wide executor and every kernel down. Idempotent; a later ``run()``
    starts a new executor. Also called at interpreter exit. Blocks until the kernels are gone.
    """
    global _thread
    with _lock:
        thread, _thread = _thread, None
    if thread is not None:
        thread.close()


def _executor() -> ExecutorThread:
    global _thread
    with _lock:
        if _thread is None:
            _thread = ExecutorThread(dict(_config))
        return _thread


atexit.register(shutdown)


class AsyncToolSandboxKernel:
    """Letta's ``AsyncToolSandboxLocal``, run in the agent's persistent kernel.

    The constructor takes what Letta's does; :meth:`run` returns a :class:`ToolExecutionResult`.

    Args:
        tool_name: The tool's name (its function's name).
        args: The arguments by name, as JSON data (strings are coerced by the function's
            annotations, as Letta does).
        user: The acting user (its ``organization_id`` enters the default config's
            fingerprint).
        tool_id: The tool's id (``LETTA_TOOL_ID`` in the tool's environment; optional, as in
            Letta releases before it was a parameter).
        agent_id: The agent's id (``LETTA_AGENT_ID``; the session when no ``agent_state``).
        project_id: ``LETTA_PROJECT_ID`` in the tool's environment.
        force_recreate_venv: Rebuild the virtual environment before this run.
        tool_object: The Letta ``Tool`` (``name``, ``source_code``, ``json_schema``,
            ``args_json_schema``, ``pip_requirements``). Required: there is no database to
            look the tool up in.
        sandbox_config: A Letta ``SandboxConfig`` of type local (None: Letta's default).
        sandbox_env_vars: Variables for the tool's environment (the lowest layer).
    """

    def __init__(
        self,
        tool_name: str,
        args: dict[str, Any],
        user: Any,
        tool_id: str | None = None,
        agent_id: str | None = None,
        project_id: str | None = None,
        force_recreate_venv: bool = False,
        tool_object: Any = None,
        sandbox_config: Any = None,
        sandbox_env_vars: dict[str, Any] | None = None,
    ) -> None:
        self.tool_name = tool_name
        self.args = args
        self.user = user
        self.tool_id = tool_id
        self.agent_id = agent_id
        self.project_id = project_id
        self.force_recreate_venv = force_recreate_venv
        self.tool = tool_object
        self.provided_sandbox_config = sandbox_config
        self.provided_sandbox_env_vars = sandbox_env_vars
        self.inject_letta_client = True
        self.inject_agent_state = False  # these three are read from the tool by run()
        self.inject_agent_id = False
        self.is_async_function = False
        self._letta_tool: LettaTool | None = None

    async def _init_async(self) -> None:
        """Read the tool (as Letta's sandbox does before it runs): sets ``inject_agent_state``,
        ``inject_agent_id`` and ``is_async_function``."""
        if self._letta_tool is None:
            if not isinstance(self.args, dict):
                raise ConfigError(f"args must be a dict, not {type(self.args).__name__}")
            self._letta_tool = read_tool(self.tool, self.tool_name)
            self.inject_agent_state = self._letta_tool.inject_agent_state
            self.inject_agent_id = self._letta_tool.inject_agent_id
            self.is_async_function = self._letta_tool.is_async

    async def run(
        self, agent_state: Any = None, additional_env_vars: dict[str, Any] | None = None
    ) -> ToolExecutionResult:
        """Run the tool in the agent's kernel.

        Args:
            agent_state: The agent's state: injected when the function takes ``agent_state``
                (changes come back in the result as the same class), its secrets join the
                environment, its ``id`` picks the session.
            additional_env_vars: Variables for this run (the highest layer).

        Raises:
            TimeoutError: the run took longer than ``TOOL_SANDBOX_TIMEOUT`` seconds
                (``kernelexec.ExecutionTimeout``; the kernel was interrupted, and its state
                kept when the interrupt worked).
            RuntimeError: the requirements could not be installed (``kernelexec.EnvSetupError``,
                naming the tool and its requirements).
            ValueError: a bad argument, config or tool (``kernelexec.ConfigError``).
        """
        await self._init_async()
        letta_tool = self._letta_tool
        assert letta_tool is not None
        config = read_sandbox_config(self.provided_sandbox_config, self.user)
        timeout = timeout_from_env()
        env = self._env(config, letta_tool.name)
        state_id = getattr(agent_state, "id", None)
        agent_id = str(state_id) if state_id is not None else self.agent_id
        env_vars = layered_env(
            self.provided_sandbox_env_vars,
            agent_state,
            additional_env_vars,
            {
                "LETTA_AGENT_ID": self.agent_id,
                "LETTA_PROJECT_ID": self.project_id,
                "LETTA_TOOL_ID": None if self.tool_id is None else str(self.tool_id),
            },
        )
        call_args = {"args": self.args, "sandbox_dir": config.sandbox_dir, "agent_id": agent_id}
        if letta_tool.inject_agent_state and isinstance(agent_state, BaseModel):
            # Rebuilt in the kernel with sandbox_dir and the run's PYTHONPATH on sys.path,
            # where Letta's script would import it from (the kernel side tries before those
            # are in place).
            cls = type(agent_state)
            call_args["state_class"] = f"{cls.__module__}:{cls.__qualname__}"
        runner = _executor()
        result = await runner.run(
            _call,
            runner.executor,
            letta_tool,
            call_args,
            agent_id or DEFAULT_AGENT,
            env,
            agent_state if letta_tool.inject_agent_state else None,
            env_vars,
            timeout,
            self.force_recreate_venv,
            config.sandbox_dir,
        )
        return _letta_result(result, letta_tool, config, timeout, env)

    def _env(self, config: LocalConfig, name: str) -> LocalEnv | VenvEnv:
        if not config.use_venv:
            return LocalEnv()
        lines = list(config.requirements)
        if config.sandbox_dir is not None:
            lines += requirements_txt(config.sandbox_dir)
        lines += [
            requirement_line(r, f"tool {name!r} pip_requirements")
            for r in getattr(self.tool, "pip_requirements", None) or []
        ]
        try:
            return _venv(tuple(lines))
        except ValueError as exc:
            raise EnvSetupError(
                f"Failed to install pip requirements for tool {name!r} ({', '.join(lines)}): {exc}"
            ) from None


@functools.lru_cache(maxsize=64)
def _venv(lines: tuple[str, ...]) -> VenvEnv:
    """One ``VenvEnv`` per set of requirement lines: parsed and fingerprinted (local files
    hashed) once, as the executor does for tools' own requirements."""
    return VenvEnv(requirements=lines)


async def _call(
    executor: AsyncKernelExecutor,
    letta_tool: LettaTool,
    call_args: dict[str, Any],
    agent: str,
    env: LocalEnv | VenvEnv,
    agent_state: Any,
    env_vars: dict[str, str],
    timeout: float,
    recreate: bool,
    sandbox_dir: str | None,
) -> ToolResult:
    """One run, on the executor's loop."""
    if recreate and isinstance(env, VenvEnv):
        try:
            await _recreate(executor, env, agent)
        except EnvSetupError as exc:
            reqs = ", ".join(env.requirements)
            raise EnvSetupError(
                f"Failed to install pip requirements for tool {letta_tool.name!r} ({reqs}): {exc}"
            ) from None
    await _lend(executor, agent, env, sandbox_dir, env_vars.get("PYTHONPATH", ""))
    return await executor.call_tool(
        letta_tool.tool,
        call_args,
        agent_id=agent,
        env=env,
        agent_state=agent_state,
        env_vars=env_vars,
        timeout=timeout,
    )


async def _lend(
    executor: AsyncKernelExecutor,
    agent: str,
    env: LocalEnv | VenvEnv,
    sandbox_dir: str | None,
    pythonpath: str,
) -> None:
    """Let the agent's kernels reach ``sandbox_dir`` and the run's ``PYTHONPATH``, as Letta's
    script (run as the host's user) does, where kernels run as users of their own: the
    directory copy on write (the agent's changes kept in its session, the host's directory
    untouched), as the kernel's own in one of the sandbox roots, else as any local user sees
    it; the import paths read-only, as any local user sees them. Where kernels run as the host's
    user nothing is mounted, and they work in ``sandbox_dir`` itself, as Letta's tools do."""
    lease = (await executor.session(agent, env)).lease
    if sandbox_dir is not None:
        own = await asyncio.to_thread(_made_if_own, sandbox_dir)
        try:
            await lease.lend(sandbox_dir, mode="own" if own else "copy")
        except ConfigError as exc:
            raise ConfigError(
                f"{exc}; to let tools use it as their own, name it (or a directory above it) "
                "in kernelexec.compat.letta.configure(sandbox_roots=[...])"
            ) from None
    for entry in pythonpath.split(os.pathsep):
        if entry and os.path.isabs(entry):
            # One it may not lend (not a directory, the executor's own, the sandbox's own
            # /proc and the like, one out of other users' reach) stays as the kernel sees it,
            # as a missing entry would: a PYTHONPATH names many directories, most of them
            # there for the host, and a tool that needs one fails on its import, by name.
            try:
                await lease.lend(entry, mode="read")
            except ConfigError as exc:
                log.warning("agent %s: PYTHONPATH entry %s not lent: %s", agent, entry, exc)


def _made_if_own(sandbox_dir: str) -> bool:
    """Whether ``sandbox_dir`` lies in one of the sandbox roots; made then if missing (Letta
    makes its sandbox_dir; here only where the operator means it for tools)."""
    roots = _roots if _roots is not None else (os.path.realpath(letta_default_sandbox_dir()),)
    real = os.path.realpath(sandbox_dir)
    if not any(within(real, root) for root in roots):
        return False
    os.makedirs(real, exist_ok=True)
    return True


async def _recreate(executor: AsyncKernelExecutor, env: VenvEnv, agent: str) -> None:
    """Rebuild ``env`` from nothing and give the agent's session a kernel from the new one."""
    target = executor.builder.target(env, env.fingerprint)
    if target.exists():
        # Renamed first, so the venv vanishes at once and a half-deleted one is never used.
        stale = target.with_name(f".stale-{target.name}-{uuid.uuid4().hex[:8]}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    await executor.builder.ensure(env)  # the pool of this env exists already: it will not
    session = await executor.session(agent, env)
    if session.has_kernel:
        await session.restart()


_JSON_KEY = "__kx_letta_json__"  # _letta_kernel's carrier for values with NaN or infinities


def _decoded(value: Any) -> Any:
    """A return value as Letta's JSON transport gives it: a value that held NaN or an infinity
    comes as its JSON text, decoded here (floats stay floats)."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(_JSON_KEY), str):
        return json.loads(value[_JSON_KEY])
    return value


def _letta_result(
    result: ToolResult,
    letta_tool: LettaTool,
    config: LocalConfig,
    timeout: float,
    env: LocalEnv | VenvEnv,
) -> ToolExecutionResult:
    error = result.error
    stdout = [result.stdout] if result.stdout else []
    if error is None:
        return ToolExecutionResult(
            status="success",
            func_return=_decoded(result.func_return),
            agent_state=result.agent_state if letta_tool.inject_agent_state else None,
            stdout=stdout,
            stderr=[result.stderr] if result.stderr else [],
            sandbox_config_fingerprint=config.fingerprint,
        )
    name = letta_tool.name
    if error.kind == "timeout":
        message = f"Executing tool {name} timed out after {timeout} seconds ({error.evalue})."
        raise ExecutionTimeout(
            result.model_copy(update={"error": error.model_copy(update={"evalue": message})})
        )
    if error.kind == "env_setup_failed":
        reqs = ", ".join(env.requirements) if isinstance(env, VenvEnv) else ""
        raise EnvSetupError(
            f"Failed to install pip requirements for tool {name!r} ({reqs}): {error.evalue}"
        )
    friendly = f"Error executing function {name}: {error.ename}: {error.evalue}"
    trace = "\n".join(_ANSI.sub("", line) for line in error.traceback)
    if f"{error.ename}: " not in trace:
        trace = f"{trace}\n{error.ename}: {error.evalue}".lstrip("\n")
    stderr = result.stderr + trace
    return ToolExecutionResult(
        status="error",
        func_return=friendly[:_MAX_ERROR_CHARS],
        agent_state=None,
        stdout=stdout,
        stderr=[stderr] if stderr else [],
        sandbox_config_fingerprint=config.fingerprint,
    )
