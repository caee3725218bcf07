"""Other MCP servers (``kernelexec mcp --upstream NAME=COMMAND``) whose tools kernel code calls.

The server connects to each upstream as an MCP client over stdio when it starts, lists its
tools, and exposes each to every session's kernel code as ``tools.<NAME>.<tool>`` (code mode:
the call runs here, on the host, and reaches the upstream over this one client connection).
The "code execution with MCP" pattern: the model writes code that calls many tools and keeps
the intermediate data in the kernel.

An upstream gets only ``PATH``, ``HOME``, ``LANG``, ``TMPDIR`` and the cache directory of the
server's environment, plus the variables the operator names (``--upstream-env NAME``): a token
passed so never appears in a command line, which kernels at ``"process"`` can read
(``/proc/<pid>/cmdline`` is readable by every user), while another user's environment is not.

Every MCP session (and every kernel) reaches the same upstream process, over this one
connection: whatever state an upstream keeps is shared by all sessions of the server.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from kernelexec._codemode._functions import HostFunction
from kernelexec._exceptions import ConfigError

log = logging.getLogger("kernelexec.mcp")

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_ENV = ("PATH", "HOME", "LANG", "TMPDIR", "KERNELEXEC_CACHE_DIR")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def upstream_env(names: tuple[str, ...]) -> dict[str, str]:
    """What every upstream's environment holds: the base variables, and ``names`` from the
    server's own environment.

    Raises:
        ConfigError: a name is not a variable name, or it is not set here.
    """
    env = {k: os.environ[k] for k in _ENV if k in os.environ}
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"--upstream-env {name!r}: not an environment variable name")
        if name not in os.environ:
            raise ConfigError(
                f"--upstream-env {name}: not set in the server's environment (set it there; "
                "never on an --upstream command line, which kernels can read)"
            )
        env[name] = os.environ[name]
    return env


class UpstreamToolError(Exception):
    """An upstream tool answered with an error (its text is the message)."""


@dataclass(frozen=True)
class Upstream:
    """One ``--upstream NAME=COMMAND``: the module name under ``tools`` and the command."""

    name: str
    command: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Upstream:
        """``NAME=COMMAND ARGS...`` (the command split as a shell would).

        Raises:
            ConfigError: no ``=``, a name that is not an identifier, or no command.
        """
        name, sep, command = text.partition("=")
        if not sep or not _NAME.fullmatch(name):
            raise ConfigError(
                f"--upstream {text!r}: expected NAME=COMMAND with NAME a Python identifier"
            )
        try:
            argv = tuple(shlex.split(command))
        except ValueError as exc:
            raise ConfigError(f"--upstream {text!r}: {exc}") from None
        if not argv:
            raise ConfigError(f"--upstream {text!r}: no command")
        return cls(name, argv)

    @property
    def module(self) -> str:
        return f"tools.{self.name}"


@asynccontextmanager
async def connect_upstreams(
    upstreams: tuple[Upstream, ...], *, timeout: float | None, env: dict[str, str] | None = None
) -> AsyncIterator[dict[str, list[HostFunction]]]:
    """Connect to every upstream, each started with ``env`` (default: :func:`upstream_env`
    of no names); yield module name -> its tools as host functions. The connections close
    (and the upstream processes end) when the context exits."""
    env = upstream_env(()) if env is None else env
    async with AsyncExitStack() as stack:
        modules: dict[str, list[HostFunction]] = {}
        for upstream in upstreams:
            command, *args = upstream.command
            params = StdioServerParameters(command=command, args=args, env=env)
            read, write = await stack.enter_async_context(stdio_client(params))
            client = await stack.enter_async_context(ClientSession(read, write))
            await client.initialize()
            listed = await client.list_tools()
            modules[upstream.module] = [
                _function(client, tool, timeout) for tool in listed.tools if _usable(tool)
            ]
            log.info(
                "upstream %s: %s",
                upstream.name,
                ", ".join(f.name for f in modules[upstream.module]) or "no tools",
            )
        yield modules


def _wraps_result(schema: Any) -> bool:
    """Whether a tool's output schema is the SDK's wrapper of a plain value: one required
    property ``result`` (its structured content is then ``{"result": value}``)."""
    if not isinstance(schema, dict):
        return False
    return set(schema.get("properties") or {}) == {"result"} and schema.get("required") == [
        "result"
    ]


def _usable(tool: types.Tool) -> bool:
    if not tool.name.isidentifier() or tool.name.startswith("_"):
        log.warning("upstream tool %r skipped: its name is not a Python identifier", tool.name)
        return False
    return True


def _function(client: ClientSession, tool: types.Tool, timeout: float | None) -> HostFunction:
    wrapped = _wraps_result(tool.output_schema)

    async def call(arguments: dict[str, Any]) -> Any:
        result = await client.call_tool(tool.name, arguments)
        if not isinstance(result, types.CallToolResult):
            raise UpstreamToolError(f"{tool.name} asked for input; code cannot answer it")
        text = "\n".join(block.text for block in result.content if block.type == "text")
        if result.is_error:
            raise UpstreamToolError(text or f"{tool.name} failed")
        content = result.structured_content
        if content is not None:
            return content["result"] if wrapped and "result" in content else content
        return text

    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {"type": "object"}
    return HostFunction.from_schema(
        tool.name, tool.description or "", schema, call, timeout=timeout
    )
