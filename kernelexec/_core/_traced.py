"""``traced_call``: the span and metrics around a session's ``call_tool`` and ``run_code``.

The span is opened in the caller's task, so it is a child of the caller's current span (the
blocking facade carries the caller's context onto its loop thread). Without OpenTelemetry the
decorator costs one attribute check per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from kernelexec._models import Execution
from kernelexec._observability._otel import telemetry

if TYPE_CHECKING:
    from kernelexec._core._session import AsyncSession

P = ParamSpec("P")
R = TypeVar("R", bound=Execution)


def traced_call(
    operation: str,
) -> Callable[
    [Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, R]]],
    Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, R]],
]:
    """Trace a session method returning an :class:`~kernelexec.Execution` as
    ``kernelexec.<operation>``."""

    def decorate(
        method: Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, R]],
    ) -> Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, R]]:
        @functools.wraps(method)
        async def traced(self: AsyncSession, /, *args: P.args, **kwargs: P.kwargs) -> R:
            t = telemetry()
            if not t.enabled:
                return await method(self, *args, **kwargs)
            attributes: dict[str, Any] = self._span_attributes()
            if operation == "call_tool":
                tool = args[0] if args else kwargs.get("tool")
                attributes["kernelexec.tool"] = str(getattr(tool, "name", ""))
            with t.call(operation, attributes) as span:
                result = await method(self, *args, **kwargs)
                span.finish(
                    status=result.status,
                    error_kind=result.error.kind if result.error is not None else None,
                    kernel_restarted=result.kernel_restarted,
                    lost_outputs=result.lost_outputs,
                    duration_s=result.duration_s,
                )
                return result

        return traced

    return decorate
