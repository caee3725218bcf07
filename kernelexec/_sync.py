"""The blocking facade: ``KernelExecutor`` and ``Session`` over the async core.

One background thread runs an event loop (a :class:`~kernelexec._aio.LoopThread`) owned by
the ``KernelExecutor``; every blocking method is one call into it. All kernel lifecycle work
therefore happens on that single long-lived thread, and the facade also works where a loop is
already running in the calling thread (inside Jupyter).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, TypeVar

from kernelexec._aio import LoopThread
from kernelexec._assembly._executor import DEFAULT_AGENT, AsyncKernelExecutor
from kernelexec._branching._family import AsyncSnapshot
from kernelexec._codemode._exposure import HostFunctions
from kernelexec._config import ExecutorConfig, ExecutorOptions
from kernelexec._core._outputs import OutputCallback
from kernelexec._core._session import AsyncSession
from kernelexec._core._state import Lifecycle
from kernelexec._envs._builder import ProgressCallback
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._files._blocking import SessionCommands, SessionFiles
from kernelexec._models import Execution, Hibernation, Isolation, ToolResult, Variable
from kernelexec._public import public
from kernelexec._replay import ReplayReport, areplay
from kernelexec._tools._tool import Tool
from kernelexec.backends._base import KernelBackend

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pydantic's own dependency
    from typing_extensions import Unpack

if TYPE_CHECKING:
    from nbformat import NotebookNode

T = TypeVar("T")


class _Portal:
    """The executor's loop thread and whether the executor is open: every blocking method is
    one :meth:`call` through it."""

    def __init__(self) -> None:
        self.thread = LoopThread("kernelexec")
        self.state = Lifecycle("the executor", opened=True)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop every call runs on."""
        return self.thread.loop

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop thread and wait for its result.

        Straight onto the loop (:func:`~kernelexec._aio.call_blocking`): an anyio portal's
        ``call`` spawns a task in its task group and takes twice as long (57 vs 24 us per
        call here). A Ctrl-C reaches the waiting main thread whichever thread took the signal.
        The task runs in a copy of the caller's context, so the caller's current OpenTelemetry
        span is the call's parent. When the caller stops waiting (Ctrl-C), the call is
        cancelled, which interrupts its kernel.
        """
        self.state.check()
        if self.thread.is_current():
            raise RuntimeError(
                "a blocking kernelexec method was called from the executor's own event-loop "
                "thread (e.g. inside an on_stdout callback); use the async API there"
            )
        return self.thread.call(fn, *args, **kwargs)

    def stop(self) -> None:
        if self.state.close():
            self.thread.stop()


def async_side(executor: KernelExecutor) -> tuple[AsyncKernelExecutor, asyncio.AbstractEventLoop]:
    """The async executor behind ``executor`` and the loop its calls run on, for code that
    drives it from either side (the framework adapters).

    Raises:
        ExecutorClosedError: ``executor`` is closed (its loop is gone).
    """
    executor._portal.state.check()
    return executor._async, executor._portal.loop


def _shutdown(portal: _Portal, executor: AsyncKernelExecutor) -> None:
    _unclosed.pop(portal, None)
    try:
        portal.call(executor.aclose)
    finally:
        portal.stop()


_unclosed: dict[_Portal, weakref.finalize[Any, Any]] = {}
"""The shutdowns of executors not closed yet, run by :func:`_close_at_exit`."""


def _close_at_exit() -> None:
    """Close the executors a program left open when it exits.

    Run among ``threading``'s exit hooks, before ``atexit``'s: ``concurrent.futures``' own hook
    ends every thread pool there, the event loops' default executors too, and a shutdown that
    ran after it (a ``weakref.finalize`` at ``atexit``) could not hand blocking work to a
    thread: it printed ``cannot schedule new futures after shutdown`` four times per kernel.
    """
    for finalizer in list(_unclosed.values()):
        try:
            finalizer()
        except Exception as exc:
            logging.getLogger("kernelexec").warning("closing an executor at exit: %r", exc)


def _watch_exit() -> None:
    # its hook registered first: the hooks run in reverse order, so ours runs before it
    importlib.import_module("concurrent.futures.thread")

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython's threading: the finalizers' own atexit is left
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is exiting already
        register(_close_at_exit)


_watch_exit()


class Snapshot:
    """Blocking twin of :class:`~kernelexec.AsyncSnapshot`, from ``Session.snapshot``."""

    def __init__(self, inner: AsyncSnapshot, portal: _Portal) -> None:
        self.inner = inner
        self._portal = portal

    @property
    def agent_id(self) -> str:
        """The session it was taken of."""
        return self.inner.agent_id

    @property
    def closed(self) -> bool:
        """Whether it was closed."""
        return self.inner.closed

    def close(self) -> None:
        """Free the snapshot; see :meth:`AsyncSnapshot.aclose`."""
        self._portal.call(self.inner.aclose)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """Blocking twin of :class:`~kernelexec.AsyncSession`, from ``KernelExecutor.session``."""

    def __init__(self, inner: AsyncSession, portal: _Portal) -> None:
        self._inner = inner
        self._portal = portal
        self.files = SessionFiles(inner.files, portal.call)
        """Files in the session's working directory (see :class:`kernelexec.SessionFiles`)."""
        self.commands = SessionCommands(inner.commands, portal.call)
        """Background commands in the session's kernel (see :class:`kernelexec.SessionCommands`)."""

    @property
    def agent_id(self) -> str:
        """The agent this session belongs to."""
        return self._inner.agent_id

    @property
    def workdir(self) -> PurePath:
        """The session's working directory (a ``pathlib.Path`` for backends that share the
        host's filesystem, else a ``PurePosixPath`` on the kernel's side)."""
        return self._inner.workdir

    @property
    def isolation(self) -> Isolation:
        """What is in force for this session's kernel: ``.level``, and per limit and per
        boundary the mechanism that enforces it."""
        return self._inner.isolation

    @property
    def notebook(self) -> NotebookNode | None:
        """The session's recording (an nbformat ``NotebookNode``), or None when not recording."""
        return self._inner.notebook

    @property
    def record_path(self) -> Path | None:
        """The file the recording is saved to after every run (a ``Path``), or None."""
        return self._inner.record_path

    def expose(self, *functions: Any, module: str = "tools", timeout: float | None = None) -> None:
        """Make host functions importable by the session's code; see
        :meth:`AsyncSession.expose`."""
        self._portal.call(self._inner.expose, *functions, module=module, timeout=timeout)

    def run_code(
        self,
        code: str,
        *,
        timeout: float | None = None,
        env_vars: dict[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
        host_functions: HostFunctions | None = None,
        atomic: bool = False,
    ) -> Execution:
        """Run code in the session's kernel; see :meth:`AsyncSession.run_code`."""
        return self._portal.call(
            self._inner.run_code,
            code,
            timeout=timeout,
            env_vars=env_vars,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            host_functions=host_functions,
            atomic=atomic,
        )

    def call_tool(
        self,
        tool: Tool,
        args: dict[str, Any] | None = None,
        *,
        agent_state: Any = None,
        env_vars: dict[str, str] | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
        host_functions: HostFunctions | None = None,
        atomic: bool = False,
    ) -> ToolResult:
        """Call a tool; see :meth:`AsyncSession.call_tool`."""
        return self._portal.call(
            self._inner.call_tool,
            tool,
            args,
            agent_state=agent_state,
            env_vars=env_vars,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            host_functions=host_functions,
            atomic=atomic,
        )

    def variables(self, timeout: float = 10.0) -> list[Variable]:
        """The user's variables in the kernel (name, type, bounded summary, size); see
        :meth:`AsyncSession.variables`."""
        return self._portal.call(self._inner.variables, timeout)

    def interrupt(self) -> None:
        """Interrupt the running code; see :meth:`AsyncSession.interrupt`."""
        self._portal.call(self._inner.interrupt)

    def restart(self) -> None:
        """Replace the kernel with a fresh one; see :meth:`AsyncSession.restart`."""
        self._portal.call(self._inner.restart)

    def hibernate(self) -> Hibernation:
        """Save the state and give the kernel back; see :meth:`AsyncSession.hibernate`."""
        return self._portal.call(self._inner.hibernate)

    def fork(self, n: int = 1) -> list[Session]:
        """Branch the live session into ``n`` children; see :meth:`AsyncSession.fork`."""
        return [Session(c, self._portal) for c in self._portal.call(self._inner.fork, n)]

    def snapshot(self) -> Snapshot:
        """A frozen copy of the session; see :meth:`AsyncSession.snapshot`."""
        return Snapshot(self._portal.call(self._inner.snapshot), self._portal)

    def restore(self, snap: Snapshot) -> None:
        """Put the session back to ``snap``; see :meth:`AsyncSession.restore`."""
        inner = snap.inner if isinstance(snap, Snapshot) else snap
        self._portal.call(self._inner.restore, inner)

    def close(self) -> None:
        """Shut the session's kernel down."""
        self._portal.call(self._inner.aclose)


class KernelExecutor:
    """Blocking twin of :class:`~kernelexec.AsyncKernelExecutor` (same arguments, same methods).

    Use it as a context manager, or call :meth:`close`; kernels are also shut down when the
    object is garbage-collected or the interpreter exits.
    """

    def __init__(
        self,
        *,
        backend: KernelBackend | str | None = None,
        backend_options: dict[str, Any] | None = None,
        on_progress: ProgressCallback | None = None,
        **config: Unpack[ExecutorOptions],
    ) -> None:
        self._async = AsyncKernelExecutor(
            backend=backend, backend_options=backend_options, on_progress=on_progress, **config
        )
        self._portal = _Portal()
        # Weak: a wrapper lives as long as its caller holds it (the core forgets sessions too).
        self._sessions: weakref.WeakValueDictionary[tuple[str, str], Session] = (
            weakref.WeakValueDictionary()
        )
        self._finalizer = weakref.finalize(self, _shutdown, self._portal, self._async)
        _unclosed[self._portal] = self._finalizer

    @property
    def config(self) -> ExecutorConfig:
        """The validated :class:`~kernelexec.ExecutorConfig`."""
        return self._async.config

    @property
    def kernel_count(self) -> int:
        """Kernels alive or starting, prewarmed ones included."""
        return self._async.kernel_count

    def __enter__(self) -> KernelExecutor:
        self._portal.call(self._async.start)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def env(self) -> LocalEnv | VenvEnv:
        """The default environment."""
        return self._async.env

    @property
    def fingerprint(self) -> str:
        """The default environment's fingerprint."""
        return self._async.fingerprint

    @property
    def sessions(self) -> dict[str, Session]:
        """The open sessions of the default environment by agent id (a copy)."""
        return {agent: self._wrap(inner) for agent, inner in self._async.sessions.items()}

    def env_for(
        self, tool: Tool | None, env: LocalEnv | VenvEnv | None = None
    ) -> LocalEnv | VenvEnv:
        """The environment a call runs in; see :meth:`AsyncKernelExecutor.env_for`."""
        return self._async.env_for(tool, env)

    def delete_state(self, agent_id: str, env: LocalEnv | VenvEnv | None = None) -> bool:
        """Delete an agent's saved state; see :meth:`AsyncKernelExecutor.delete_state`."""
        return self._portal.call(self._async.delete_state, agent_id, env)

    def warm_up(self, env: LocalEnv | VenvEnv | None = None) -> None:
        """Build ``env`` if needed and wait for its prewarmed kernels; see
        :meth:`AsyncKernelExecutor.warm_up`."""
        self._portal.call(self._async.warm_up, env)

    def session(
        self,
        agent_id: str = DEFAULT_AGENT,
        env: LocalEnv | VenvEnv | None = None,
        *,
        setup_code: str | None = None,
    ) -> Session:
        """The session of ``agent_id`` in ``env`` (the same object for the same pair); see
        :meth:`AsyncKernelExecutor.session`."""
        return self._wrap(
            self._portal.call(self._async.session, agent_id, env, setup_code=setup_code)
        )

    def _wrap(self, inner: AsyncSession) -> Session:
        key = (inner.agent_id, inner.fingerprint)
        wrapper = self._sessions.get(key)
        if wrapper is None or wrapper._inner is not inner:
            wrapper = self._sessions[key] = Session(inner, self._portal)
        return wrapper

    def call_tool(
        self,
        tool: Tool,
        args: dict[str, Any] | None = None,
        *,
        agent_id: str | None = None,
        env: LocalEnv | VenvEnv | None = None,
        agent_state: Any = None,
        env_vars: dict[str, str] | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
        host_functions: HostFunctions | None = None,
        atomic: bool = False,
    ) -> ToolResult:
        """Call a tool; see :meth:`AsyncKernelExecutor.call_tool`."""
        return self._portal.call(
            self._async.call_tool,
            tool,
            args,
            agent_id=agent_id,
            env=env,
            agent_state=agent_state,
            env_vars=env_vars,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            host_functions=host_functions,
            atomic=atomic,
        )

    def run_code(
        self,
        code: str,
        *,
        agent_id: str | None = None,
        env: LocalEnv | VenvEnv | None = None,
        env_vars: dict[str, str] | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: OutputCallback | None = None,
        host_functions: HostFunctions | None = None,
        atomic: bool = False,
    ) -> Execution:
        """Run code; see :meth:`AsyncKernelExecutor.run_code`."""
        return self._portal.call(
            self._async.run_code,
            code,
            agent_id=agent_id,
            env=env,
            env_vars=env_vars,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
            host_functions=host_functions,
            atomic=atomic,
        )

    def close(self) -> None:
        """Shut down every kernel, remove temporary files and stop the loop thread."""
        self._finalizer()


def replay(path: str | Path, **kwargs: Any) -> ReplayReport:
    """Blocking :func:`~kernelexec.areplay`: re-run a recorded notebook and compare outputs."""
    portal = _Portal()
    try:
        return portal.call(areplay, path, **kwargs)
    finally:
        portal.stop()


public(__name__)
