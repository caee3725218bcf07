"""The MCP server's options (what ``kernelexec mcp`` parsed) and the ``--tools`` it loads."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernelexec._envs._envs import VenvEnv
from kernelexec._exceptions import ConfigError
from kernelexec._tools._tool import Tool

BUILTIN_TOOLS = ("run_python", "list_sessions", "reset_session", "variables")
TOKEN_ENV = "KERNELEXEC_MCP_TOKEN"
DEFAULT_IDLE_TIMEOUT = 1800.0
"""Seconds an HTTP MCP session may go without a request (the SDK's own default)."""
_FLAGS = {
    "record_dir": "record",
    "requirements": "requirement",
    "idle_timeout": "idle-timeout",
    "upstream_env": "upstream-env",
}  # field -> flag, where they differ


class McpOptions(BaseModel):
    """Settings of ``kernelexec mcp``; unknown fields are rejected.

    Attributes:
        tools: ``.py`` files (every public top-level function is a tool) and notebooks (every
            code cell tagged ``tool``).
        transport: ``"stdio"`` (one client, the process's stdin/stdout) or ``"http"``
            (streamable HTTP at ``http://HOST:PORT/mcp``).
        host: Address the HTTP server binds to.
        port: Port of the HTTP server (0: any free port, printed at start).
        token: Bearer token HTTP clients must send (None: generated and printed at start).
        record_dir: Record every session as a notebook in this directory.
        isolation: Isolation level of the kernels (``"none"``, ``"process"``, ``"bwrap"``;
            None: the backend's default).
        requirements: Run the kernels in a virtual environment with these requirements.
        timeout: Default seconds a run may take before the kernel is interrupted.
        upstream: Other MCP servers to connect to, as ``NAME=COMMAND`` (stdio); kernel code
            calls their tools as ``tools.<NAME>.<tool>``.
        upstream_env: Names of variables of the server's environment handed to every
            upstream (secrets: a command line is readable by kernels at ``"process"``).
        idle_timeout: HTTP: seconds after which an MCP session with no request is ended and
            its kernels shut down (a client that leaves without ending its session, as
            stateless clients do, holds kernels that long).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: tuple[str, ...] = ()
    transport: Literal["stdio", "http"] = "stdio"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    token: str | None = Field(None, min_length=1)
    record_dir: str | None = None
    isolation: str | None = None
    requirements: tuple[str, ...] = ()
    timeout: float | None = Field(None, gt=0)
    upstream: tuple[str, ...] = ()
    upstream_env: tuple[str, ...] = ()
    idle_timeout: float = Field(DEFAULT_IDLE_TIMEOUT, gt=0, allow_inf_nan=False)

    @classmethod
    def from_flags(cls, **flags: Any) -> McpOptions:
        """Options from the command line's values.

        Raises:
            ConfigError: a value is out of range, naming the flag.
        """
        try:
            return cls(**flags)
        except ValidationError as exc:
            problems = "; ".join(
                f"--{_FLAGS.get(str(e['loc'][0]), str(e['loc'][0]))}: {e['msg']}"
                for e in exc.errors()
            )
            raise ConfigError(problems) from None

    def executor_config(self) -> dict[str, Any]:
        """Keyword arguments for the server's :class:`~kernelexec.AsyncKernelExecutor`.

        Raises:
            ConfigError: a requirement or the isolation level is not valid here.
        """
        config: dict[str, Any] = {}
        if self.timeout is not None:
            config["default_timeout"] = self.timeout
        if self.record_dir is not None:
            config["record_dir"] = self.record_dir
        if self.requirements:
            try:
                config["env"] = VenvEnv(requirements=self.requirements)
            except ValueError as exc:
                raise ConfigError(f"bad requirement: {exc}") from None
        if self.isolation is not None:
            config["isolation"] = self.isolation
        return config


def load_tools(paths: tuple[str, ...]) -> list[Tool]:
    """The tools of ``--tools`` files, checked for clashing names.

    Raises:
        ConfigError: a file is unreadable or defines no valid tool, or two tools (or a tool
            and a built-in one) share a name.
    """
    tools: dict[str, Tool] = {}
    for path in paths:
        found = Tool.from_notebook(path) if path.endswith(".ipynb") else _file_tools(path)
        if not found:
            raise ConfigError(f"--tools {path}: defines no tool")
        for tool in found:
            if tool.name in BUILTIN_TOOLS:
                raise ConfigError(f"--tools {path}: {tool.name!r} is the name of a built-in tool")
            if tool.name in tools:
                raise ConfigError(f"--tools {path}: a second tool named {tool.name!r}")
            tools[tool.name] = tool
    return list(tools.values())


def _file_tools(path: str) -> list[Tool]:
    try:
        source = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--tools {path}: cannot read it: {exc.strerror}") from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise ConfigError(f"--tools {path}: does not parse: {exc}") from None
    names = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not node.name.startswith("_")
    ]
    tools = []
    for name in names:
        try:
            tools.append(Tool.from_source(source, name=name))
        except ConfigError as exc:
            raise ConfigError(f"--tools {path}: {exc}") from None
    return tools
