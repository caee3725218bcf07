"""``AsyncSession``: one agent's persistent kernel, its calls serialised in submission order.

The session checks what the caller passed, describes the run (``_protocol._host`` builds its
request), runs it on its lease's kernel (``_run``), turns what happened into a typed result
(``_results``), and hands each finished run to its observers as a frozen
:class:`~kernelexec._models.RunRecord` (the notebook recorder is one). The kernel's lifecycle
is the lease's (``_lease``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kernelexec._aio import finish_shielded
from kernelexec._codemode._calls import HostCallBounds
from kernelexec._codemode._exposure import DEFAULT_MODULE, HostFunctions, one_call
from kernelexec._config import valid_timeout
from kernelexec._core import _results as results
from kernelexec._core._hostcalls import (
    OneCall,
    SessionCodeMode,
    is_host_call_output,
    without_host_call_outputs,
)
from kernelexec._core._lease import KernelLease
from kernelexec._core._outputs import CallbackFailed, Callbacks, Collected, OutputCallback
from kernelexec._core._results import Ran
from kernelexec._core._run import RunOutcome, run_internal, run_request
from kernelexec._core._state import Lifecycle
from kernelexec._core._traced import traced_call
from kernelexec._durable._kernel_state import HOOK_KEY
from kernelexec._envs._envs import LocalEnv, VenvEnv, missing_requirements
from kernelexec._exceptions import (
    BranchingNotSupportedError,
    EnvSetupError,
    ExecutorClosedError,
    KernelStartError,
    PoolExhaustedError,
    RequirementsMissingError,
)
from kernelexec._files._commands import AsyncSessionCommands
from kernelexec._files._link import KernelLink
from kernelexec._files._session import AsyncSessionFiles
from kernelexec._models import (
    ExecError,
    Execution,
    Hibernation,
    HostCall,
    Isolation,
    RunRecord,
    StateChanges,
    ToolResult,
    Variable,
    now_iso,
)
from kernelexec._observability._logtext import untrusted
from kernelexec._observability._otel import telemetry
from kernelexec._protocol import _host as protocol
from kernelexec._protocol._host import CodeRun, ToolCall
from kernelexec._public import public
from kernelexec._recording import SessionRecorder
from kernelexec._tools._tool import Tool

if TYPE_CHECKING:
    from nbformat import NotebookNode

    from kernelexec._branching._family import AsyncSnapshot
    from kernelexec._core._forking import SessionBranches

log = logging.getLogger("kernelexec.kernel")


class RunObserver(Protocol):
    """Told about every finished run of a session, in order, before its caller gets it."""

    async def run_finished(self, record: RunRecord) -> str | None:
        """Take note of ``record``; return None, or what went wrong keeping it (an I/O
        failure must not raise: it is reported on the run's result as ``recording_error``)."""

    def close(self) -> None:
        """The session closed."""


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
        *,
        fingerprint: str,
        default_timeout: float,
        interrupt_grace: float,
        output_grace: float,
        max_output_chars: int,
        max_result_chars: int,
        recorder: SessionRecorder | None = None,
        observers: tuple[RunObserver, ...] = (),
        on_close: Callable[[AsyncSession], Awaitable[None]] | None = None,
        isolation: Isolation | None = None,
        env: LocalEnv | VenvEnv | None = None,
        backend: str = "local",
        setup_code: tuple[str, ...] = (),
        branches: SessionBranches | None = None,
        host_calls: HostCallBounds | None = None,
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
        self._timeout = default_timeout
        self._grace = interrupt_grace
        self._output_grace = output_grace
        self._max_output = max_output_chars
        self._max_result = max_result_chars
        self._recorder = recorder
        self._observers: tuple[RunObserver, ...] = (
            (recorder, *observers) if recorder is not None else observers
        )
        self._on_close = on_close
        self._state = Lifecycle(f"session {agent_id!r}", opened=True)
        self._current: RunOutcome | None = None  # the run in progress, for a cancellation
        self.setup_code = setup_code
        """Code run in every fresh kernel of the session before its first call (the executor's
        ``setup_code``, then the session's)."""
        self._setup_done = 0  # the kernel generation that last ran setup_code
        link = KernelLink(lease, self._state.check, str(workdir), timeout=default_timeout)
        self.files = AsyncSessionFiles(link)
        """Files in the session's working directory, moved through its kernel (see
        :class:`kernelexec.AsyncSessionFiles`): ``await session.files.write("a.csv", data)``."""
        self.commands = AsyncSessionCommands(link)
        """Shell commands run in the background in the kernel while the session's other
        calls go on (see :class:`kernelexec.AsyncSessionCommands`)."""
        self._codemode = SessionCodeMode(
            agent_id,
            bounds=host_calls or HostCallBounds(result_chars=max_result_chars),
            install_timeout=default_timeout,
        )

    # -- public API -------------------------------------------------------------------------

    @property
    def lease(self) -> KernelLease:
        """The session's hold on its kernel (for the executor's budget, and for adapters that
        lend host directories to the session's kernels)."""
        return self._lease

    @property
    def recorder(self) -> SessionRecorder | None:
        """The session's notebook recorder, if it records."""
        return self._recorder

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
        return self._recorder.notebook if self._recorder is not None else None

    @property
    def record_path(self) -> Path | None:
        """The file the recording is saved to after every run (None: not saved)."""
        return self._recorder.path if self._recorder is not None else None

    async def expose(
        self, *functions: Any, module: str = DEFAULT_MODULE, timeout: float | None = None
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
            self._codemode.add(functions, module, timeout)
            conn = self._lease.connection
            if conn is not None:
                await self._codemode.install(conn, self._lease.generation, strict=True)

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
        problem = _env_problem(env_vars)
        if problem:
            raise TypeError(problem)
        once = one_call(host_functions)
        run = CodeRun(code, env_vars)
        callbacks = Callbacks(on_stdout, on_stderr, on_display)
        guard = self._atomic_guard() if atomic else None
        async with self._lease.hold():
            self._state.check()
            snap = await guard.before_atomic(self) if guard is not None else None
            started = now_iso()
            try:
                ran = await self._execute(run, timeout, callbacks, once)
                if guard is not None and snap is not None:
                    ran = await guard.after_atomic(self, snap, ran)
                    snap = None
            except asyncio.CancelledError:
                self._raise_if_closed_under_us()  # (closing the executor frees snapshots)
                await finish_shielded(
                    self._record_cancelled(
                        kind="code", code=code, started=started, timeout_s=timeout
                    )
                )
                await self._undo_cancelled(guard, snap)
                raise
            except CallbackFailed as failed:
                await finish_shielded(
                    self._record_cancelled(
                        failed, kind="code", code=code, started=started, timeout_s=timeout
                    )
                )
                await self._undo_cancelled(guard, snap)
                raise _callers_error(failed) from None
            execution = results.execution(ran)
            problem = await self._observe("code", execution, started, timeout, ran, {"code": code})
            if problem is not None:
                execution = execution.model_copy(update={"recording_error": problem})
            self._continued(ran)
        return without_host_call_outputs(execution) if self._recorder else execution

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
        self._check_requirements(tool)
        timeout = self._check_timeout(timeout)
        once = one_call(host_functions)
        args = {} if args is None else args
        problems = tool.validate_args(args)
        problem = _env_problem(env_vars)
        if problem:
            problems.append(problem)
        recording = self._recorder is not None
        guard = self._atomic_guard() if atomic else None
        async with self._lease.hold():
            self._state.check()
            started = now_iso()
            if problems:
                full = results.rejected(
                    problems, agent_state=agent_state, fingerprint=self.fingerprint
                )
                if atomic:  # nothing ran: the session is as it was
                    full = full.model_copy(update={"rolled_back": True})
                ran = Ran(full.error, Collected(), self._lease.generation, rolled_back=atomic)
            else:
                run = ToolCall(
                    tool,
                    args,
                    agent_state=agent_state,
                    env_vars=env_vars,
                    max_result_chars=self._max_result,
                    display=recording,
                )
                callbacks = Callbacks(on_stdout, on_stderr, on_display)
                snap = await guard.before_atomic(self) if guard is not None else None
                try:
                    ran = await self._execute(run, timeout, callbacks, once)
                    if guard is not None and snap is not None:
                        ran = await guard.after_atomic(self, snap, ran)
                        snap = None
                except asyncio.CancelledError:
                    self._raise_if_closed_under_us()
                    await finish_shielded(
                        self._record_cancelled(
                            kind="tool_call",
                            tool=tool,
                            args=args,
                            agent_state=agent_state,
                            started=started,
                            timeout_s=timeout,
                        )
                    )
                    await self._undo_cancelled(guard, snap)
                    raise
                except CallbackFailed as failed:
                    await finish_shielded(
                        self._record_cancelled(
                            failed,
                            kind="tool_call",
                            tool=tool,
                            args=args,
                            agent_state=agent_state,
                            started=started,
                            timeout_s=timeout,
                        )
                    )
                    await self._undo_cancelled(guard, snap)
                    raise _callers_error(failed) from None
                full = results.tool_result(
                    ran, agent_state=agent_state, fingerprint=self.fingerprint
                )
            call = {"tool": tool, "args": args, "agent_state": agent_state}
            problem = await self._observe("tool_call", full, started, timeout, ran, call)
            if problem is not None:
                full = full.model_copy(update={"recording_error": problem})
            self._continued(ran)
        if not recording:
            return full
        # The return value was displayed only for the notebook; the result is the same whether
        # or not the session records.
        outputs = [
            o
            for o in full.outputs
            if o.get("output_type") != "execute_result" and not is_host_call_output(o)
        ]
        return full.model_copy(update={"outputs": outputs, "result": None})

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

    async def _undo_cancelled(
        self, guard: SessionBranches | None, snap: AsyncSnapshot | None
    ) -> None:
        """An atomic run its caller cancelled (or whose output hook raised) is rolled back
        too: all or nothing."""
        if guard is None or snap is None:
            return
        problem = await finish_shielded(guard.undo(self, snap))
        if problem is None and self._recorder is not None:
            self._recorder.continued(self._lease.generation)
        if problem is not None:
            log.warning(
                "agent %r: a cancelled atomic run was not rolled back: %s",
                self.agent_id,
                untrusted(problem),
            )

    def _continued(self, ran: Ran) -> None:
        """After a rollback the restored kernel continues the recorded state (not a fresh
        kernel that replay would restart)."""
        if ran.rolled_back and self._recorder is not None:
            self._recorder.continued(self._lease.generation)

    def _atomic_guard(self) -> SessionBranches:
        """What makes a run atomic; refused before anything runs where it cannot be."""
        self._state.check()
        if self._branches is None:
            raise BranchingNotSupportedError(
                f"atomic runs need snapshots, which sessions of the {self.backend!r} backend "
                "do not offer; nothing ran"
            )
        self._branches.check_atomic(self)
        return self._branches

    def _need_branches(self) -> SessionBranches:
        self._state.check()
        if self._branches is None:
            raise BranchingNotSupportedError("this session cannot be forked")
        return self._branches

    async def interrupt(self) -> None:
        """Interrupt whatever the kernel is running now (the running call gets the error)."""
        self._state.check()
        conn = self._lease.connection
        if conn is not None:
            await conn.interrupt()
        self._codemode.interrupted()

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
            return await self._lease.hibernate()

    async def aclose(self) -> None:
        """Shut the session's kernel down (hibernating it first, with a ``state_dir``);
        later calls raise ``ExecutorClosedError``."""
        self.mark_closed()
        if self._lease.keeper is not None:
            await self._lease.evict()
        await self._lease.release()
        if self._on_close is not None:
            await self._on_close(self)

    def mark_closed(self) -> None:
        """Refuse further calls and let the observers go (used by the executor)."""
        if not self._state.close():
            return
        self._codemode.close()
        for observer in self._observers:
            observer.close()

    # -- internals ---------------------------------------------------------------------------

    def _check_requirements(self, tool: Tool) -> None:
        """Refuse a tool whose ``pip_requirements`` this session's environment lacks (it
        would fail with ``ModuleNotFoundError``, or worse, run against other versions)."""
        if not tool.pip_requirements or self.env is None:
            return
        missing = missing_requirements(self.env, tool.pip_requirements)
        if not missing:
            return
        where = (
            f"a venv with {', '.join(self.env.requirements) or 'no requirements'}"
            if isinstance(self.env, VenvEnv)
            else "the host's interpreter (LocalEnv)"
        )
        raise RequirementsMissingError(
            f"tool {tool.name!r} needs {', '.join(tool.pip_requirements)}, but session "
            f"{self.agent_id!r} runs in {where}, which lacks {', '.join(missing)}: call it "
            "through the executor (executor.call_tool(tool, args, agent_id=...) runs it in a "
            "venv with its requirements), or use the session "
            "executor.session(agent_id, executor.env_for(tool))",
            tuple(missing),
        )

    def _span_attributes(self) -> dict[str, str]:
        return {
            "kernelexec.agent_id": self.agent_id,
            "kernelexec.backend": self.backend,
            "kernelexec.isolation": self.isolation.level,
        }

    def _check_timeout(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else valid_timeout(timeout)

    async def _observe(
        self,
        kind: Literal["code", "tool_call"],
        result: Execution,
        started: str,
        timeout: float,
        ran: Ran,
        what: dict[str, Any],
    ) -> str | None:
        """Hand the finished run to every observer, in order (nothing is built without one);
        return what went wrong keeping it (for ``recording_error``), else None."""
        if not self._observers:
            return None
        record = RunRecord(
            kind=kind,
            agent_id=self.agent_id,
            result=result,
            ran=result.error is None
            or result.error.kind not in ("invalid_args", "env_setup_failed"),
            started=started,
            finished=now_iso(),
            timeout_s=timeout,
            kernel_generation=ran.generation,
            language_info=ran.report.language_info if ran.report else None,
            **what,
        )
        return await self._notify(record)

    async def _notify(self, record: RunRecord) -> str | None:
        problems = [p for o in self._observers if (p := await o.run_finished(record))]
        return "; ".join(problems) or None

    async def _execute(
        self,
        run: CodeRun | ToolCall,
        timeout: float,
        callbacks: Callbacks,
        once: OneCall | None = None,
    ) -> Ran:
        """Run ``run`` on the lease's kernel: what it came to (its error, outputs, the kernel
        side's report, the number of the kernel that ran it)."""
        start = time.monotonic()
        try:
            _, lost = await self._lease.attach()
        except EnvSetupError as exc:
            error = ExecError(kind="env_setup_failed", ename="EnvSetupError", evalue=str(exc))
            return Ran(
                error, Collected(), self._lease.generation, duration_s=time.monotonic() - start
            )
        failed = await self._set_up(timeout)
        if failed is not None:
            return Ran(
                failed,
                Collected(),
                self._lease.generation,
                kernel_restarted=lost is not None,
                lost_variables=sorted(set(lost or [])),
                restored=self._lease.take_restored(),
                duration_s=time.monotonic() - start,
            )
        conn = self._lease.connection
        ended = conn.ended() if conn is not None else None
        if ended:
            # The kernel died between calls: the code goes to a fresh one.
            lost = (lost or []) + await self._lease.replace()
        out, calls = await self._send(run, timeout, callbacks, once)
        if ended is None and out.died and not out.started:
            # A backend that cannot tell (KernelConnection.ended): no sign of the request came
            # back before the death, the only hint that the kernel died first.
            lost = (lost or []) + await self._lease.replace()
            out, calls = await self._send(run, timeout, callbacks, once)
        generation = self._lease.generation
        failure, report, lost = await self._finish(
            out, timeout, lost, tool_call=isinstance(run, ToolCall)
        )
        restored = self._lease.take_restored()
        if report is not None and self._lease.keeper is not None:
            await self._lease.after_call(report.extras.get(HOOK_KEY))
        ran = Ran(
            failure,
            out.collected,
            generation,
            report=report,
            lost_outputs=results.account_outputs(out.collected, out.read().count),
            kernel_restarted=lost is not None,
            lost_variables=sorted(set(lost or [])),
            host_calls=calls,
            restored=restored,
            duration_s=time.monotonic() - start,
            changes=out.read().changes if lost is None else StateChanges(),
        )
        self._current = None  # the result owns its outputs now
        return ran

    @property
    def setup_current(self) -> bool:
        """Whether ``setup_code`` has run in the current kernel (a fork of it carries it)."""
        return not self.setup_code or self._setup_done == self._lease.generation

    def setup_inherited(self) -> None:
        """The current kernel is a fork of one that ran ``setup_code``: not run again."""
        self._setup_done = self._lease.generation

    async def _set_up(self, timeout: float) -> ExecError | None:
        """Run ``setup_code`` once per kernel, before its first call; the error when it failed
        (it is tried again before the next call)."""
        if not self.setup_code or self._setup_done == self._lease.generation:
            return None
        for code in self.setup_code:
            out, _ = await self._send(CodeRun(code), timeout, Callbacks(), None)
            self._current = None
            if out.died or out.stuck or out.timed_out:
                what = "timed out" if out.timed_out or out.stuck else "killed its kernel"
                if out.died or out.stuck:
                    await self._lease.lose_state()
                return ExecError(
                    kind="setup_failed",
                    ename="SetupCodeError",
                    evalue=f"the session's setup_code {what}; the call did not run",
                )
            reply = out.read()
            if reply.report is not None:
                self._lease.update_names(reply.report.names)
            error = results.setup_failed(out, reply)
            if error is not None:
                return error
        self._setup_done = self._lease.generation
        return None

    def _raise_if_closed_under_us(self) -> None:
        """A run ended by the executor closing (its kernels shut down under it) was not
        cancelled by its caller: tell the caller what happened instead."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+; 3.10 cannot tell
        if self._state.closed and not (callable(cancelling) and cancelling()):
            raise ExecutorClosedError(
                f"the executor was closed while a call of session {self.agent_id!r} ran"
            ) from None

    async def _record_cancelled(self, failed: CallbackFailed | None = None, **record: Any) -> None:
        """A call its caller cancelled, or whose output hook raised (``failed``): replace the
        kernel now if the call did not stop when interrupted (so the next call starts on a
        healthy kernel and is not blamed), and hand the observers the run as far as it went
        (its outputs so far)."""
        out, self._current = self._current, None
        generation = self._lease.generation
        replaced = out is not None and (out.stuck or out.died) and not self._state.closed
        if replaced:
            await self._lease.lose_state()  # the next run reports the lost names
        if not self._observers:
            return
        why = ("the caller cancelled the call; " if failed is None else f"{failed}; ") + (
            "it did not stop when interrupted, so its kernel was replaced and its state lost"
            if replaced
            else "it was interrupted"
        )
        ename = "CancelledError" if failed is None else type(failed.error).__name__
        result = results.cancelled(
            out.collected if out is not None else Collected(),
            ExecError(kind="cancelled", ename=ename, evalue=why),
            replaced=replaced,
            kind=record["kind"],
        )
        await self._notify(
            RunRecord(
                agent_id=self.agent_id,
                result=result,
                ran=out is not None and out.started,
                finished=now_iso(),
                kernel_generation=generation,
                **record,
            )
        )

    async def _send(
        self,
        run: CodeRun | ToolCall,
        timeout: float,
        callbacks: Callbacks,
        once: OneCall | None,
    ) -> tuple[RunOutcome, list[HostCall]]:
        conn = self._lease.connection
        assert conn is not None
        request = protocol.build_request(
            run, served=conn.serves_calls, configure=self._lease.take_settings()
        )
        self._current = RunOutcome()
        request, host = await self._codemode.start_run(
            conn,
            self._lease.generation,
            request,
            once,
            record=self._recorder is not None,
            outputs=self._current.collected.outputs,
        )
        try:
            out = await run_request(
                conn,
                request,
                timeout=timeout,
                interrupt_grace=self._grace,
                output_grace=self._output_grace,
                max_output_chars=self._max_output,
                callbacks=callbacks,
                out=self._current,
                fence=conn.fenced,
                host=host,
            )
        finally:
            calls = await finish_shielded(self._codemode.end_run(host))
        return out, calls

    async def _replace_kernel(self) -> tuple[list[str], str | None]:
        """Replace the kernel a run ended: the names lost, or what stopped a fresh kernel
        from starting (then the run that gets one reports the lost names)."""
        names = ", ".join(self._lease.names) or "no variables"
        try:
            return await self._lease.replace(), None
        except (KernelStartError, PoolExhaustedError) as exc:
            return [], (
                f"; no fresh kernel could be started ({exc}): the state ({names}) is lost, "
                "and the next call starts a kernel and says so"
            )

    async def _finish(
        self, out: RunOutcome, timeout: float, lost: list[str] | None, *, tool_call: bool
    ) -> tuple[ExecError | None, protocol.Report | None, list[str] | None]:
        """The run's error and report, and the names lost with a kernel (None: the session
        kept its kernel); a kernel the run cost is replaced here."""
        reply = out.read()
        error = results.kernel_lost(out, reply, timeout)
        if error is not None:
            log.warning("agent %r: %s", self.agent_id, untrusted(error.evalue))
            replaced, problem = await self._replace_kernel()
            if problem is None:
                return error, None, (lost or []) + replaced
            return error.model_copy(update={"evalue": error.evalue + problem}), None, lost
        if reply.report is not None:
            self._lease.update_names(reply.report.names)
        return results.run_error(out, reply, timeout, tool_call=tool_call), reply.report, lost


def _callers_error(failed: CallbackFailed) -> Exception:
    """The exception the caller's hook raised, noting what kernelexec did about it."""
    error = failed.error
    note = f"kernelexec: raised by the {failed.hook} callback; the run was interrupted"
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if callable(add_note):
        add_note(note)
    return error


def _env_problem(env_vars: Any) -> str | None:
    if env_vars is None:
        return None
    if not isinstance(env_vars, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
    ):
        return "env_vars must map str to str"
    return None


public(__name__)
