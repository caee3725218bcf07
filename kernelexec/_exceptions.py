"""The kernelexec exception tree.

Errors in user code are data on the result (``Execution.error``), not exceptions. Exceptions
mean misuse of the API or a broken environment::

    KernelExecError
    ├── ConfigError (ValueError)              bad executor or tool configuration
    │   ├── ToolDefinitionError               a Tool could not be built from what was given
    │   └── NotebookError                     a notebook could not be read or used
    ├── ExecutorClosedError (RuntimeError)    use after close
    ├── PoolExhaustedError (RuntimeError)     every kernel busy and max_kernels reached
    ├── KernelStartError (RuntimeError)       a kernel did not start or become ready
    ├── EnvSetupError (RuntimeError)          a virtual environment could not be built
    ├── BackgroundTaskError (RuntimeError)    background work failed (raised at close)
    └── ExecutionError                        raised on demand by Execution.raise_for_error()
        └── ExecutionTimeout (TimeoutError)   ... when the run timed out

Every exception survives pickling (they cross process boundaries in users' worker pools).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernelexec._models import Execution


class KernelExecError(Exception):
    """Base class of every exception kernelexec raises."""


class ConfigError(KernelExecError, ValueError):
    """A configuration value was rejected; the message names the field."""


class ToolDefinitionError(ConfigError):
    """A :class:`~kernelexec.Tool` could not be built (no function, unparsable source, ...)."""


class NotebookError(ConfigError):
    """A notebook could not be read, is not valid, or lacks what was asked of it."""


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
