"""What tracing costs on a warm tool call (issue 29): the same session, calls taking turns in
rounds between telemetry off and on, medians and their ratio, for three settings:

* ``off``: telemetry switched off (as when OpenTelemetry is not installed), the baseline of
  every phase;
* ``API only``: the OpenTelemetry API installed but no provider set (kernelexec skips the work);
* ``SDK traces``: a real SDK tracer provider (batch processor, an exporter that drops spans);
* ``SDK traces + metrics``: and a meter provider (an in-memory reader): everything recorded.

Usage: ``.venv/bin/python benchmarks/otel.py [--calls N]``; writes ``benchmarks/results/otel.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import kernelexec as kx
from kernelexec._observability import _otel

RESULTS = Path(__file__).parent / "results" / "otel.json"


def add(a: int, b: int = 2) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def timed(session: kx.AsyncSession, tool: kx.Tool, n: int) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        result = await session.call_tool(tool, {"a": i})
        times.append((time.perf_counter() - start) * 1000)
        assert result.ok
    return times


async def main(calls: int, rounds: int) -> list[dict[str, float | str]]:
    """Each phase alternates ``off`` with one setting for ``rounds`` rounds; providers, once
    set, stay set, so the phases run in this order."""
    tool = kx.Tool.from_function(add)
    off = _otel.Telemetry()
    rows: list[dict[str, float | str]] = []
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        session = await ex.session("bench")
        await timed(session, tool, 200)  # warm up
        for phase in ("API only", "SDK traces", "SDK traces + metrics"):
            if phase == "SDK traces":
                provider = TracerProvider()
                provider.add_span_processor(BatchSpanProcessor(Drop()))
                trace.set_tracer_provider(provider)
            elif phase == "SDK traces + metrics":
                metrics.set_meter_provider(MeterProvider([InMemoryMetricReader()]))
            on = _otel._Otel()
            base: list[float] = []
            with_it: list[float] = []
            for _ in range(rounds):
                _otel._current = off
                base += await timed(session, tool, calls)
                _otel._current = on
                with_it += await timed(session, tool, calls)
            b, w = statistics.median(base), statistics.median(with_it)
            rows.append({"setting": phase, "off_ms": b, "on_ms": w, "ratio": w / b})
    return rows


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=500, help="calls per setting per round")
    parser.add_argument("--rounds", type=int, default=6)
    ns = parser.parse_args()
    rows = asyncio.run(main(ns.calls, ns.rounds))
    print(f"warm call_tool, {ns.rounds} rounds x {ns.calls} calls per setting, taking turns")
    print("| telemetry | off: median ms | on: median ms | overhead |")
    print("|---|---|---|---|")
    for row in rows:
        ratio = float(row["ratio"])
        print(
            f"| {row['setting']} | {row['off_ms']:.3f} | {row['on_ms']:.3f} | "
            f"{ratio:.3f}x ({(ratio - 1) * 100:+.1f} %) |"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"calls": ns.calls, "rounds": ns.rounds, "rows": rows}, indent=2))


if __name__ == "__main__":
    run()
