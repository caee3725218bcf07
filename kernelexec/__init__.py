"""kernelexec: run AI-agent tools and code in persistent Jupyter kernels.

The async core is :class:`AsyncKernelExecutor` / :class:`AsyncSession`; :class:`KernelExecutor` /
:class:`Session` are their blocking twins. Tools are :class:`Tool` values; runs return
:class:`Execution` and :class:`ToolResult`. Every exception derives from
:class:`KernelExecError`.
"""

from importlib import metadata as _metadata

from kernelexec._config import ExecutorConfig
from kernelexec._core._executor import AsyncKernelExecutor
from kernelexec._core._session import AsyncSession
from kernelexec._envs._builder import BuiltEnv, EnvBuilder, EnvProgress
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._exceptions import (
    BackgroundTaskError,
    ConfigError,
    EnvSetupError,
    ExecutionError,
    ExecutionTimeout,
    ExecutorClosedError,
    KernelExecError,
    KernelStartError,
    NotebookError,
    PoolExhaustedError,
    RequirementsMissingError,
    ToolDefinitionError,
    ToolSchemaWarning,
)
from kernelexec._models import (
    DEFAULT_ENV_ALLOWLIST,
    ExecError,
    Execution,
    Isolation,
    Limits,
    ToolResult,
)
from kernelexec._notebooks._replay import CellDifference, ReplayReport, areplay
from kernelexec._sync import KernelExecutor, Session, replay
from kernelexec._tools._tool import Tool

try:
    __version__ = _metadata.version("kernelexec")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext kernelexec``: adds the ``%%tool`` and ``%tool_call`` magics."""
    from kernelexec._notebooks._magics import load

    load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext kernelexec``: shuts the magics' sandbox kernel down."""
    from kernelexec._notebooks._magics import unload

    unload(ipython)


__all__ = [  # noqa: RUF022 - plain sorted order, checked by a test
    "AsyncKernelExecutor",
    "AsyncSession",
    "BackgroundTaskError",
    "BuiltEnv",
    "CellDifference",
    "ConfigError",
    "DEFAULT_ENV_ALLOWLIST",
    "EnvBuilder",
    "EnvProgress",
    "EnvSetupError",
    "ExecError",
    "Execution",
    "ExecutionError",
    "ExecutionTimeout",
    "ExecutorClosedError",
    "ExecutorConfig",
    "Isolation",
    "KernelExecError",
    "KernelExecutor",
    "KernelStartError",
    "Limits",
    "LocalEnv",
    "NotebookError",
    "PoolExhaustedError",
    "ReplayReport",
    "RequirementsMissingError",
    "Session",
    "Tool",
    "ToolDefinitionError",
    "ToolResult",
    "ToolSchemaWarning",
    "VenvEnv",
    "__version__",
    "areplay",
    "load_ipython_extension",
    "replay",
    "unload_ipython_extension",
]
