"""The OpenTelemetry bridge: spans and metrics for calls, kernels and environment builds.

The user brings the SDK and an exporter (``kernelexec[otel]`` installs only the API). Spans go
to the global tracer provider and metrics to the global meter provider, through the API's
proxies, so a provider set after kernelexec was imported still receives them. When the API is
not installed, :func:`telemetry` returns a no-op twin and nothing of OpenTelemetry is imported.

Span and metric names are a contract (tests outside this repository use them):

* spans ``kernelexec.call_tool``, ``kernelexec.run_code``, ``kernelexec.kernel.start``,
  ``kernelexec.kernel.restart``, ``kernelexec.env.build``; a call's span carries
  ``kernelexec.agent_id``, ``kernelexec.status``, ``kernelexec.tool`` (tools),
  ``kernelexec.error.kind`` (failures), ``kernelexec.kernel_restarted``,
  ``kernelexec.lost_outputs``, ``kernelexec.backend`` and ``kernelexec.isolation``, and has
  status ERROR when the call failed;
* metrics ``kernelexec.kernels`` (gauge by ``state``: busy, idle, warm), ``kernelexec.calls``
  (counter by ``kernelexec.operation`` and ``kernelexec.status``), ``kernelexec.call.duration``
  (histogram, seconds), ``kernelexec.kernel.starts``, ``kernelexec.kernel.restarts`` (by
  ``reason``), ``kernelexec.output.lost`` and ``kernelexec.env.builds`` (by ``outcome``).

Attributes never hold arguments, code, environment values or outputs: only ids, names, kinds
and counts.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

Attributes = Mapping[str, str | int | float | bool]


class KernelCounter(Protocol):
    """Something that can count its kernels by state (an executor)."""

    def kernel_states(self) -> dict[str, int]:
        """Kernels by state: ``busy``, ``idle`` (a session's, waiting) and ``warm`` (pooled)."""
        ...


class CallSpan:
    """A call in progress; :meth:`finish` records its outcome (the no-op twin ignores it)."""

    def finish(
        self,
        *,
        status: str,
        error_kind: str | None,
        kernel_restarted: bool,
        lost_outputs: int,
        duration_s: float | None,
    ) -> None:
        """Record the call's outcome on its span and in the metrics."""


class Telemetry:
    """The no-op telemetry used when OpenTelemetry is not installed."""

    @property
    def enabled(self) -> bool:
        """Whether spans and metrics go anywhere (callers may skip the work when not)."""
        return False

    @contextlib.contextmanager
    def call(self, operation: str, attributes: Attributes) -> Iterator[CallSpan]:
        """A span around one ``call_tool`` or ``run_code`` (``operation``)."""
        yield CallSpan()

    @contextlib.contextmanager
    def span(self, name: str, attributes: Attributes) -> Iterator[None]:
        """A span named ``kernelexec.<name>`` around a piece of work (an error marks it)."""
        yield

    def count(self, name: str, attributes: Attributes | None = None) -> None:
        """Add one to the counter ``kernelexec.<name>``."""

    def watch(self, executor: KernelCounter) -> None:
        """Count ``executor``'s kernels in the ``kernelexec.kernels`` gauge while it lives."""


class _OtelCallSpan(CallSpan):
    def __init__(self, telemetry: _Otel, operation: str, span: Any) -> None:
        self._telemetry = telemetry
        self._operation = operation
        self._span = span

    def finish(
        self,
        *,
        status: str,
        error_kind: str | None,
        kernel_restarted: bool,
        lost_outputs: int,
        duration_s: float | None,
    ) -> None:
        span = self._span
        outcome: dict[str, str | int | bool] = {
            "kernelexec.status": status,
            "kernelexec.kernel_restarted": kernel_restarted,
            "kernelexec.lost_outputs": lost_outputs,
        }
        if error_kind is not None:
            outcome["kernelexec.error.kind"] = error_kind
            span.set_status(self._telemetry.error_status(error_kind))
        span.set_attributes(outcome)
        t = self._telemetry
        labels = {"kernelexec.operation": self._operation, "kernelexec.status": status}
        t.calls.add(1, labels)
        if duration_s is not None:
            t.duration.record(duration_s, labels)
        if lost_outputs:
            t.output_lost.add(lost_outputs, {"kernelexec.operation": self._operation})


class _Otel(Telemetry):
    """Telemetry through the OpenTelemetry API."""

    def __init__(self) -> None:
        from opentelemetry import metrics, trace
        from opentelemetry.trace import Status, StatusCode

        self._trace = trace
        self._metrics = metrics
        self._metrics_proxy = _proxy_meter_provider()
        self._configured = False
        self._status = Status
        self._error = StatusCode.ERROR
        version = _version()
        self.tracer = trace.get_tracer("kernelexec", version)
        meter = metrics.get_meter("kernelexec", version)
        self.calls = meter.create_counter("kernelexec.calls", description="Calls by status")
        self.duration = meter.create_histogram(
            "kernelexec.call.duration", unit="s", description="Wall time of a call"
        )
        self.output_lost = meter.create_counter(
            "kernelexec.output.lost", description="Output messages a dead transport lost"
        )
        self._counters: dict[str, Any] = {
            name: meter.create_counter(f"kernelexec.{name}", description=text)
            for name, text in (
                ("kernel.starts", "Kernels started"),
                ("kernel.restarts", "Kernels replaced after a death, a stuck run or a restart"),
                ("env.builds", "Virtual environments built"),
            )
        }
        self._executors: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        meter.create_observable_gauge(
            "kernelexec.kernels",
            callbacks=[self._observe_kernels],
            description="Live kernels by state",
        )

    @property
    def enabled(self) -> bool:
        # Until the application sets a tracer or meter provider, the API's spans and
        # instruments record nothing: skip them (17 us per call here). A provider, once set,
        # stays set, so a yes is kept.
        if not self._configured:
            self._configured = not isinstance(
                self._trace.get_tracer_provider(), self._trace.ProxyTracerProvider
            ) or not isinstance(self._metrics.get_meter_provider(), self._metrics_proxy)
        return self._configured

    def error_status(self, kind: str) -> Any:
        """The span status of a failed call."""
        return self._status(self._error, kind)

    @contextlib.contextmanager
    def call(self, operation: str, attributes: Attributes) -> Iterator[CallSpan]:
        with self.tracer.start_as_current_span(
            f"kernelexec.{operation}", attributes=attributes
        ) as span:
            yield _OtelCallSpan(self, operation, span)

    @contextlib.contextmanager
    def span(self, name: str, attributes: Attributes) -> Iterator[None]:
        with self.tracer.start_as_current_span(f"kernelexec.{name}", attributes=attributes):
            yield

    def count(self, name: str, attributes: Attributes | None = None) -> None:
        self._counters[name].add(1, attributes or {})

    def watch(self, executor: KernelCounter) -> None:
        with self._lock:
            self._executors.add(executor)

    def _observe_kernels(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        totals = {"busy": 0, "idle": 0, "warm": 0}
        with self._lock:
            executors = list(self._executors)
        for executor in executors:
            for state, n in executor.kernel_states().items():
                totals[state] = totals.get(state, 0) + n
        for state, n in totals.items():
            yield Observation(n, {"state": state})


_lock = threading.Lock()
_current: Telemetry | None = None


def telemetry() -> Telemetry:
    """The process's telemetry: OpenTelemetry's when its API is importable, else a no-op."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = _make()
    return _current


def _make() -> Telemetry:
    try:
        import opentelemetry.metrics
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return Telemetry()
    return _Otel()


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kernelexec")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _proxy_meter_provider() -> type:
    """The API's stand-in meter provider class (private in the API: if it moves, every
    provider counts as configured, which costs time, never data)."""
    try:
        from opentelemetry.metrics._internal import _ProxyMeterProvider
    except ImportError:
        return type(None)
    return _ProxyMeterProvider
