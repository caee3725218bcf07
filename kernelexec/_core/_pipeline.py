"""``RunPipeline``: one session's runs, from a described run to a typed record of it.

The session checks what the caller passed and holds the session; the pipeline does the rest of
a run (:meth:`RunPipeline.run`): it snapshots the session first for an atomic run, attaches the
lease's kernel (replacing one that died between calls), runs the session's ``setup_code`` in a
fresh kernel, sends the request (``_protocol._host`` builds it, code mode adds its part) and
runs it (``_run``), replaces a kernel the run cost, turns what happened into a
:class:`~kernelexec._core._results.Ran`, tells the lease's watchers the run ended, rolls a
failed atomic run back, and hands each finished run (or one its caller cancelled or rejected)
to the session's observers as a frozen :class:`~kernelexec._models.RunRecord` (the notebook
recorder is one). A run's subject is the run itself: a
:class:`~kernelexec._protocol._host.CodeRun` or :class:`~kernelexec._protocol._host.ToolCall`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kernelexec._aio import finish_shielded
from kernelexec._core import _results as results
from kernelexec._core._atomic import AtomicRun
from kernelexec._core._features import HostCallSource, RunObserver
from kernelexec._core._lease import KernelLease
from kernelexec._core._outputs import CallbackFailed, Callbacks, Collected
from kernelexec._core._results import Ran
from kernelexec._core._run import RunOutcome, run_request
from kernelexec._core._state import Lifecycle
from kernelexec._exceptions import (
    EnvSetupError,
    ExecutorClosedError,
    KernelStartError,
    PoolExhaustedError,
)
from kernelexec._models import (
    ExecError,
    Execution,
    HostCall,
    RunRecord,
    StateChanges,
    ToolResult,
    now_iso,
)
from kernelexec._observability._logtext import untrusted
from kernelexec._protocol import _host as protocol
from kernelexec._protocol._host import CodeRun, ToolCall

if TYPE_CHECKING:
    from kernelexec._codemode._session import OneCall
    from kernelexec.backends._base import KernelConnection

log = logging.getLogger("kernelexec.kernel")

Subject = CodeRun | ToolCall
"""What a run is: code, or a tool call (its tool, arguments and agent state)."""

R = TypeVar("R", bound=Execution)


@dataclass(frozen=True, slots=True)
class RunLimits:
    """How a session's runs are bounded (the executor's configuration).

    Attributes:
        interrupt_grace: Seconds an interrupted run has to stop before its kernel is replaced.
        output_grace: Seconds to wait for late output after the reply.
        max_output_chars: The most characters of output a run keeps.
    """

    interrupt_grace: float
    output_grace: float
    max_output_chars: int


class RunPipeline:
    """One session's runs (see the module docstring). Every method but :meth:`interrupt`
    and :meth:`close` runs with the session held.

    Args:
        agent_id: The session's agent id (for logs and records).
        lease: The session's hold on its kernel.
        limits: How runs are bounded.
        state: The session's lifecycle (a run the executor's closing ended says so).
        setup_code: Code run in each fresh kernel before its first call.
        observers: Told about every finished run, in order.
        host_calls: Code mode, when the session offers it.
        recording: The session records (the notebook gets the host calls and a tool call's
            displayed return value; the caller's result is without them).
    """

    def __init__(
        self,
        agent_id: str,
        lease: KernelLease,
        limits: RunLimits,
        state: Lifecycle,
        *,
        setup_code: tuple[str, ...] = (),
        observers: Sequence[RunObserver] = (),
        host_calls: HostCallSource | None = None,
        recording: bool = False,
    ) -> None:
        self._agent_id = agent_id
        self._lease = lease
        self._limits = limits
        self._state = state
        self.setup_code = setup_code
        self._setup_done = 0  # the kernel generation that last ran setup_code
        self._observers = tuple(observers)
        self._hosts = host_calls
        self.recording = recording
        self._current: RunOutcome | None = None  # the run in progress, for a cancellation
        self._in_run = False  # a run is under way (its request may not be made yet)
        self._interrupt_asked = False  # interrupt() came before the request was made

    # -- a run -------------------------------------------------------------------------------

    async def run(
        self,
        run: Subject,
        timeout: float,
        callbacks: Callbacks,
        once: OneCall | None,
        atomic: AtomicRun | None,
        finish: Callable[[Ran], R],
    ) -> R:
        """Run ``run`` (all or nothing with ``atomic``) and hand the observers its result
        (``finish`` builds it from the :class:`Ran`).

        Raises:
            CancelledError: the caller cancelled it (the observers get it as far as it went).
            ExecutorClosedError: the executor was closed while it ran.
            Exception: what the caller's output hook raised (the run was interrupted).
        """
        started = now_iso()
        if atomic is not None:
            await atomic.before()
        try:
            ran = await self.execute(run, timeout, callbacks, once)
            if atomic is not None:
                ran = await atomic.after(ran)
        except asyncio.CancelledError:
            self._raise_if_closed_under_us()  # (closing the executor frees snapshots)
            await finish_shielded(self.cancelled(run, started, timeout))
            await self._undo(atomic)
            raise
        except CallbackFailed as failed:
            await finish_shielded(self.cancelled(run, started, timeout, failed))
            await self._undo(atomic)
            raise _callers_error(failed) from None
        result = await self.observe(run, finish(ran), started, timeout, ran)
        if ran.rolled_back:
            self._continued()
        return self._for_caller(result)

    async def reject(
        self, call: ToolCall, problems: list[str], timeout: float, *, atomic: bool, fingerprint: str
    ) -> ToolResult:
        """A tool call refused before it ran (its arguments or ``env_vars``), recorded."""
        started = now_iso()
        full = results.rejected(problems, agent_state=call.agent_state, fingerprint=fingerprint)
        if atomic:  # nothing ran: the session is as it was
            full = full.model_copy(update={"rolled_back": True})
        ran = Ran(full.error, Collected(), self._lease.generation, rolled_back=atomic)
        return self._for_caller(await self.observe(call, full, started, timeout, ran))

    async def _undo(self, atomic: AtomicRun | None) -> None:
        if atomic is not None and await atomic.cancelled():
            self._continued()

    def _continued(self) -> None:
        """After a rollback the restored kernel continues the recorded state (not a fresh
        kernel that replay would restart)."""
        for observer in self._observers:
            observer.continued(self._lease.generation)

    def _raise_if_closed_under_us(self) -> None:
        """A run ended by the executor closing (its kernels shut down under it) was not
        cancelled by its caller: tell the caller what happened instead."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+; 3.10 cannot tell
        if self._state.closed and not (callable(cancelling) and cancelling()):
            raise ExecutorClosedError(
                f"the executor was closed while a call of session {self._agent_id!r} ran"
            ) from None

    async def execute(
        self, run: Subject, timeout: float, callbacks: Callbacks, once: OneCall | None = None
    ) -> Ran:
        """Run ``run`` on the lease's kernel: what it came to (its error, outputs, the kernel
        side's report, the number of the kernel that ran it)."""
        self._in_run, self._interrupt_asked = True, False
        try:
            return await self._execute(run, timeout, callbacks, once)
        finally:
            self._in_run = self._interrupt_asked = False

    async def _execute(
        self, run: Subject, timeout: float, callbacks: Callbacks, once: OneCall | None
    ) -> Ran:
        start = time.monotonic()
        lease = self._lease
        try:
            _, lost = await lease.attach()
        except EnvSetupError as exc:
            error = ExecError(kind="env_setup_failed", ename="EnvSetupError", evalue=str(exc))
            return Ran(error, Collected(), lease.generation, duration_s=time.monotonic() - start)
        failed = await self._set_up(timeout)
        if failed is not None:
            await lease.after_run(None)
            return Ran(
                failed,
                Collected(),
                lease.generation,
                kernel_restarted=lost is not None,
                lost_variables=sorted(set(lost or [])),
                restored=lease.take_restored(),
                duration_s=time.monotonic() - start,
            )
        conn = lease.connection
        ended = conn.ended() if conn is not None else None
        if ended:
            # The kernel died between calls: the code goes to a fresh one.
            lost = (lost or []) + await lease.replace()
        out, calls = await self._send(run, timeout, callbacks, once)
        if ended is None and out.died and not out.started:
            # A backend that cannot tell (KernelConnection.ended): no sign of the request came
            # back before the death, the only hint that the kernel died first.
            lost = (lost or []) + await lease.replace()
            self._interrupt_asked = out.interrupt_waits  # held for a request that never ran
            out, calls = await self._send(run, timeout, callbacks, once)
        generation = lease.generation
        failure, report, lost = await self._finish(
            out, timeout, lost, tool_call=isinstance(run, ToolCall)
        )
        restored = lease.take_restored()
        await lease.after_run(report.extras if report is not None else None)
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

    async def _send(
        self, run: Subject, timeout: float, callbacks: Callbacks, once: OneCall | None
    ) -> tuple[RunOutcome, list[HostCall]]:
        kernel = self._lease.kernel
        assert kernel is not None
        conn = kernel.conn
        request = protocol.build_request(
            run, served=conn.serves_calls, configure=self._lease.take_settings()
        )
        self._current = RunOutcome(
            announces_start=request.announces_start, interrupt_asked=self._interrupt_asked
        )
        self._interrupt_asked = False
        host = None
        if self._hosts is not None:
            request, host = await self._hosts.start_run(
                kernel,
                request,
                once,
                record=self.recording,
                outputs=self._current.collected.outputs,
            )
        try:
            out = await run_request(
                conn,
                request,
                timeout=timeout,
                interrupt_grace=self._limits.interrupt_grace,
                output_grace=self._limits.output_grace,
                max_output_chars=self._limits.max_output_chars,
                callbacks=callbacks,
                out=self._current,
                fence=conn.fenced,
                host=host,
            )
        finally:
            calls = []
            if self._hosts is not None and host is not None:
                calls = await finish_shielded(self._hosts.end_run(host))
        return out, calls

    # -- setting a fresh kernel up -------------------------------------------------------------

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
        if self.setup_current:
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

    # -- a kernel the run cost -----------------------------------------------------------------

    async def _finish(
        self, out: RunOutcome, timeout: float, lost: list[str] | None, *, tool_call: bool
    ) -> tuple[ExecError | None, protocol.Report | None, list[str] | None]:
        """The run's error and report, and the names lost with a kernel (None: the session
        kept its kernel); a kernel the run cost is replaced here."""
        reply = out.read()
        error = results.kernel_lost(out, reply, timeout)
        if error is not None:
            log.warning("agent %r: %s", self._agent_id, untrusted(error.evalue))
            replaced, problem = await self._replace_kernel()
            if problem is None:
                return error, None, (lost or []) + replaced
            return error.model_copy(update={"evalue": error.evalue + problem}), None, lost
        if reply.report is not None:
            self._lease.update_names(reply.report.names)
        return results.run_error(out, reply, timeout, tool_call=tool_call), reply.report, lost

    async def _replace_kernel(self) -> tuple[list[str], str | None]:
        """Replace the kernel a run ended: the names lost, or what stopped a fresh kernel
        from starting (then the run that gets one reports the lost names)."""
        names = ", ".join(self._lease.names) or "no variables"
        try:
            return await self._lease.replace(), None
        except (KernelStartError, PoolExhaustedError) as exc:
            log.warning(
                "agent %r: no fresh kernel could be started: %s", self._agent_id, untrusted(exc)
            )
            return [], (
                f"; no fresh kernel could be started ({exc}): the state ({names}) is lost, "
                "and the next call starts a kernel and says so"
            )

    # -- the record ----------------------------------------------------------------------------

    async def observe(self, run: Subject, result: R, started: str, timeout: float, ran: Ran) -> R:
        """Hand the finished run to every observer, in order (nothing is built without one);
        ``result`` with what went wrong keeping it (``recording_error``), if anything did."""
        if not self._observers:
            return result
        reached = result.error is None or result.error.kind not in (
            "invalid_args",
            "env_setup_failed",
        )
        language = ran.report.language_info if ran.report else None
        record = self._record(run, result, reached, started, timeout, ran.generation, language)
        problem = await self._notify(record)
        if problem is None:
            return result
        return result.model_copy(update={"recording_error": problem})

    async def cancelled(
        self,
        run: Subject,
        started: str,
        timeout: float,
        failed: CallbackFailed | None = None,
    ) -> None:
        """A run its caller cancelled, or whose output hook raised (``failed``): replace the
        kernel now if the run did not stop when interrupted (so the next call starts on a
        healthy kernel and is not blamed; not once the session is closed), and hand the
        observers the run as far as it went (its outputs so far)."""
        out, self._current = self._current, None
        generation = self._lease.generation
        replaced = out is not None and (out.stuck or out.died) and not self._state.closed
        if replaced:
            await self._lease.lose_state()  # the next run reports the lost names
        reached = out is not None and out.started
        if reached:
            await self._lease.after_run(None)
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
            kind="tool_call" if isinstance(run, ToolCall) else "code",
        )
        await self._notify(self._record(run, result, reached, started, timeout, generation))

    def _record(
        self,
        run: Subject,
        result: Execution,
        reached: bool,
        started: str,
        timeout: float,
        generation: int,
        language_info: dict[str, Any] | None = None,
    ) -> RunRecord:
        call = run if isinstance(run, ToolCall) else None
        return RunRecord(
            kind="code" if call is None else "tool_call",
            agent_id=self._agent_id,
            result=result,
            code=run.code if isinstance(run, CodeRun) else None,
            tool=call.tool if call is not None else None,
            args=call.args if call is not None else None,
            agent_state=call.agent_state if call is not None else None,
            ran=reached,
            started=started,
            finished=now_iso(),
            timeout_s=timeout,
            kernel_generation=generation,
            language_info=language_info,
        )

    async def _notify(self, record: RunRecord) -> str | None:
        problems = [p for o in self._observers if (p := await o.run_finished(record))]
        return "; ".join(problems) or None

    # -- the rest ------------------------------------------------------------------------------

    def _for_caller(self, result: R) -> R:
        """A recorded run's result as an unrecorded run's would be: without what the notebook
        alone keeps (the host calls' records, a tool call's displayed return value)."""
        if not self.recording:
            return result
        outputs = result.outputs
        update: dict[str, Any] = {}
        if isinstance(result, ToolResult):
            outputs = [o for o in outputs if o.get("output_type") != "execute_result"]
            update["result"] = None
        if self._hosts is not None:
            outputs = self._hosts.for_caller(outputs)
        return result.model_copy(update={**update, "outputs": outputs})

    async def interrupt(self, conn: KernelConnection | None) -> None:
        """Interrupt the run in progress on ``conn`` (held until its code runs, see
        :meth:`RunOutcome.interrupt_now`), or whatever the kernel runs when none is; its host
        calls are cancelled.

        A run whose request is not made yet (its kernel still starting or being replaced,
        ``conn`` then None) takes the interrupt along: a SIGINT sent now would reach an idle
        kernel, or none, and the code would run to its deadline. ``setup_code`` still to run
        takes it first (the call then does not run)."""
        current = self._current
        if current is None and self._in_run:
            log.debug("agent %r: interrupt taken along by the run on its way", self._agent_id)
            self._interrupt_asked = True
        elif conn is not None and (current is None or current.interrupt_now()):
            log.debug("agent %r: interrupt sent", self._agent_id)
            await conn.interrupt()
        else:
            log.debug("agent %r: interrupt held until the run's code starts", self._agent_id)
        if self._hosts is not None:
            self._hosts.interrupted()

    def close(self) -> None:
        """The session closed: let the observers go."""
        for observer in self._observers:
            observer.close()


def _callers_error(failed: CallbackFailed) -> Exception:
    """The exception the caller's hook raised, noting what kernelexec did about it."""
    error = failed.error
    note = f"kernelexec: raised by the {failed.hook} callback; the run was interrupted"
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if callable(add_note):
        add_note(note)
    return error
