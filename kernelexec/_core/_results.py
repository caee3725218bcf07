"""Results of runs: what the run loop observed, turned into typed ``Execution``/``ToolResult``.

Pure functions and a frozen record, no I/O: the session runs the request and decides what to do
about the kernel (replace it, update the names it holds); this module says what the run's error
is and builds the result the caller gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kernelexec._core._outputs import Collected
from kernelexec._core._run import RunOutcome
from kernelexec._models import (
    ErrorKind,
    ExecError,
    Execution,
    HostCall,
    Restored,
    StateChanges,
    ToolResult,
)
from kernelexec._protocol import _host as protocol
from kernelexec._protocol import _kernel_side as kernel_side


@dataclass(frozen=True, slots=True)
class Ran:
    """What a run came to, before it is the caller's result.

    Attributes:
        error: Why the run failed, None when it succeeded.
        collected: Its outputs (empty for a run that never reached a kernel).
        report: The kernel side's report (None: the run has none).
        generation: The number of the kernel that ran it.
        lost_outputs: Output messages the kernel side sent that never arrived.
        kernel_restarted: A fresh kernel replaced the one the session had.
        lost_variables: The names that went with the kernel, sorted.
        host_calls: The run's calls to host functions.
        restored: What a restore brought back before the run.
        duration_s: Seconds from the call to its end.
        changes: The names the run added, rebound and removed (none: it reported none, or
            its kernel was lost).
        rolled_back: An atomic run failed and the session was put back as it was before it.
    """

    error: ExecError | None
    collected: Collected
    generation: int
    report: protocol.Report | None = None
    lost_outputs: int = 0
    kernel_restarted: bool = False
    lost_variables: list[str] = field(default_factory=list)
    host_calls: list[HostCall] = field(default_factory=list)
    restored: Restored | None = None
    duration_s: float = 0.0
    changes: StateChanges = field(default_factory=StateChanges)
    rolled_back: bool = False


def execution(ran: Ran) -> Execution:
    """A ``run_code`` result."""
    return Execution(**_fields(ran))


def tool_result(ran: Ran, *, agent_state: Any, fingerprint: str) -> ToolResult:
    """A tool call's result: its return value and the agent state as the tool left it (as the
    class the caller passed in, when it can be)."""
    fields = _fields(ran)
    fields["sandbox_config_fingerprint"] = fingerprint
    fields["agent_state"] = agent_state
    result = ran.report.result if ran.report is not None else None
    if result is not None:
        fields["func_return"] = result.get(kernel_side.RESULT_RETURN)
        if kernel_side.RESULT_AGENT_STATE in result:
            fields["agent_state"] = protocol.load_state(
                agent_state, result[kernel_side.RESULT_AGENT_STATE]
            )
    return ToolResult(**fields)


def rejected(problems: list[str], *, agent_state: Any, fingerprint: str) -> ToolResult:
    """A tool call refused before it ran: its arguments (or ``env_vars``) were invalid."""
    error = ExecError(
        kind="invalid_args", ename=protocol.INVALID_ARGUMENTS, evalue="; ".join(problems)
    )
    return ToolResult(
        status="error", error=error, agent_state=agent_state, sandbox_config_fingerprint=fingerprint
    )


def cancelled(
    collected: Collected, error: ExecError, *, replaced: bool, kind: Literal["code", "tool_call"]
) -> Execution:
    """The result of a run its caller cancelled (or whose output hook raised), as far as it
    went: for the observers (the caller gets the exception)."""
    fields: dict[str, Any] = {
        "status": "error",
        "error": error,
        "stdout": collected.stdout,
        "stderr": collected.stderr,
        "outputs": collected.outputs,
        "execution_count": collected.execution_count,
        "kernel_restarted": replaced,
    }
    return ToolResult(**fields) if kind == "tool_call" else Execution(**fields)


def _fields(ran: Ran) -> dict[str, Any]:
    collected = ran.collected
    return {
        "status": "error" if ran.error else "success",
        "lost_outputs": ran.lost_outputs,
        "stdout": collected.stdout,
        "stderr": collected.stderr,
        "outputs": collected.outputs,
        "result": collected.result,
        "error": ran.error,
        "execution_count": collected.execution_count,
        "kernel_restarted": ran.kernel_restarted,
        "lost_variables": ran.lost_variables,
        "widgets_dropped": collected.widgets_dropped,
        "host_calls": ran.host_calls,
        "restored": ran.restored,
        "duration_s": ran.duration_s,
        "changes": ran.changes,
        "rolled_back": ran.rolled_back,
    }


def kernel_lost(out: RunOutcome, reply: protocol.Reply, timeout: float) -> ExecError | None:
    """The error of a run that cost the session its kernel (it died, was killed for a limit,
    did not stop when interrupted, or the code asked it to exit); None when the kernel is
    fine. The session replaces a lost kernel."""
    death = out.death
    if death is not None and death.limit:
        why = (
            f"the kernel was killed for exceeding its limit {death.limit} "
            f"({death.reason}); a fresh kernel replaces it"
        )
        return ExecError(kind="limit_exceeded", ename="LimitExceeded", evalue=why)
    if death is not None:
        why = f"the kernel died ({death.reason})"
        return ExecError(kind="kernel_died", ename="KernelDied", evalue=why)
    if out.stuck:
        why = (
            f"timed out after {timeout:g} s and did not stop when interrupted; "
            "the kernel was restarted and its state lost"
        )
        return ExecError(kind="timeout", ename="TimeoutError", evalue=why)
    if reply.asked_exit:
        why = "the code asked the kernel to exit; a fresh kernel replaces it"
        return ExecError(kind="kernel_died", ename="KernelExited", evalue=why)
    return None


def run_error(
    out: RunOutcome, reply: protocol.Reply, timeout: float, *, tool_call: bool
) -> ExecError | None:
    """The error of a run whose kernel is fine: it timed out (interrupted, state kept) or
    failed; None when it succeeded."""
    collected = out.collected
    if out.timed_out:
        return ExecError(
            kind="timeout",
            ename="TimeoutError",
            evalue=f"timed out after {timeout:g} s; interrupted, kernel state kept",
            traceback=list((collected.error or {}).get("traceback") or []),
        )
    if not reply.ok or collected.error is not None:
        kind: ErrorKind = reply.failure_kind(tool_call=tool_call)
        return protocol.error_from(collected.error or out.reply or {}, kind)
    return None


def account_outputs(collected: Collected, count: protocol.OutputCount | None) -> int:
    """Compare what arrived with what the kernel side sent; say in ``stdout`` (and return) how
    many output messages were lost, and how many outputs the budget suppressed."""
    if count is None:
        return 0
    lost = max(0, count.sent - collected.received)
    notes = []
    if lost:
        notes.append(
            f"[kernelexec: {lost} output message(s) of {count.sent} lost: sent by the kernel, "
            "never received (refused by the host, or lost by a broken transport)]"
        )
    if count.suppressed:
        notes.append(
            f"[kernelexec: {count.suppressed} more output(s) dropped: over the output budget "
            f"of {count.limit} characters]"
        )
    if notes:
        text = "\n" if collected.stdout and not collected.stdout.endswith("\n") else ""
        text += "\n".join(notes) + "\n"
        collected.stdout += text
        outputs = collected.outputs
        if (
            outputs
            and outputs[-1].get("output_type") == "stream"
            and outputs[-1]["name"] == "stdout"
        ):
            outputs[-1]["text"] += text
        else:
            outputs.append({"output_type": "stream", "name": "stdout", "text": text})
    return lost


def setup_failed(out: RunOutcome, reply: protocol.Reply) -> ExecError | None:
    """The error of one ``setup_code`` run that raised (None: it succeeded); ``out`` ended
    normally (neither killed nor timed out)."""
    if reply.ok and out.collected.error is None:
        return None
    error = protocol.error_from(out.collected.error or out.reply or {}, "exception")
    return ExecError(
        kind="setup_failed",
        ename=error.ename,
        evalue=f"the session's setup_code raised {error.ename}: {error.evalue}; "
        "the call did not run",
        traceback=error.traceback,
    )
