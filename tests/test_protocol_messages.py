"""The host half of the protocol on its own: one request built, one reply read."""

from __future__ import annotations

from typing import Any

import kernelexec as kx
from kernelexec._protocol import _host as protocol
from kernelexec._protocol import _kernel_budget as kernel_budget
from kernelexec._protocol import _kernel_side as kernel_side


def add(a: int, b: int) -> int:
    """Adds."""
    return a + b


def _reply(
    *payload: dict[str, Any], status: str = "ok", report: str | None = None
) -> dict[str, Any]:
    reply: dict[str, Any] = {"status": status, "payload": list(payload)}
    if report is not None:
        entry = {"status": "ok", "data": {protocol.RESULT_MIME: report}, "metadata": {}}
        reply["user_expressions"] = {kernel_side.REPORT_KEY: entry}
    return reply


def _count(sent: Any, suppressed: Any = 0, limit: Any = 100) -> dict[str, Any]:
    return {
        "source": kernel_budget.OUTPUTS_PAYLOAD,
        kernel_budget.SENT: sent,
        kernel_budget.SUPPRESSED: suppressed,
        kernel_budget.LIMIT: limit,
    }


def test_a_served_call_carries_the_same_metadata_as_its_execute_form() -> None:
    call = protocol.ToolCall(kx.Tool.from_function(add), {"a": 1, "b": 2}, env_vars={"X": "1"})
    executed = protocol.build_request(call)
    served = protocol.build_request(call, served=True)
    assert (executed.msg_type, served.msg_type) == ("execute_request", protocol.CALL_REQUEST)
    assert served.metadata == executed.metadata
    spec = served.metadata[kernel_side.METADATA_KEY]
    assert spec[kernel_side.CALL_ARGS] == '{"a": 1, "b": 2}'
    assert spec[kernel_side.RUN_ENV] == {"X": "1"}
    assert served.content() == {} and served.user_expressions == {}
    assert executed.user_expressions == {kernel_side.REPORT_KEY: protocol.REPORT_EXPRESSION}


def test_a_code_run_has_metadata_only_for_what_it_carries() -> None:
    assert protocol.build_request(protocol.CodeRun("1")).metadata == {}
    configured = protocol.build_request(protocol.CodeRun("1"), configure={"cwd": "/w"})
    assert configured.metadata == {kernel_side.METADATA_KEY: {kernel_side.CONFIGURE: {"cwd": "/w"}}}
    assert configured.code == "1"


def test_the_reply_is_read_in_one_go() -> None:
    report = '{"names": ["x"], "result": {"return": 3}, "durable": 1}'
    reply = protocol.read_reply(
        _reply(
            _count(True),  # not a count: skipped
            _count(4, 1, 50),
            _count(9),
            {"source": kernel_side.ERROR_PAYLOAD, kernel_side.ERROR_KIND: "made_up"},
            {"source": kernel_side.ERROR_PAYLOAD, kernel_side.ERROR_KIND: "invalid_args"},
            {"source": "ask_exit"},
            status="error",
            report=report,
        )
    )
    assert not reply.ok
    assert reply.count == protocol.OutputCount(sent=4, suppressed=1, limit=50)
    assert reply.verdict == "invalid_args" and reply.asked_exit
    assert reply.failure_kind(tool_call=True) == "invalid_args"
    assert reply.failure_kind(tool_call=False) == "exception"
    assert reply.report is not None
    assert reply.report.names == ("x",) and reply.report.result == {"return": 3}
    assert reply.report.extras == {"durable": 1}


def test_no_reply_reads_as_a_failed_run_without_a_report() -> None:
    assert protocol.read_reply(None) == protocol.Reply()
    empty = protocol.read_reply(_reply(report="not json"))
    assert empty.ok and empty.report is None and empty.count is None and not empty.asked_exit


def _counted(budget: kernel_budget.Budget, run_id: str) -> dict[str, Any]:
    reply: dict[str, Any] = {"status": "ok", "payload": []}
    kernel_budget.account(budget, {"header": {"msg_id": run_id}}, reply)
    return dict(reply["payload"][0])


def test_a_runs_output_sent_before_its_budget_starts_is_counted_as_its_own() -> None:
    """ipykernel makes a request the parent of output before its ``pre_execute`` resets the
    budget: what is sent in between counts as the run's (the host waits for it), what other
    requests send does not."""
    budget = kernel_budget.Budget(10)
    budget.reset("run-1")
    assert budget.admit("stream", {"name": "stdout", "text": "0123456789..."}, "run-1")
    assert budget.stream_cut  # run 1 spent its budget: what follows until a reset is dropped
    # ipykernel took run 2: a thread's output is run 2's from here on, before run 2 starts.
    assert not budget.admit("stream", {"name": "stdout", "text": "tick\n"}, "run-2")
    assert budget.admit("clear_output", {"wait": False}, "run-2")
    budget.admit("stream", {"name": "stdout", "text": "tick\n"}, "fence-1")  # other requests'
    budget.admit("stream", {"name": "stdout", "text": "tick\n"}, None)
    budget.reset("run-2")
    assert budget.admit("execute_result", {"data": {"text/plain": "42"}}, "run-2")
    assert _counted(budget, "run-2") == _count(sent=2, suppressed=1, limit=10)
