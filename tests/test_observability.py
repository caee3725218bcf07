"""OpenTelemetry spans and metrics, and logs without secrets (issue 29), with real kernels and the
SDK's in-memory exporter and reader.

The SDK's providers are global and can be set once per process: one fixture sets them for the
whole worker and each test clears what earlier ones exported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import kernelexec as kx
from kernelexec._envs._builder import EnvBuilder
from tests.support.wheels import make_wheel

SECRET = "s3cr3t-7f1d"


def echo(text: str) -> str:
    """Echo a text.

    Args:
        text: What to echo.
    """
    print("echoing", len(text))
    return text


ECHO = kx.Tool.from_function(echo)


class Otel:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        trace.set_tracer_provider(provider)
        self.reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[self.reader]))
        self.tracer = trace.get_tracer("tests")

    def finished(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found += list(metric.data.data_points)
        return found


_OTEL: Otel | None = None


@pytest.fixture
def otel() -> Iterator[Otel]:
    global _OTEL
    if _OTEL is None:
        _OTEL = Otel()
    _OTEL.spans.clear()
    yield _OTEL


def test_call_spans_are_children_of_the_callers_span_with_their_attributes(otel: Otel) -> None:
    async def main() -> None:
        async with kx.AsyncKernelExecutor(isolation="none") as ex:
            session = await ex.session("agent-otel")
            with otel.tracer.start_as_current_span("agent-step"):
                ok = await session.call_tool(ECHO, {"text": "hi"})
                bad = await session.run_code("1 / 0")
            assert ok.ok and bad.error is not None

    asyncio.run(main())
    (step,) = otel.finished("agent-step")
    (call,) = otel.finished("kernelexec.call_tool")
    (code,) = otel.finished("kernelexec.run_code")
    for span in (call, code):
        assert span.parent is not None and span.parent.span_id == step.context.span_id
        assert span.context.trace_id == step.context.trace_id
        assert span.attributes is not None
        assert span.attributes["kernelexec.agent_id"] == "agent-otel"
        assert span.attributes["kernelexec.backend"] == "local"
        assert span.attributes["kernelexec.isolation"] == "none"
        assert span.attributes["kernelexec.kernel_restarted"] is False
        assert span.attributes["kernelexec.lost_outputs"] == 0
    assert call.attributes is not None and code.attributes is not None
    assert call.attributes["kernelexec.tool"] == "echo"
    assert call.attributes["kernelexec.status"] == "success"
    assert "kernelexec.error.kind" not in call.attributes
    assert call.status.status_code == StatusCode.UNSET
    assert code.attributes["kernelexec.status"] == "error"
    assert code.attributes["kernelexec.error.kind"] == "exception"
    assert code.status.status_code == StatusCode.ERROR
    starts = otel.finished("kernelexec.kernel.start")
    assert starts and all(
        s.attributes and s.attributes["kernelexec.isolation"] == "none" for s in starts
    )


def test_the_blocking_facade_carries_the_callers_span_to_its_loop_thread(otel: Otel) -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        session = ex.session("blocking")
        with otel.tracer.start_as_current_span("outer"):
            assert session.call_tool(ECHO, {"text": "x"}).ok
        assert session.run_code("2").ok  # no current span: a root
    (outer,) = otel.finished("outer")
    (call,) = otel.finished("kernelexec.call_tool")
    (code,) = otel.finished("kernelexec.run_code")
    assert call.parent is not None and call.parent.span_id == outer.context.span_id
    assert code.parent is None


def test_a_kernel_death_is_an_error_span_a_restart_span_and_counted(otel: Otel) -> None:
    def restarts() -> int:
        return sum(p.value for p in otel.points("kernelexec.kernel.restarts"))

    before = restarts()
    with kx.KernelExecutor(isolation="none") as ex:
        died = ex.run_code("import os; os._exit(3)", agent_id="dies")
        assert died.error is not None and died.error.kind == "kernel_died"
        assert ex.run_code("1", agent_id="dies").ok
    (code, _) = otel.finished("kernelexec.run_code")
    assert code.attributes is not None
    assert code.attributes["kernelexec.error.kind"] == "kernel_died"
    assert code.attributes["kernelexec.kernel_restarted"] is True
    assert code.status.status_code == StatusCode.ERROR
    assert otel.finished("kernelexec.kernel.restart")
    # At least this one (the counter is process-wide: another test's executor may still be
    # replacing a kernel of its own in the background while this one runs).
    assert restarts() >= before + 1


def test_metrics_count_calls_by_status_time_them_and_gauge_kernels_by_state(otel: Otel) -> None:
    def calls(status: str) -> int:
        return sum(
            p.value
            for p in otel.points("kernelexec.calls")
            if p.attributes.get("kernelexec.status") == status
            and p.attributes.get("kernelexec.operation") == "call_tool"
        )

    ok_before, error_before = calls("success"), calls("error")
    with kx.KernelExecutor(isolation="none", prewarm=1) as ex:
        ex.warm_up()
        busy = ex.session("busy")
        assert busy.call_tool(ECHO, {"text": "a"}).ok
        assert busy.call_tool(ECHO, {"text": 1}).error is not None  # invalid_args: counted
        gauge = {p.attributes["state"]: p.value for p in otel.points("kernelexec.kernels")}
        # The session's kernel is idle now; the pool refills a warm one in the background.
        assert gauge["idle"] >= 1 and gauge["busy"] == 0 and "warm" in gauge
    assert calls("success") == ok_before + 1
    assert calls("error") == error_before + 1
    durations = [
        p
        for p in otel.points("kernelexec.call.duration")
        if p.attributes.get("kernelexec.operation") == "call_tool"
    ]
    assert durations and sum(p.count for p in durations) >= 2
    assert sum(p.value for p in otel.points("kernelexec.kernel.starts")) >= 1


def test_an_environment_build_is_a_span_and_counted(otel: Otel, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "kxotel", "0.1", "X = 1\n")
    builder = EnvBuilder(tmp_path / "cache")
    built = asyncio.run(builder.ensure(kx.VenvEnv(requirements=[str(wheel)])))
    assert built.built
    (span,) = otel.finished("kernelexec.env.build")
    assert span.attributes is not None
    assert span.attributes["kernelexec.env.fingerprint"] == built.fingerprint
    outcomes = {p.attributes["outcome"]: p.value for p in otel.points("kernelexec.env.builds")}
    assert outcomes.get("built", 0) >= 1


def test_no_argument_or_environment_value_reaches_any_log_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with kx.KernelExecutor(
        isolation="none", env_vars={"KX_TOKEN": SECRET}, max_kernels=1, prewarm=0
    ) as ex:
        assert ex.call_tool(ECHO, {"text": SECRET}, agent_id="a").func_return == SECRET
        assert ex.call_tool(ECHO, {"text": 5, "x": SECRET}, agent_id="a").error is not None
        ex.run_code(f"raise ValueError({SECRET!r})", agent_id="a", env_vars={"K": SECRET})
        ex.run_code("import os; os._exit(1)", agent_id="a")  # a death, logged
        ex.run_code(f"y = {SECRET!r}", agent_id="b")  # evicts a (max_kernels=1), logged
    messages = [r.getMessage() for r in caplog.records]
    assert any("kernel" in m for m in messages)  # lifecycle lines were logged
    leaked = [m for m in messages if SECRET in m]
    assert leaked == []


def test_without_opentelemetry_nothing_is_imported_and_calls_work() -> None:
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if the extra were not installed
        import kernelexec as kx
        with kx.KernelExecutor(isolation="none") as ex:
            r = ex.run_code("40 + 2")
        loaded = sorted(m for m, v in sys.modules.items() if m.startswith("opentelemetry") and v)
        print(r.result, loaded)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "42 []"


SERVER = textwrap.dedent(
    """
    import json, sys
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class ToFile(SpanExporter):
        def export(self, spans):
            with open(sys.argv[1], "a") as f:
                for s in spans:
                    f.write(json.dumps({
                        "name": s.name,
                        "trace_id": format(s.context.trace_id, "032x"),
                        "attributes": dict(s.attributes or {}),
                    }) + "\\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ToFile()))
    trace.set_tracer_provider(provider)
    from kernelexec._cli._main import main
    sys.exit(main(["mcp", "--isolation", "none"]))
    """
)


@pytest.mark.anyio
async def test_mcp_calls_are_children_of_the_clients_trace(otel: Otel, tmp_path: Path) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    spans_file = tmp_path / "spans.jsonl"
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    params = StdioServerParameters(
        command=sys.executable,
        args=[str(script), str(spans_file)],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=str(tmp_path),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        with otel.tracer.start_as_current_span("client-step") as step:
            result = await client.call_tool("run_python", {"code": "6 * 7"})
        assert not result.is_error
        trace_id = format(step.get_span_context().trace_id, "032x")
    recorded = [json.loads(line) for line in spans_file.read_text().splitlines()]
    runs = [s for s in recorded if s["name"] == "kernelexec.run_code"]
    assert runs, [s["name"] for s in recorded]
    assert {s["trace_id"] for s in runs} == {trace_id}


def test_fork_snapshot_and_restore_are_spans(otel: Otel) -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        session = ex.session("brancher")
        session.run_code("x = 1")
        with otel.tracer.start_as_current_span("branching"):
            (child,) = session.fork()
            snap = session.snapshot()
            session.restore(snap)
        assert child.run_code("x").result == "1"
        snap.close()
    (outer,) = otel.finished("branching")
    for name in (
        "kernelexec.session.fork",
        "kernelexec.session.snapshot",
        "kernelexec.session.restore",
    ):
        (span,) = otel.finished(name)
        assert span.parent is not None and span.parent.span_id == outer.context.span_id
        assert span.attributes is not None and span.attributes["kernelexec.agent_id"] == "brancher"


def test_hibernate_and_restore_of_durable_state_are_spans(otel: Otel, tmp_path: Path) -> None:
    with kx.KernelExecutor(isolation="none", state_dir=tmp_path / "state") as ex:
        session = ex.session("sleeper")
        session.run_code("x = 41")
        session.hibernate()
        woken = session.run_code("x + 1")
        assert woken.result == "42" and woken.restored is not None
    saves = otel.finished("kernelexec.state.save")  # hibernate(), then the close's own save
    (restore,) = otel.finished("kernelexec.state.restore")
    assert saves
    for span in (*saves, restore):
        assert span.attributes is not None and span.attributes["kernelexec.agent_id"] == "sleeper"
