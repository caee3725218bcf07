"""The MCP server: its tools (``run_python``, ``list_sessions``, ``reset_session``, ``fork``,
``snapshot``, ``restore`` and every ``--tools`` tool) on the SDK's low-level server, over one
executor the server's lifespan owns.

Each request runs in a session of its client connection (``_sessions``). A run streams its
output as progress notifications; a client's cancellation interrupts the kernel, waits for the
interrupted run to end (so it is recorded, and the session's next call does not queue behind it
in the kernel) and notes the outcome on the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from kernelexec._config import make_config
from kernelexec._envs._envs import VenvEnv
from kernelexec._exceptions import ConfigError, KernelExecError
from kernelexec._mcp import _branches
from kernelexec._mcp._options import McpOptions
from kernelexec._mcp._results import (
    RunPythonResult,
    error_result,
    run_python_result,
    tool_call_result,
)
from kernelexec._mcp._sessions import ClientConnection, SessionEntry, SessionRegistry
from kernelexec._mcp._upstream import Upstream, connect_upstreams, upstream_env
from kernelexec._models import Execution
from kernelexec._observability._logtext import untrusted
from kernelexec._plaintext import strip_ansi
from kernelexec._tools._tool import Tool

if TYPE_CHECKING:
    from kernelexec._core._session import AsyncSession

log = logging.getLogger("kernelexec.mcp")

T = TypeVar("T", bound=Execution)
Context = ServerRequestContext[Any, Any]

_SESSION = {
    "type": "string",
    "description": "Session name: runs with the same name share one persistent kernel "
    "(default: this connection's own session).",
}
RUN_PYTHON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "Python code (IPython syntax allowed)."},
        "session": _SESSION,
        "timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "Seconds before the run is interrupted.",
        },
        "atomic": {
            "type": "boolean",
            "description": "All or nothing: if the run fails (an exception, a timeout), the "
            "session's variables and files are put back as they were before it.",
        },
    },
    "required": ["code"],
    "additionalProperties": False,
}
_SESSION_ONLY: dict[str, Any] = {
    "type": "object",
    "properties": {"session": _SESSION},
    "additionalProperties": False,
}
_NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ServerState:
    """What the server's lifespan yields: the tools, and once opened the sessions over its
    executor.

    Opening imports the kernel machinery (jupyter-client, zmq, nbformat, jsonschema: most of
    the server's start-up) and starts the executor. It happens on the first tool call (or at
    start when a venv must be built first), so ``initialize`` is answered without waiting for
    it. (Opening in a worker thread in the background was measured 3x slower here: 27-32 s
    against 11 s under load, for the same imports.)
    """

    def __init__(
        self,
        tools: dict[str, Tool],
        executor_config: dict[str, Any],
        exposed: dict[str, Any] | None = None,
    ) -> None:
        self.tools = tools
        self._config = executor_config
        self._exposed = exposed or {}
        self.upstream: dict[str, list[str]] = {
            module: [f.name for f in fns] for module, fns in self._exposed.items()
        }
        """The upstream MCP servers' tools by module (``--upstream``)."""
        self._lock = anyio.Lock()
        self._registry: SessionRegistry | None = None
        self._failure: KernelExecError | None = None

    @property
    def registry(self) -> SessionRegistry:
        """The sessions (only after :meth:`ready`)."""
        assert self._registry is not None, "ServerState.ready() was not awaited"
        return self._registry

    @property
    def grace(self) -> float:
        """The executor's interrupt grace, in seconds."""
        return self.registry.executor.config.interrupt_grace

    async def ready(self) -> None:
        """Open the executor if that has not been tried yet.

        Raises:
            KernelExecError: it could not be opened (the same error every time).
        """
        async with self._lock:
            if self._registry is None and self._failure is None:
                try:
                    self._registry = await _open_registry(self._config, self._exposed)
                except KernelExecError as exc:
                    log.error("the executor could not be started: %s: %s", type(exc).__name__, exc)
                    self._failure = exc
        if self._failure is not None:
            raise self._failure

    async def aclose(self) -> None:
        """Close the executor, if it was opened."""
        async with self._lock:
            registry, self._registry = self._registry, None
        if registry is not None:
            await registry.executor.aclose()
            log.info("executor closed")


