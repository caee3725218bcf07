"""Running the MCP server: over stdio, or over streamable HTTP behind a bearer-token check.

Shutdown is where kernels leak, so both paths close the executor themselves: over stdio when
the client closes stdin or on SIGTERM/SIGINT (the SDK's stdio client SIGTERMs the server 2 s
after closing stdin, and kernels run in their own process sessions, out of reach of that
signal); over HTTP in the Starlette lifespan, because uvicorn re-raises the signal after its
graceful shutdown and nothing after ``serve()`` would run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import stat
import sys
from collections.abc import Iterator

import anyio
import uvicorn
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from starlette.types import ASGIApp, Receive, Scope, Send

from kernelexec._exceptions import ConfigError
from kernelexec._mcp._options import TOKEN_ENV, McpOptions, load_tools
from kernelexec._mcp._server import ServerState, build_server

log = logging.getLogger("kernelexec.mcp")

MCP_PATH = "/mcp"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class BearerAuth:
    """ASGI middleware answering 401 to any HTTP request without ``Authorization: Bearer
    <token>``, before the MCP app (and so any session or kernel) sees it."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = b""
            for key, value in scope.get("headers", []):
                if key == b"authorization":
                    given = value
            if not secrets.compare_digest(given, self._expected):
                client = scope.get("client") or ("?", 0)
                log.warning("refused a request from %s: missing or wrong bearer token", client[0])
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    body = b'{"error": "invalid_token", "error_description": "missing or wrong bearer token"}'
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="kernelexec", error="invalid_token"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def resolve_token(options: McpOptions) -> tuple[str, str]:
    """The bearer token and where it came from (``--token``, the environment, generated)."""
    if options.token:
        return options.token, "--token"
    from_env = os.environ.get(TOKEN_ENV)
    if from_env:
        return from_env, f"${TOKEN_ENV}"
    return secrets.token_urlsafe(32), "generated"


def serve(options: McpOptions) -> None:
    """Run the server until its client goes away (stdio) or it is stopped (HTTP).

    Raises:
        ConfigError: an option or a ``--tools`` file is invalid (before anything starts).
    """
    tools = load_tools(options.tools)
    server = build_server(options, tools)
    sock = _listen(options) if options.transport == "http" else None
    # Only now, past every check of the options, does this process become the server.
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="kernelexec mcp: %(message)s", force=True
    )
    for noisy in ("mcp", "uvicorn", "httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if tools:
        log.info("tools from --tools: %s", ", ".join(t.name for t in tools))
    if sock is None:
        anyio.run(_serve_stdio, server)
    else:
        _serve_http(server, options, sock)


async def _serve_stdio(server: Server[ServerState]) -> None:
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        log.info("serving MCP over stdio (pid %d)", os.getpid())
        with _PipeLines.for_stdin() as stdin:
            async with stdio_server(stdin=stdin) as (read, write):  # type: ignore[arg-type]
                await server.run(read, write, server.create_initialization_options())
        log.info("the client closed the connection")
        tg.cancel_scope.cancel()


class _PipeLines:
    """stdin as async lines, read on the event loop instead of in a worker thread.

    The SDK reads stdin in a thread, which no cancellation can stop: after a SIGTERM the
    executor closed but the process stayed, blocked on a read of a pipe the client kept open.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""

    @classmethod
    @contextlib.contextmanager
    def for_stdin(cls) -> Iterator[_PipeLines | None]:
        """Lines of fd 0 if it is a pipe or socket (what MCP clients give), else None (the
        SDK's own reader)."""
        try:
            mode = os.fstat(0).st_mode
        except OSError:
            mode = 0
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            yield None
            return
        was_blocking = os.get_blocking(0)
        os.set_blocking(0, False)
        try:
            yield cls(0)
        finally:
            with contextlib.suppress(OSError):
                os.set_blocking(0, was_blocking)

    def __aiter__(self) -> _PipeLines:
        return self

    async def __anext__(self) -> str:
        while b"\n" not in self._buffer:
            await anyio.wait_readable(self._fd)
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                if not self._buffer:
                    raise StopAsyncIteration
                line, self._buffer = self._buffer, b""
                return line.decode("utf-8", errors="replace")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace") + "\n"


def _listen(options: McpOptions) -> socket.socket:
    """A listening socket at ``--host``/``--port``.

    Raises:
        ConfigError: the address cannot be bound (in use, not local, ...).
    """
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio turns Nagle off only on accepted sockets whose proto says TCP,
    # as it does for the sockets it makes itself (A/B with 4 ms handlers: no difference seen).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host, options.port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"--host/--port: cannot listen on {options.host}:{options.port}: {exc.strerror}"
        ) from None
    sock.listen(128)  # clients that connect before uvicorn is up wait in the backlog
    return sock


def _serve_http(server: Server[ServerState], options: McpOptions, sock: socket.socket) -> None:
    token, source = resolve_token(options)
    if options.host not in _LOOPBACK:
        log.warning(
            "binding to %s: anyone who can reach this address and has the token can run code "
            "as this user",
            options.host,
        )
    app = BearerAuth(
        server.streamable_http_app(host=options.host, session_idle_timeout=options.idle_timeout),
        token,
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info(
        "serving MCP over streamable HTTP at http://%s:%d%s (pid %d)",
        shown,
        port,
        MCP_PATH,
        os.getpid(),
    )
    if source == "generated":
        # Shown to the operator on the terminal, never as a log record (records get shipped).
        print(
            f"kernelexec: bearer token (send 'Authorization: Bearer <token>'): {token}",
            file=sys.stderr,
            flush=True,
        )
    else:
        log.info("bearer token from %s", source)
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    uvicorn.Server(config).run(sockets=[sock])
