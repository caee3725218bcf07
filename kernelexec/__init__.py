"""kernelexec: run AI-agent tools and code in persistent Jupyter kernels.

The async core is :class:`AsyncKernelExecutor` / :class:`AsyncSession`; :class:`KernelExecutor` /
:class:`Session` are their blocking twins. Tools are :class:`Tool` values; runs return
:class:`Execution` and :class:`ToolResult`. Every exception derives from
:class:`KernelExecError`.
"""

import importlib as _importlib
import typing as _typing
from importlib import metadata as _metadata

if _typing.TYPE_CHECKING:
    from kernelexec._branching._family import AsyncSnapshot
    from kernelexec._config import ExecutorConfig, ExecutorOptions
    from kernelexec._core._executor import AsyncKernelExecutor
    from kernelexec._core._session import AsyncSession
    from kernelexec._envs._builder import BuiltEnv, EnvBuilder, EnvProgress
    from kernelexec._envs._envs import LocalEnv, VenvEnv
    from kernelexec._exceptions import (
        AgentBusyError,
        BackgroundTaskError,
        BranchError,
        BranchingNotSupportedError,
        CheckpointTooLargeError,
        ConfigError,
        EnvSetupError,
        ExecutionError,
        ExecutionTimeout,
        ExecutorClosedError,
        FileTransferError,
        HostLimitError,
        KernelExecError,
        KernelStartError,
        NotebookError,
        PathRefusedError,
        PoolExhaustedError,
        RequirementsMissingError,
        SessionFileError,
        SetupCodeError,
        StateError,
        ToolDefinitionError,
        ToolSchemaWarning,
        TreeLimitError,
    )
    from kernelexec._files._blocking import (
        BlockingBackgroundCommand,
        BlockingFileReader,
        BlockingFileWriter,
        SessionCommands,
        SessionFiles,
    )
    from kernelexec._files._commands import (
        AsyncSessionCommands,
        BackgroundCommand,
        CommandResult,
    )
    from kernelexec._files._session import AsyncSessionFiles, FileReader, FileWriter
    from kernelexec._files._wire import FileInfo
    from kernelexec._models import (
        DEFAULT_ENV_ALLOWLIST,
        ExecError,
        Execution,
        HibernatedAgent,
        Hibernation,
        HostCall,
        HostCallContext,
        Isolation,
        Limits,
        Restored,
        StateChanges,
        ToolResult,
        Variable,
    )
    from kernelexec._replay import CellDifference, ReplayReport, areplay
    from kernelexec._sync import KernelExecutor, Session, Snapshot, replay
    from kernelexec._tools._tool import Tool