async def _open_registry(
    executor_config: dict[str, Any], exposed: dict[str, Any]
) -> SessionRegistry:
    from kernelexec._assembly._executor import AsyncKernelExecutor

    executor = AsyncKernelExecutor(**executor_config)
    try:
        await executor.start()
        if isinstance(executor.env, VenvEnv):
            await executor.warm_up()  # build the venv now: a bad requirement fails at start
    except BaseException:
        with anyio.CancelScope(shield=True):
            await executor.aclose()
        raise
    return SessionRegistry(executor, exposed)


def builtin_tools() -> list[types.Tool]:
    """The tools every kernelexec MCP server has."""
    return [
        types.Tool(
            name="run_python",
            description=(
                "Run Python code in a persistent Jupyter kernel; variables, imports and "
                "definitions stay for later calls in the same session. Returns stdout, "
                "stderr, the value of the last expression, the error with its traceback, and "
                "images the code displayed."
            ),
            input_schema=RUN_PYTHON_SCHEMA,
            output_schema=RunPythonResult.model_json_schema(),
        ),
        types.Tool(
            name="list_sessions",
            description="The sessions this client can use, whether their kernel is alive, and "
            "how their last run ended.",
            input_schema=_NO_ARGS,
        ),
        types.Tool(
            name="variables",
            description="The variables a session's code has defined: name, type, a short "
            "summary of the value and its size.",
            input_schema=_SESSION_ONLY,
        ),
        types.Tool(
            name="reset_session",
            description="Replace a session's kernel with a fresh one (all its state is lost).",
            input_schema=_SESSION_ONLY,
        ),
    ]


