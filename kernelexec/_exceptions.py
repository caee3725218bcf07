"""The kernelexec exception tree.

Errors in user code are data on the result (``Execution.error``), not exceptions. Exceptions
mean misuse of the API or a broken environment::

    KernelExecError
    ├── ConfigError (ValueError)              bad executor or tool configuration
    │   ├── ToolDefinitionError               a Tool could not be built from what was given
    │   ├── NotebookError                     a notebook could not be read or used
    │   ├── RequirementsMissingError          a session's environment lacks a tool's requirements
    │   └── HostLimitError                    this host's limits cannot hold max_kernels
    ├── ExecutorClosedError (RuntimeError)    use after close
    ├── PoolExhaustedError (RuntimeError)     every kernel busy and max_kernels reached
    ├── KernelStartError (RuntimeError)       a kernel did not start or become ready
    ├── EnvSetupError (RuntimeError)          a virtual environment could not be built
    ├── BackgroundTaskError (RuntimeError)    background work failed (raised at close)
    ├── BranchError (RuntimeError)            a fork, snapshot or restore failed
    ├── BranchingNotSupportedError (NotImplementedError)  this backend or level cannot fork
    ├── StateError (RuntimeError)             a session's state could not be saved or restored
    │   ├── CheckpointTooLargeError           ... it passes max_checkpoint_bytes
    │   └── AgentBusyError                    ... another executor holds the agent
    ├── SetupCodeError (RuntimeError)         a session's setup_code failed (raised by hand)
    ├── PathRefusedError (ValueError)         a session file path leaves its working directory
    ├── FileTransferError (RuntimeError)      a file operation could not be carried out
    ├── TreeLimitError (OSError)              a tenant's tree passes a bound the host walks within
    ├── SessionFileError (OSError)            the kernel's file system refused an operation
    │   ├── SessionFileNotFoundError (FileNotFoundError)
    │   ├── SessionIsADirectoryError (IsADirectoryError)
    │   ├── SessionNotADirectoryError (NotADirectoryError)
    │   ├── SessionPermissionError (PermissionError)
    │   └── SessionFileExistsError (FileExistsError)
    └── ExecutionError                        raised on demand by Execution.raise_for_error()
        └── ExecutionTimeout (TimeoutError)   ... when the run timed out

Every exception survives pickling (they cross process boundaries in users' worker pools).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kernelexec._public import public

if TYPE_CHECKING:
    from kernelexec._models import Execution


class KernelExecError(Exception):
    """Base class of every exception kernelexec raises."""


class ConfigError(KernelExecError, ValueError):
    """A configuration value was rejected; the message names the field."""


class ToolDefinitionError(ConfigError):
    """A :class:`~kernelexec.Tool` could not be built (no function, unparsable source, ...)."""


class RequirementsMissingError(ConfigError):
    """A tool was called in a session whose environment does not provide the tool's
    ``pip_requirements``; the message names the environment and what is missing.

    Attributes:
        missing: The requirement lines the session's environment does not satisfy.
    """

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing

    def __reduce__(self) -> tuple[type[RequirementsMissingError], tuple[str, tuple[str, ...]]]:
        return (type(self), (str(self), self.missing))


class NotebookError(ConfigError):
    """A notebook could not be read, is not valid, or lacks what was asked of it."""


class HostLimitError(ConfigError):
    """The host cannot hold ``max_kernels`` kernels: a limit the process may not raise (the
    hard ``RLIMIT_NOFILE``) is too low. The message says how many are needed, how many the
    limit allows and what to change."""


class ExecutorClosedError(KernelExecError, RuntimeError):
    """The executor or session was used after it was closed."""


class PoolExhaustedError(KernelExecError, RuntimeError):
    """A kernel was needed but every kernel is busy and ``max_kernels`` is reached."""


class KernelStartError(KernelExecError, RuntimeError):
    """A kernel failed to start or did not become ready in time."""


class EnvSetupError(KernelExecError, RuntimeError):
    """Building a virtual environment failed; the message ends with the installer's output.

    Calls do not raise it: their result has ``error.kind == "env_setup_failed"``. It is raised by
    the methods that only build (``warm_up(env)``, ``EnvBuilder.ensure``).
    """


class BackgroundTaskError(KernelExecError, RuntimeError):
    """Background work of the executor (prewarming, idle culling) failed while it ran.

    Each failure is logged when it happens and the work goes on; ``aclose()`` then raises this,
    after everything is shut down, so the failure is not lost.
    """


class BranchError(KernelExecError, RuntimeError):
    """A fork, snapshot or restore of a live session failed (the session is unchanged)."""


class BranchingNotSupportedError(KernelExecError, NotImplementedError):
    """Sessions of this backend or isolation level cannot be forked or snapshotted; the
    message names the level."""


class StateError(KernelExecError, RuntimeError):
    """A session's state could not be saved to (or restored from) its ``state_dir``."""