# Public names and the module each lives in, imported on first use (PEP 562), so that
# `kernelexec --help` or `import kernelexec` does not pay for the whole library (1.4 s).
_EXPORTS: dict[str, str] = {
    "areplay": "kernelexec._replay",
    "AgentBusyError": "kernelexec._exceptions",
    "AsyncKernelExecutor": "kernelexec._core._executor",
    "AsyncSession": "kernelexec._core._session",
    "AsyncSessionCommands": "kernelexec._files._commands",
    "AsyncSessionFiles": "kernelexec._files._session",
    "AsyncSnapshot": "kernelexec._branching._family",
    "BackgroundCommand": "kernelexec._files._commands",
    "BackgroundTaskError": "kernelexec._exceptions",
    "BlockingBackgroundCommand": "kernelexec._files._blocking",
    "BlockingFileReader": "kernelexec._files._blocking",
    "BlockingFileWriter": "kernelexec._files._blocking",
    "BranchError": "kernelexec._exceptions",
    "BranchingNotSupportedError": "kernelexec._exceptions",
    "BuiltEnv": "kernelexec._envs._builder",
    "CellDifference": "kernelexec._replay",
    "CheckpointTooLargeError": "kernelexec._exceptions",
    "CommandResult": "kernelexec._files._commands",
    "ConfigError": "kernelexec._exceptions",
    "DEFAULT_ENV_ALLOWLIST": "kernelexec._models",
    "EnvBuilder": "kernelexec._envs._builder",
    "EnvProgress": "kernelexec._envs._builder",
    "EnvSetupError": "kernelexec._exceptions",
    "ExecError": "kernelexec._models",
    "Execution": "kernelexec._models",
    "ExecutionError": "kernelexec._exceptions",
    "ExecutionTimeout": "kernelexec._exceptions",
    "ExecutorClosedError": "kernelexec._exceptions",
    "ExecutorConfig": "kernelexec._config",
    "ExecutorOptions": "kernelexec._config",
    "FileInfo": "kernelexec._files._wire",
    "FileReader": "kernelexec._files._session",
    "FileTransferError": "kernelexec._exceptions",
    "FileWriter": "kernelexec._files._session",
    "HibernatedAgent": "kernelexec._models",
    "Hibernation": "kernelexec._models",
    "HostCall": "kernelexec._models",
    "HostCallContext": "kernelexec._models",
    "HostLimitError": "kernelexec._exceptions",
    "Isolation": "kernelexec._models",
    "KernelExecError": "kernelexec._exceptions",
    "KernelExecutor": "kernelexec._sync",
    "KernelStartError": "kernelexec._exceptions",
    "Limits": "kernelexec._models",
    "LocalEnv": "kernelexec._envs._envs",
    "NotebookError": "kernelexec._exceptions",
    "PathRefusedError": "kernelexec._exceptions",
    "PoolExhaustedError": "kernelexec._exceptions",
    "replay": "kernelexec._sync",
    "ReplayReport": "kernelexec._replay",
    "RequirementsMissingError": "kernelexec._exceptions",
    "Restored": "kernelexec._models",
    "StateChanges": "kernelexec._models",
    "Variable": "kernelexec._models",
    "Session": "kernelexec._sync",
    "SessionCommands": "kernelexec._files._blocking",
    "SessionFileError": "kernelexec._exceptions",
    "SessionFiles": "kernelexec._files._blocking",
    "SetupCodeError": "kernelexec._exceptions",
    "Snapshot": "kernelexec._sync",
    "StateError": "kernelexec._exceptions",
    "Tool": "kernelexec._tools._tool",
    "ToolDefinitionError": "kernelexec._exceptions",
    "ToolResult": "kernelexec._models",
    "ToolSchemaWarning": "kernelexec._exceptions",
    "TreeLimitError": "kernelexec._exceptions",
    "VenvEnv": "kernelexec._envs._envs",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelexec' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


try:
    __version__ = _metadata.version("kernelexec")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext kernelexec``: adds the ``%%tool`` and ``%tool_call`` magics."""
    from kernelexec._magics import load

    load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext kernelexec``: shuts the magics' sandbox kernel down."""
    from kernelexec._magics import unload

    unload(ipython)


__all__ = [  # noqa: RUF022 - plain sorted order, checked by a test
    "AgentBusyError",
    "AsyncKernelExecutor",
    "AsyncSession",
    "AsyncSessionCommands",
    "AsyncSessionFiles",
    "AsyncSnapshot",
    "BackgroundCommand",
    "BackgroundTaskError",
    "BlockingBackgroundCommand",
    "BlockingFileReader",
    "BlockingFileWriter",
    "BranchError",
    "BranchingNotSupportedError",
    "BuiltEnv",
    "CellDifference",
    "CheckpointTooLargeError",
    "CommandResult",
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
    "ExecutorOptions",
    "FileInfo",
    "FileReader",
    "FileTransferError",
    "FileWriter",
    "HibernatedAgent",
    "Hibernation",
    "HostCall",
    "HostCallContext",
    "HostLimitError",
    "Isolation",
    "KernelExecError",
    "KernelExecutor",
    "KernelStartError",
    "Limits",
    "LocalEnv",
    "NotebookError",
    "PathRefusedError",
    "PoolExhaustedError",
    "ReplayReport",
    "RequirementsMissingError",
    "Restored",
    "Session",
    "SessionCommands",
    "SessionFileError",
    "SessionFiles",
    "SetupCodeError",
    "Snapshot",
    "StateChanges",
    "StateError",
    "Tool",
    "ToolDefinitionError",
    "ToolResult",
    "ToolSchemaWarning",
    "TreeLimitError",
    "Variable",
    "VenvEnv",
    "__version__",
    "areplay",
    "load_ipython_extension",
    "replay",
    "unload_ipython_extension",
]