def build_server(options: McpOptions, tools: list[Tool]) -> Server[ServerState]:
    """The MCP server for ``options``; its lifespan starts and closes the executor."""
    by_name = {tool.name: tool for tool in tools}
    listed = (
        builtin_tools()
        + _branches.branch_tools()
        + [
            types.Tool(name=t.name, description=t.description, input_schema=t.parameters_schema)
            for t in tools
        ]
    )
    executor_config = options.executor_config()
    make_config(**executor_config)  # a bad value is refused now, not when the first client comes
    upstreams = tuple(Upstream.parse(text) for text in options.upstream)
    env = upstream_env(options.upstream_env)  # a missing variable is refused now

    @asynccontextmanager
    async def lifespan(_: Server[ServerState]) -> AsyncIterator[ServerState]:
        async with connect_upstreams(upstreams, timeout=None, env=env) as exposed:
            state = ServerState(by_name, executor_config, exposed)
            try:
                if isinstance(executor_config.get("env"), VenvEnv):
                    await state.ready()  # the venv is built before serving: a bad one stops it
                yield state
            finally:
                with anyio.CancelScope(shield=True):
                    await state.aclose()

    async def list_tools(
        ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        state: ServerState = ctx.lifespan_context
        if not state.upstream:
            return types.ListToolsResult(tools=listed)
        modules = "; ".join(f"{m}: {', '.join(names)}" for m, names in state.upstream.items())
        run_python = listed[0].model_copy(
            update={
                "description": f"{listed[0].description} The code can call the tools of other "
                f"MCP servers as functions (`from tools.NAME import tool`; help() shows each "
                f"one's signature): {modules}."
            }
        )
        return types.ListToolsResult(tools=[run_python, *listed[1:]])

    async def call_tool(ctx: Context, params: types.CallToolRequestParams) -> types.CallToolResult:
        state: ServerState = ctx.lifespan_context
        args = params.arguments or {}
        try:
            await state.ready()
        except KernelExecError as exc:
            message = f"the server could not start its kernels: {type(exc).__name__}: {exc}"
            return error_result(message, kind="unavailable")
        try:
            if params.name == "run_python":
                return await _run_python(ctx, state, args)
            if params.name == "list_sessions":
                _check(args, _NO_ARGS)
                return _list_sessions(ctx, state)
            if params.name == "variables":
                _check(args, _SESSION_ONLY)
                return await _variables(ctx, state, args.get("session"))
            if params.name == "reset_session":
                _check(args, _SESSION_ONLY)
                return await _reset_session(ctx, state, args.get("session"))
            if params.name in ("fork", "snapshot", "restore"):
                return await _branch(ctx, state, params.name, args)
            tool = state.tools.get(params.name)
            if tool is None:
                # Not a tool's failure but a request for a tool that does not exist: the spec
                # makes that a protocol error.
                raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}")
            return await _call_tool(ctx, state, tool, args)
        except ConfigError as exc:
            return error_result(str(exc))
        except KernelExecError as exc:
            log.warning(
                "%s failed: %s: %s", untrusted(params.name), type(exc).__name__, untrusted(exc)
            )
            return error_result(f"{type(exc).__name__}: {exc}", kind="unavailable")

    return Server(
        "kernelexec",
        instructions="Run Python in persistent, recorded Jupyter kernels.",
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _branch(
    ctx: Context, state: ServerState, name: str, args: dict[str, Any]
) -> types.CallToolResult:
    client = client_of(ctx, state)
    registry = state.registry
    session = args.get("session")
    if name == "fork":
        _check(args, _branches.FORK_SCHEMA)
        return await _branches.fork(client, registry, session, int(args.get("n", 1)))
    if name == "snapshot":
        _check(args, _branches.SNAPSHOT_SCHEMA)
        return await _branches.snapshot(client, registry, session)
    _check(args, _branches.RESTORE_SCHEMA)
    try:
        return await _branches.restore(client, registry, session, args["snapshot"])
    except (LookupError, ValueError) as exc:
        return error_result(str(exc))


def _check(args: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming what in ``args`` does not fit ``schema``."""
    import jsonschema  # imported with the kernel machinery, on the first call

    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(args)
    )
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path)
        raise ConfigError(f"argument {where!r}: {error.message}" if where else error.message)


def client_of(ctx: Context, state: ServerState) -> ClientConnection:
    """The client connection ``ctx`` came on, created (and set to close its sessions when
    the connection ends) on its first request."""
    # The SDK keeps per-connection state and teardown on its Connection; ServerRequestContext
    # does not expose it yet, so it is read from the request's ServerSession.
    connection = ctx.session._connection
    client: ClientConnection | None = connection.state.get("kernelexec")
    if client is None:
        client = state.registry.connect()
        connection.state["kernelexec"] = client
        connection.exit_stack.push_async_callback(client.aclose)
        log.info("client connection %s opened", client.id)
    return client


async def _run_python(
    ctx: Context, state: ServerState, args: dict[str, Any]
) -> types.CallToolResult:
    _check(args, RUN_PYTHON_SCHEMA)
    client = client_of(ctx, state)
    name, entry = client.resolve(args.get("session"))
    session = await state.registry.session(entry)
    code: str = args["code"]
    timeout: float | None = args.get("timeout")
    atomic = bool(args.get("atomic", False))
    stream = _Streamer(ctx)
    execution, cancelled = await _guarded(
        entry,
        session,
        state.grace,
        lambda: session.run_code(
            code,
            timeout=timeout,
            on_stdout=stream.stdout,
            on_stderr=stream.stderr,
            atomic=atomic,
        ),
    )
    return run_python_result(execution, name, cancelled=cancelled)


async def _call_tool(
    ctx: Context, state: ServerState, tool: Tool, args: dict[str, Any]
) -> types.CallToolResult:
    client = client_of(ctx, state)
    name, entry = client.resolve(None)
    executor = state.registry.executor
    session = await executor.session(entry.agent_id, executor.env_for(tool))
    stream = _Streamer(ctx)
    result, _ = await _guarded(
        entry,
        session,
        state.grace,
        lambda: session.call_tool(tool, args, on_stdout=stream.stdout, on_stderr=stream.stderr),
    )
    return tool_call_result(result, name)


async def _guarded(
    entry: SessionEntry,
    session: AsyncSession,
    grace: float,
    start: Callable[[], Awaitable[T]],
) -> tuple[T, bool]:
    """Run one call on ``entry``'s session; on cancellation interrupt the kernel, wait (up to
    the interrupt grace and a little more) for the run to end, note it, and re-raise."""
    entry.use(session)
    async with entry.lock:
        entry.runs += 1
        task = asyncio.ensure_future(start())
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await _interrupt_and_wait(session, task, grace + 1.0)
            outcome = "cancelled by the client; the kernel was interrupted"
            if task.done() and not task.cancelled() and task.exception() is None:
                outcome += f" ({_outcome(task.result())})"
            entry.last_outcome = entry.last_cancelled = outcome
            entry.cancelled += 1
            log.info("run in session %s cancelled by the client", entry.agent_id)
            raise
        entry.last_outcome = _outcome(result)
        return result, False


async def _interrupt_and_wait(
    session: AsyncSession, task: asyncio.Future[Any], wait: float
) -> None:
    await session.interrupt()
    with anyio.move_on_after(wait):
        await asyncio.wait({task})
    if not task.done():
        # It ignores the interrupt: stop waiting (the run loop interrupts once more); the
        # session's next call finds the kernel busy and its timeout replaces the kernel.
        task.cancel()
        await asyncio.wait({task})


def _outcome(result: Execution) -> str:
    if result.error is None:
        return "success"
    return f"error ({result.error.kind}): {result.error.ename}: {result.error.evalue}"


class _Streamer:
    """Output of a running call sent to the client as progress notifications."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._count = 0

    async def stdout(self, text: str) -> None:
        await self._send(text)

    async def stderr(self, text: str) -> None:
        await self._send(f"[stderr] {text}")

    async def _send(self, message: str) -> None:
        self._count += 1
        # If the client went away the run goes on (and is recorded) without its audience.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            await self._ctx.session.report_progress(self._count, None, message)


def _list_sessions(ctx: Context, state: ServerState) -> types.CallToolResult:
    client = client_of(ctx, state)
    rows = []
    for entry in state.registry.visible_to(client.id):
        alive = any(s.has_kernel for s in entry.sessions)
        rows.append(
            {
                "session": client.shown_name(entry),
                "default": entry.agent_id == client.default_agent,
                "clients": len(entry.users),
                "kernel_alive": alive,
                "busy": entry.lock.locked(),
                "runs": entry.runs,
                "last_outcome": entry.last_outcome,
                "cancelled_runs": entry.cancelled,
                "last_cancelled": entry.last_cancelled,
            }
        )
    lines = [
        f"{r['session']}: {'kernel alive' if r['kernel_alive'] else 'no kernel'}, "
        f"{r['runs']} run(s), {r['clients']} client(s)"
        + (", busy" if r["busy"] else "")
        + (f", last: {r['last_outcome']}" if r["last_outcome"] else "")
        + (f", last cancelled: {r['last_cancelled']}" if r["cancelled_runs"] else "")
        for r in rows
    ]
    return types.CallToolResult(
        content=[types.TextContent(type="text", text="\n".join(lines) or "no sessions yet")],
        structured_content={"sessions": rows},
    )


async def _variables(ctx: Context, state: ServerState, name: str | None) -> types.CallToolResult:
    client = client_of(ctx, state)
    shown, entry = client.resolve(name)
    session = await state.registry.session(entry)
    async with entry.lock:
        found = await session.variables()
    lines = [
        f"{v.name}: {v.type} = {strip_ansi(v.summary)}"
        + (f" ({v.size_bytes} bytes)" if v.size_bytes is not None else "")
        for v in found
    ]
    return types.CallToolResult(
        content=[types.TextContent(type="text", text="\n".join(lines) or "no variables")],
        structured_content={
            "session": shown,
            "variables": [v.model_dump(mode="json") for v in found],
        },
    )


async def _reset_session(
    ctx: Context, state: ServerState, name: str | None
) -> types.CallToolResult:
    client = client_of(ctx, state)
    shown, entry = client.resolve(name)
    await state.registry.session(entry)
    async with entry.lock:
        for s in entry.sessions:
            await s.restart()
        entry.last_outcome = "reset: fresh kernel"
    text = f"session {shown!r}: its kernel was replaced; all state is gone"
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)],
        structured_content={"session": shown, "reset": True},
    )