class CheckpointTooLargeError(StateError):
    """A checkpoint would pass ``max_checkpoint_bytes``; the message names the biggest names."""


class AgentBusyError(StateError):
    """Another executor on the ``state_dir`` holds the agent and did not hand it over within
    ``handoff_timeout``, or refused to; the message names its process id and host, and its
    reason when it gave one."""


class SetupCodeError(KernelExecError, RuntimeError):
    """A session's ``setup_code`` failed in a fresh kernel.

    Calls do not raise it: their result has ``error.kind == "setup_failed"``; it is the class a
    caller can raise from such a result.
    """


class PathRefusedError(KernelExecError, ValueError):
    """A path given to ``session.files`` was refused: empty, absolute, ``..`` leaving the
    working directory, or a link that resolves outside it (or not a regular file).

    Attributes:
        path: The path as the caller gave it.
        reason: Why it was refused, in words.
    """

    def __init__(self, path: str, reason: str = "it leaves the working directory") -> None:
        super().__init__(f"path {path!r} refused: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[type[PathRefusedError], tuple[str, str]]:
        return (type(self), (self.path, self.reason))


class FileTransferError(KernelExecError, RuntimeError):
    """A file operation could not be carried out: the kernel died or timed out during it, or
    it cannot serve file operations. The message says which."""


class TreeLimitError(KernelExecError, OSError):
    """A tenant's tree or file passes a bound the host keeps when it walks, copies, archives or
    reads it (depth, entries, data, or the bytes ``files.read`` holds): nothing past the bound
    was read or written.

    Attributes:
        bound: Which bound (``"depth"``, ``"entries"``, ``"data"`` or ``"bytes"``).
        limit: Its value.
        where: The tree (or file) it was met in.
    """

    def __init__(self, bound: str, limit: int = 0, where: str = "a tenant's tree") -> None:
        super().__init__(f"{where}: passes the host's bound on {bound} ({limit})")
        self.bound = bound
        self.limit = limit
        self.where = where

    def __reduce__(self) -> tuple[type[TreeLimitError], tuple[str, int, str]]:
        return (type(self), (self.bound, self.limit, self.where))


class SessionFileError(KernelExecError, OSError):
    """The kernel's file system refused an operation (``errno``, ``strerror`` and
    ``filename`` are set as on any ``OSError``; ``filename`` is the session-relative path).

    Subclasses also derive from the builtin a caller catches (``FileNotFoundError``, ...).
    """


class SessionFileNotFoundError(SessionFileError, FileNotFoundError):
    """No such file or directory in the session."""


class SessionIsADirectoryError(SessionFileError, IsADirectoryError):
    """A file operation named a directory."""


class SessionNotADirectoryError(SessionFileError, NotADirectoryError):
    """A directory operation named a file (or a path went through a file)."""


class SessionPermissionError(SessionFileError, PermissionError):
    """The kernel's user may not do this."""


class SessionFileExistsError(SessionFileError, FileExistsError):
    """Something exists where a new entry was to be made."""


class ExecutionError(KernelExecError):
    """A run ended with ``status="error"``; raised only by ``Execution.raise_for_error()``.

    Attributes:
        execution: The failed :class:`~kernelexec.Execution` (or ``ToolResult``).
    """

    def __init__(self, execution: Execution) -> None:
        err = execution.error
        text = f"{err.kind}: {err.ename}: {err.evalue}" if err else "execution failed"
        super().__init__(text)
        self.execution = execution

    def __reduce__(self) -> tuple[type[ExecutionError], tuple[Execution]]:
        return (type(self), (self.execution,))


class ExecutionTimeout(ExecutionError, TimeoutError):
    """The run was stopped because it exceeded its timeout."""


class ToolSchemaWarning(UserWarning):
    """A tool's schema is incomplete (no docstring, an unannotated parameter); it still works."""


def describe_problems(errors: Iterable[Mapping[str, Any]], default: str = "value") -> str:
    """pydantic's error list as one line, each problem as ``field: message``, without pydantic's
    "Value error, " prefixes or links (callers raise :class:`ConfigError` with it)."""
    parts = []
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ())) or default
        cause = (error.get("ctx") or {}).get("error")
        parts.append(f"{where}: {cause if cause is not None else error.get('msg')}")
    return "; ".join(parts)


public(__name__)
