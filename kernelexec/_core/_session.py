"""``AsyncSession``: one agent's persistent kernel, its calls serialised in submission order.

The session checks what the caller passed, holds the session (its lease's FIFO lock) and
delegates: a run to its :class:`~kernelexec._core._pipeline.RunPipeline` (which runs it on the
lease's kernel and hands the observers a typed record), the kernel's lifecycle to its lease
(``_lease``), and each feature's method to that feature.

A session is assembled from parts, by the executor: the lease; the features, each subscribed
to the lease as a :class:`~kernelexec._core._lease.KernelWatcher` (durable state, the
executor's registry entry, live attach, the files link, code mode); the run pipeline; and the
:class:`SessionFeatures` the session delegates to. A new feature is a folder with a host half
and a kernel half, one watcher subscribed by the assembly, and one delegating method here and
its twin in ``_sync.py``. This module imports no feature folder.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from kernelexec._config import valid_timeout
from kernelexec._core import _results as results
from kernelexec._core._atomic import AtomicRun
from kernelexec._core._checks import check_requirements, env_problem
from kernelexec._core._features import SessionFeatures
from kernelexec._core._lease import KernelLease
from kernelexec._core._outputs import Callbacks, OutputCallback
from kernelexec._core._pipeline import RunLimits, RunPipeline
from kernelexec._core._results import Ran
from kernelexec._core._run import run_internal
from kernelexec._core._state import Lifecycle
from kernelexec._core._traced import traced_call
from kernelexec._envs._envs import LocalEnv, VenvEnv
from kernelexec._exceptions import BranchingNotSupportedError, ConfigError
from kernelexec._models import (
    Execution,
    Hibernation,
    HostFunctions,
    Isolation,
    ToolResult,
    Variable,
)
from kernelexec._observability._otel import telemetry
from kernelexec._protocol import _host as protocol
from kernelexec._protocol._host import CodeRun, ToolCall
from kernelexec._public import public
from kernelexec._tools._tool import Tool

if TYPE_CHECKING:
    from nbformat import NotebookNode

    from kernelexec._assembly._forking import SessionBranches
    from kernelexec._branching._family import AsyncSnapshot
    from kernelexec._durable._keeper import SessionState
    from kernelexec._recording import SessionRecorder

log = logging.getLogger("kernelexec.kernel")


class AsyncSession:
    """A stateful sandbox for one agent: a kernel kept across calls.

    Get one from :meth:`AsyncKernelExecutor.session`; the same agent id always gives the same
    session. Calls are run one at a time in the order they were made; different sessions run in
    parallel. The kernel is started on first use (or taken from the prewarmed pool), replaced
    when it dies or has to be killed, and may be shut down when idle (its state is then lost and
    the next result says so).
    """

    def __init__(
        self,
        agent_id: str,
        lease: KernelLease,
        workdir: PurePath,
        features: SessionFeatures,
        *,
        fingerprint: str,
        default_timeout: float,
        limits: RunLimits,
        max_result_chars: int,
        on_close: Callable[[AsyncSession], Awaitable[None]] | None = None,
        isolation: Isolation | None = None,
        env: LocalEnv | VenvEnv | None = None,
        backend: str = "local",
        setup_code: tuple[str, ...] = (),
        branches: SessionBranches | None = None,
    ) -> None:
        self.agent_id = agent_id
        self._branches = branches
        self.backend = backend
        """The name of the backend running the session's kernels (``local``, ``gateway``)."""
        self.isolation = isolation or Isolation(level="none")
        """What is in force for this session's kernel: ``.level``, and per limit and per
        boundary the mechanism that enforces it (see :class:`kernelexec.Isolation`)."""
        self.workdir = workdir
        self.env = env
        """The environment the session's kernel runs in, when it runs on this machine (tools'
        ``pip_requirements`` are checked against it); None when the backend picks it."""
        self.fingerprint = fingerprint
        self._lease = lease
        self._features = features
        self._timeout = default_timeout
        self._max_result = max_result_chars
        self._on_close = on_close
        self._state = Lifecycle(f"session {agent_id!r}", opened=True)
        recorder = features.recorder
        self._runs = RunPipeline(
            agent_id,
            lease,
            limits,
            self._state,
            setup_code=setup_code,
            observers=(recorder,) if recorder is not None else (),
            host_calls=features.code_mode,
            recording=recorder is not None,
        )
        self.files = features.files
        """Files in the session's working directory, moved through its kernel (see
        :class:`kernelexec.AsyncSessionFiles`): ``await session.files.write("a.csv", data)``."""
        self.commands = features.commands
        """Shell commands run in the background in the kernel while the session's other
        calls go on (see :class:`kernelexec.AsyncSessionCommands`)."""

    # -- public API -------------------------------------------------------------------------

    @property
    def lease(self) -> KernelLease:
        """The session's hold on its kernel (for the executor's budget, and for adapters that
        lend host directories to the session's kernels)."""
        return self._lease

    @property
    def recorder(self) -> SessionRecorder | None:
        """The session's notebook recorder, if it records."""
        return self._features.recorder

    @property
    def durable(self) -> SessionState | None:
        """The session's durable state (with the executor's ``state_dir``), if any."""
        return self._features.durable

    @property
    def setup_code(self) -> tuple[str, ...]:
        """Code run in every fresh kernel of the session before its first call (the executor's
        ``setup_code``, then the session's)."""
        return self._runs.setup_code

    @property
    def busy(self) -> bool:
        """True while a call runs or waits to run."""
        return self._lease.busy

    @property
    def has_kernel(self) -> bool:
        """Whether a kernel is currently attached (it may be shut down when idle)."""
        return self._lease.has_kernel

    @property
    def notebook(self) -> NotebookNode | None:
        """The session's recording (an nbformat v4 notebook), or None when not recording.

        Every run is a code cell with its outputs; a tool call is its definition cell (once per
        version of its source) and a call cell such as ``add(a=1, b=2)``.
        """
        return self.recorder.notebook if self.recorder is not None else None

    @property
    def record_path(self) -> Path | None:
        """The file the recording is saved to after every run (None: not saved)."""
        return self.recorder.path if self.recorder is not None else None

    async def expose(
        self, *functions: Any, module: str = "tools", timeout: float | None = None
    ) -> None:
        """Make host functions importable by the session's code: ``from tools import search``.

        Each may be a plain or ``async def`` function (or callable object), or a
        :class:`~kernelexec.Tool` (its source is then run on the host). In the kernel it has its
        signature and docstring; a call sends its arguments (JSON values only) to the host,
        where they are checked against the function's parameters and the function runs (plain
        functions in a worker thread) with the session's identity: a parameter named
        ``agent_id`` gets the agent id, one named ``context`` a
        :class:`~kernelexec.HostCallContext`.
        An ``async def`` function is awaitable in the kernel (``asyncio.gather`` runs calls
        together on the host). Errors arrive as ``HostCallError`` subclasses carrying the host's
        message only. Calls are answered only while a run is in flight, at most
        ``max_host_calls`` per run. Exposed modules stay for the session's life, on every
        kernel it gets (restart, eviction, crash).

        Args:
            *functions: What to expose (added to what ``module`` already has).
            module: The module name in the kernel (dotted names make packages).
            timeout: Seconds one call of these functions may take on the host (None: bounded
                by the run's own timeout only); past it the kernel gets ``HostCallTimeout``.

        Raises:
            ConfigError: a bad module name, or a function that cannot be exposed (no public
                name, ``*args``/``**kwargs``/positional-only parameters).
        """
        async with self._lease.hold():
            self._state.check()
            kernel = self._lease.kernel
            await self._features.code_mode.expose(functions, module, timeout, kernel)

    @traced_call("run_code")
    async def run_code(
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
        """Run code in the session's kernel, like a notebook cell.

        Args:
            code: Python source (IPython syntax allowed).
            timeout: Seconds before the run is interrupted (default: the executor's).
            env_vars: Environment variables set only while this code runs.
            on_stdout: Called with each piece of stdout text as it arrives.
            on_stderr: Called with each piece of stderr text as it arrives.
            on_display: Called with each display_data output dict as it arrives.
            host_functions: Host functions for this run only, as :meth:`expose` would make
                them (a list: module ``tools``; or a dict of module name -> functions).
            atomic: All or nothing: the session is snapshotted first, and if the run ends in
                an error (an exception, a timeout) its variables and working-directory
                files are put back as they were, with ``rolled_back=True`` on the result
                (also when the caller cancels it or an output callback raises, or the run
                kills its kernel). Effects outside the session (network, host calls) are
                not undone.

        Raises:
            BranchingNotSupportedError: ``atomic=True`` where snapshots are not offered
                (``isolation="bwrap"``, a remote backend); nothing ran.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be str, not {type(code).__name__}")
        timeout = self._check_timeout(timeout)
        problem = env_problem(env_vars)
        if problem:
            raise TypeError(problem)
        once = self._features.code_mode.one_call(host_functions)
        callbacks = Callbacks(on_stdout, on_stderr, on_display)
        atomic_run = self._atomic_run() if atomic else None
        async with self._lease.hold():
            self._state.check()
            run = CodeRun(code, env_vars)
            return await self._runs.run(
                run, timeout, callbacks, once, atomic_run, results.execution
            )

    @traced_call("call_tool")
    async def call_tool(
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
        """Call a tool with JSON arguments; they are validated first and sent as data.

        Args:
            tool: The tool to call; its source is sent to the kernel once (again if it changes).
            args: Arguments by name, validated against the tool's schema.
            agent_state: Injected as the ``agent_state`` parameter when the tool has one; the
                changed state comes back in ``ToolResult.agent_state``.
            env_vars: Environment variables set only for the duration of this call.
            timeout: Seconds before the call is interrupted (default: the executor's).
            on_stdout: Called with each piece of stdout text as it arrives.
            on_stderr: Called with each piece of stderr text as it arrives.
            on_display: Called with each display_data output dict as it arrives.
            host_functions: Host functions the tool may call, for this call only (see
                :meth:`run_code`).
            atomic: All or nothing, as for :meth:`run_code`: a failed call leaves the
                session as it was (``rolled_back=True``).

        Raises:
            BranchingNotSupportedError: ``atomic=True`` where snapshots are not offered;
                nothing ran.
        """
        if not isinstance(tool, Tool):
            raise TypeError(f"tool must be a kernelexec.Tool, not {type(tool).__name__}")
        check_requirements(tool, self.env, self.agent_id)
        timeout = self._check_timeout(timeout)
        once = self._features.code_mode.one_call(host_functions)
        args = {} if args is None else args
        problems = tool.validate_args(args)
        problem = env_problem(env_vars)
        if problem:
            problems.append(problem)
        call = ToolCall(
            tool,
            args,
            agent_state=agent_state,
            env_vars=env_vars,
            max_result_chars=self._max_result,
            display=self._runs.recording,
        )
        callbacks = Callbacks(on_stdout, on_stderr, on_display)

        def finish(ran: Ran) -> ToolResult:
            return results.tool_result(ran, agent_state=agent_state, fingerprint=self.fingerprint)

        atomic_run = self._atomic_run() if atomic else None
        async with self._lease.hold():
            self._state.check()
            if problems:
                fingerprint = self.fingerprint
                return await self._runs.reject(
                    call, problems, timeout, atomic=atomic, fingerprint=fingerprint
                )
            return await self._runs.run(call, timeout, callbacks, once, atomic_run, finish)

    async def variables(self, timeout: float = 10.0) -> list[Variable]:
        """The user's variables in the session's kernel, sorted by name: each one's name,
        qualified type, a summary of at most 200 characters and its size.

        Lists the names the user's code (or a tool) bound, not IPython's (``In``, ``Out``,
        ``exit``, ...), kernelexec's, or names starting with ``_``. A value's own
        ``__repr__`` runs only under a deadline (builtin values are summarised without
        one): one that hangs, raises or returns megabytes still gets an entry, its summary
        saying so, and the whole listing answers within about a second. Waits for the
        running call (if any), never starts a kernel (empty when none is attached) and is
        not recorded.
        """
        async with self._lease.hold():
            self._state.check()
            conn = self._lease.connection
            if conn is None:
                return []
            out = await run_internal(conn, protocol.VARIABLES, timeout)
        if out.died or out.timed_out or out.reply is None:
            return []
        return protocol.read_variables(out.reply)

    async def fork(self, n: int = 1) -> list[AsyncSession]:
        """Branch the live session: ``n`` new sessions whose kernels are copies of this one's
        (every variable, import and definition; memory shared copy-on-write), which then go
        their own ways. Waits for the running call; this kernel is paused only for one
        ``fork()``.

        Each child is a session of its own (agent id ``"<agent_id>~<k>"``), with its own
        connection file and key, working directory (a copy of this one's files), recording
        (starting with a cell naming this session) and, at ``"process"``, this session's
        user and limits in a cgroup of its own. Threads started in this kernel do not exist
        in a child: its first result warns about them on stderr. Children count against
        ``max_kernels``; closing this session leaves them running.

        Raises:
            PoolExhaustedError: the children would exceed ``max_kernels`` (nothing forked).
            BranchingNotSupportedError: this backend or isolation level cannot fork.
            BranchError: the kernel could not be forked.
        """
        branches = self._need_branches()
        async with self._lease.hold():
            self._state.check()
            with telemetry().span("session.fork", {**self._span_attributes(), "kernelexec.n": n}):
                return await branches.fork(self, n)

    async def snapshot(self) -> AsyncSnapshot:
        """A frozen copy of this session (a paused fork of its kernel holding memory only for
        the pages that later change, and a copy of its files) to :meth:`restore` later.

        Raises:
            BranchingNotSupportedError: this backend or isolation level cannot fork.
            BranchError: the kernel could not be forked.
        """
        branches = self._need_branches()
        async with self._lease.hold():
            self._state.check()
            with telemetry().span("session.snapshot", self._span_attributes()):
                return await branches.snapshot(self)

    async def restore(self, snap: AsyncSnapshot) -> None:
        """Put the session back to exactly the state of ``snap`` (its variables and its
        working directory's files); any number of times. Waits for the running call.

        Raises:
            ValueError: ``snap`` was taken of another session.
            BranchError: the snapshot is closed, or the restored kernel did not start.
        """
        branches = self._need_branches()
        async with self._lease.hold():
            self._state.check()
            with telemetry().span("session.restore", self._span_attributes()):
                await branches.restore(self, snap)

    async def interrupt(self) -> None:
        """Interrupt whatever the kernel is running now (the running call gets the error).

        A call still on its way to the kernel (waiting for it to start, or to be replaced) is
        interrupted once its code runs; a call waiting for another to finish is not."""
        self._state.check()
        await self._runs.interrupt(self._lease.connection)

    async def restart(self) -> None:
        """Replace the kernel with a fresh one now; all state is lost."""
        async with self._lease.hold():
            self._state.check()
            if self._lease.has_kernel:
                log.info("agent %r: kernel restarted on request", self.agent_id)
                await self._lease.lose_state()

    async def hibernate(self) -> Hibernation:
        """Save the session's state to the executor's ``state_dir`` and give its kernel back
        now; the next call restores it into a fresh kernel (``result.restored``).

        Waits for the running call (if any). Returns what was saved and what was not, with
        why (those names are reported lost on restore).

        Raises:
            ConfigError: the executor has no ``state_dir``.
            CheckpointTooLargeError: the state passes ``max_checkpoint_bytes`` (the kernel and
                its state are kept; the message names the biggest names).
            StateError: the state could not be saved (the kernel and its state are kept).
        """
        async with self._lease.hold():
            self._state.check()
            if self.durable is None:
                raise ConfigError("hibernate() needs an executor with a state_dir")
            return await self.durable.hibernate(self._lease)

    async def aclose(self) -> None:
        """Shut the session's kernel down (hibernating it first, with a ``state_dir``);
        later calls raise ``ExecutorClosedError``."""
        self.mark_closed()
        if self.durable is not None:
            await self._lease.evict()
        await self._lease.release()
        if self.durable is not None:
            self.durable.let_agent_go()
        if self._on_close is not None:
            await self._on_close(self)

    def mark_closed(self) -> None:
        """Refuse further calls and let the features and observers go (used by the
        executor)."""
        if not self._state.close():
            return
        self._lease.gone()
        self._runs.close()

    # -- internals ---------------------------------------------------------------------------

    def _atomic_run(self) -> AtomicRun:
        """What makes a run atomic; refused before anything runs where it cannot be."""
        self._state.check()
        if self._branches is None:
            raise BranchingNotSupportedError(
                f"atomic runs need snapshots, which sessions of the {self.backend!r} backend "
                "do not offer; nothing ran"
            )
        self._branches.check_atomic(self)
        return AtomicRun(self._branches, self)

    def _need_branches(self) -> SessionBranches:
        self._state.check()
        if self._branches is None:
            raise BranchingNotSupportedError("this session cannot be forked")
        return self._branches

    def _span_attributes(self) -> dict[str, str]:
        return {
            "kernelexec.agent_id": self.agent_id,
            "kernelexec.backend": self.backend,
            "kernelexec.isolation": self.isolation.level,
        }

    def _check_timeout(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else valid_timeout(timeout)

    @property
    def setup_current(self) -> bool:
        """Whether ``setup_code`` has run in the current kernel (a fork of it carries it)."""
        return self._runs.setup_current

    def setup_inherited(self) -> None:
        """The current kernel is a fork of one that ran ``setup_code``: not run again."""
        self._runs.setup_inherited()


public(__name__)
