"""kernelexec: run AI-agent tools and code in persistent Jupyter kernels.

The async core is :class:`AsyncKernelExecutor` / :class:`AsyncSession`; :class:`KernelExecutor` /
:class:`Session` are their blocking twins. Tools are :class:`Tool` values; runs return
:class:`Execution` and :class:`ToolResult`. Every exception derives from
:class:`KernelExecError`.
"""

import importlib as _importlib
import typing as _typing
from importlib import metadata as _metadata

from kernelexec import _public

if _typing.TYPE_CHECKING:  # the public names, one a line (kernelexec._public.exports)
    from kernelexec._assembly._executor import AsyncKernelExecutor as AsyncKernelExecutor
    from kernelexec._branching._family import AsyncSnapshot as AsyncSnapshot
    from kernelexec._config import ExecutorConfig as ExecutorConfig
    from kernelexec._config import ExecutorOptions as ExecutorOptions
    from kernelexec._core._session import AsyncSession as AsyncSession
    from kernelexec._envs._builder import BuiltEnv as BuiltEnv
    from kernelexec._envs._builder import EnvBuilder as EnvBuilder
    from kernelexec._envs._builder import EnvProgress as EnvProgress
    from kernelexec._envs._envs import LocalEnv as LocalEnv
    from kernelexec._envs._envs import VenvEnv as VenvEnv
    from kernelexec._exceptions import AgentBusyError as AgentBusyError
    from kernelexec._exceptions import BackgroundTaskError as BackgroundTaskError
    from kernelexec._exceptions import BranchError as BranchError
    from kernelexec._exceptions import BranchingNotSupportedError as BranchingNotSupportedError
    from kernelexec._exceptions import CheckpointTooLargeError as CheckpointTooLargeError
    from kernelexec._exceptions import ConfigError as ConfigError
    from kernelexec._exceptions import EnvSetupError as EnvSetupError
    from kernelexec._exceptions import ExecutionError as ExecutionError
    from kernelexec._exceptions import ExecutionTimeout as ExecutionTimeout
    from kernelexec._exceptions import ExecutorClosedError as ExecutorClosedError
    from kernelexec._exceptions import FileTransferError as FileTransferError
    from kernelexec._exceptions import HostLimitError as HostLimitError
    from kernelexec._exceptions import KernelExecError as KernelExecError
    from kernelexec._exceptions import KernelStartError as KernelStartError
    from kernelexec._exceptions import NotebookError as NotebookError
    from kernelexec._exceptions import PathRefusedError as PathRefusedError
    from kernelexec._exceptions import PoolExhaustedError as PoolExhaustedError
    from kernelexec._exceptions import RequirementsMissingError as RequirementsMissingError
    from kernelexec._exceptions import SessionFileError as SessionFileError
    from kernelexec._exceptions import SetupCodeError as SetupCodeError
    from kernelexec._exceptions import StateError as StateError
    from kernelexec._exceptions import ToolDefinitionError as ToolDefinitionError
    from kernelexec._exceptions import ToolSchemaWarning as ToolSchemaWarning
    from kernelexec._exceptions import TreeLimitError as TreeLimitError
    from kernelexec._files._blocking import BlockingBackgroundCommand as BlockingBackgroundCommand
    from kernelexec._files._blocking import BlockingFileReader as BlockingFileReader
    from kernelexec._files._blocking import BlockingFileWriter as BlockingFileWriter
    from kernelexec._files._blocking import SessionCommands as SessionCommands
    from kernelexec._files._blocking import SessionFiles as SessionFiles
    from kernelexec._files._commands import AsyncSessionCommands as AsyncSessionCommands
    from kernelexec._files._commands import BackgroundCommand as BackgroundCommand
    from kernelexec._files._commands import CommandResult as CommandResult
    from kernelexec._files._session import AsyncSessionFiles as AsyncSessionFiles
    from kernelexec._files._session import FileReader as FileReader
    from kernelexec._files._session import FileWriter as FileWriter
    from kernelexec._files._wire import FileInfo as FileInfo
    from kernelexec._models import DEFAULT_ENV_ALLOWLIST as DEFAULT_ENV_ALLOWLIST
    from kernelexec._models import ExecError as ExecError
    from kernelexec._models import Execution as Execution
    from kernelexec._models import HibernatedAgent as HibernatedAgent
    from kernelexec._models import Hibernation as Hibernation
    from kernelexec._models import HostCall as HostCall
    from kernelexec._models import HostCallContext as HostCallContext
    from kernelexec._models import Isolation as Isolation
    from kernelexec._models import Limits as Limits
    from kernelexec._models import Restored as Restored
    from kernelexec._models import StateChanges as StateChanges
    from kernelexec._models import ToolResult as ToolResult
    from kernelexec._models import Variable as Variable
    from kernelexec._replay import CellDifference as CellDifference
    from kernelexec._replay import ReplayReport as ReplayReport
    from kernelexec._replay import areplay as areplay
    from kernelexec._sync import KernelExecutor as KernelExecutor
    from kernelexec._sync import Session as Session
    from kernelexec._sync import Snapshot as Snapshot
    from kernelexec._sync import replay as replay
    from kernelexec._tools._tool import Tool as Tool

# The one list of public names is the block above: type checkers read its imports, and the
# package imports each name from its module on first use (PEP 562), so that `kernelexec --help`
# or `import kernelexec` does not pay for the whole library (1.4 s).
_EXPORTS: dict[str, str] = _public.exports(__file__)
"""Each public name and the module it lives in, read from the block above."""


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


__all__ = sorted([*_EXPORTS, "__version__", "load_ipython_extension", "unload_ipython_extension"])
