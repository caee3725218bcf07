"""The host half of kernelexec's protocol: building requests, reading replies, naming errors.

A run's request is built by one function (:func:`build_request`, from a :class:`CodeRun` or a
:class:`ToolCall`) and its reply read by one (:func:`read_reply`, into a :class:`Reply`).
Their counterpart runs inside the kernel (``_kernel_side.py`` and its companions, declared
here as kernel modules and installed at start-up by :mod:`._install`); the constants and keys
both halves need are defined there and imported here, so they cannot drift apart. Plain
functions and frozen values: no I/O, no kernel, no state.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import BaseModel

from kernelexec import _json, _proctitle
from kernelexec._models import ErrorKind, ExecError, StateChanges, Variable
from kernelexec._namespace import _kernel_namespace as kernel_namespace
from kernelexec._namespace import _view as view
from kernelexec._protocol import _kernel_budget as kernel_budget
from kernelexec._protocol import _kernel_output as kernel_output
from kernelexec._protocol import _kernel_side as kernel_side
from kernelexec._protocol import _kernel_tuning as kernel_tuning
from kernelexec._protocol._install import ExecuteRequest as ExecuteRequest
from kernelexec._protocol._install import KernelModule, install_request
from kernelexec._tools._tool import Tool

RESULT_MIME = kernel_side.RESULT_MIME
CALL_REQUEST = kernel_side.CALL_REQUEST
CALL_REPLY = kernel_side.CALL_REPLY
FENCE_REQUEST = kernel_side.FENCE_REQUEST
FENCE_REPLY = kernel_side.FENCE_REPLY
_MODULE = f"__import__({kernel_side.MODULE_NAME!r})"
REPORT_EXPRESSION = f"{_MODULE}.report()"
_REPORT = {kernel_side.REPORT_KEY: REPORT_EXPRESSION}
KERNEL_MODULES = (
    KernelModule(kernel_side.BUDGET_MODULE_NAME, kernel_budget.__name__, entry=None),
    KernelModule(kernel_side.TUNING_MODULE_NAME, kernel_tuning.__name__, entry=None),
    KernelModule(kernel_side.OUTPUT_MODULE_NAME, kernel_output.__name__, entry=None),
    KernelModule(kernel_side.NAMESPACE_MODULE_NAME, kernel_namespace.__name__, entry=None),
    KernelModule(kernel_side.MODULE_NAME, kernel_side.__name__),
)
"""The protocol's kernel half and its companions, in the order they are installed (the kernel
side's ``install`` finds the companions in ``sys.modules``)."""
if (view.MODULE_NAME, view.CHANGES_PAYLOAD) != (
    kernel_side.NAMESPACE_MODULE_NAME,
    kernel_side.CHANGES_PAYLOAD,
):  # the kernel side cannot import its companion: the names are spelled twice
    raise ImportError("kernelexec's kernel side and its namespace module disagree")
_KERNEL_KINDS: frozenset[str] = frozenset(
    {kernel_side.INVALID_TOOL, kernel_side.INVALID_ARGS, kernel_side.RESULT_TOO_LARGE}
)


@dataclass(frozen=True, slots=True)
class Report:
    """What the kernel side reports after a successful run.

    Attributes:
        names: The user's variable names now.
        result: A tool call's ``{"return": ..., "agent_state": ...}``, else None.
        language_info: The kernel's ``language_info`` (on a session's first run only).
        extras: What hooks registered in the kernel side added (by key).
    """

    names: tuple[str, ...] = ()
    result: dict[str, Any] | None = None
    language_info: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def kernel_side_sources() -> dict[str, str]:
    """The source texts of the protocol's kernel modules (:data:`KERNEL_MODULES`), by their
    names in the kernel: every new kernel executes them. A fork server compiles them once for
    all its kernels (``backends._forkserver``); a kernel compiles a text its server did not."""
    return {module.name: module.source() for module in KERNEL_MODULES}


def bootstrap_request(
    max_output_chars: int, *, fast_paths: bool | None = None, fast_calls: bool = True
) -> ExecuteRequest:
    """The request that installs the kernel side in a fresh kernel (its sources ride along).

    ``fast_calls`` lets the kernel side serve tool calls itself (:data:`CALL_REQUEST`);
    ``KERNELEXEC_FAST_CALLS=0`` in the environment turns that off whatever the caller says,
    so a whole test suite can run on the execute path.
    """
    if fast_paths is None:
        fast_paths = os.environ.get("KERNELEXEC_NO_FAST_PATHS") != "1"
    fast_calls = fast_calls and os.environ.get("KERNELEXEC_FAST_CALLS", "1") != "0"
    # For benchmarks that measure what flow control saves (``benchmarks/outputs.py``).
    flow_control = os.environ.get("KERNELEXEC_NO_FLOW_CONTROL") != "1"
    return install_request(
        KERNEL_MODULES,
        metadata={
            kernel_side.METADATA_KEY: {
                "max_output_chars": max_output_chars,
                "report_expression": REPORT_EXPRESSION,
                "fast_paths": fast_paths,
                "fast_calls": fast_calls,
                "title_source": _proctitle.SOURCE,
                "flow_control": flow_control,
            }
        },
    )


WARM_TRACEBACKS = ExecuteRequest(
    code=f"{_MODULE}.warm_tracebacks()", silent=True, store_history=False
)
"""Formats one traceback ahead of need, so a prewarmed kernel's first error is not slow."""


VARIABLES_KEY = "kx_vars"
VARIABLES = ExecuteRequest(
    code="",
    silent=True,
    store_history=False,
    user_expressions={VARIABLES_KEY: f"{_MODULE}.variables()"},
)
"""Reads the user's variables (name, type, bounded summary, size) without running
user-visible code."""


def read_variables(reply: dict[str, Any]) -> list[Variable]:
    """The variables from the reply to :data:`VARIABLES` (empty when the kernel sent none)."""
    entry = (reply.get("user_expressions") or {}).get(VARIABLES_KEY) or {}
    return view.read_variables((entry.get("data") or {}).get(RESULT_MIME))


@dataclass(frozen=True, slots=True)
class CodeRun:
    """A ``run_code`` run: the code as it is, and the run's own environment variables."""

    code: str
    env_vars: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call: the tool, its (checked) arguments, and how the kernel side runs it.

    Attributes:
        tool: The tool; its source travels with every call, run only when new or changed.
        args: The arguments by name.
        agent_state: Injected when the tool takes ``agent_state``.
        env_vars: Environment variables set only while the tool runs.
        max_result_chars: The most characters the result may have as JSON.
        display: Show the return value as the cell's result (a recorded session).
    """

    tool: Tool
    args: dict[str, Any]
    agent_state: Any = None
    env_vars: dict[str, str] | None = None
    max_result_chars: int = 10_000_000
    display: bool = False


def build_request(
    run: CodeRun | ToolCall, *, served: bool = False, configure: dict[str, Any] | None = None
) -> ExecuteRequest:
    """The request for ``run``.

    A tool call's arguments travel as JSON in the metadata, never as code; with ``served``
    (the kernel side serves calls, see :func:`serves_calls`) it is the kernel side's own
    message (:data:`CALL_REQUEST`, no code), else an execute request whose cell calls the
    tool (``await``-ed for an ``async def`` tool, so it runs on the kernel's own event loop).
    ``configure``: a session's settings (working directory, ...) for a fresh kernel, riding on
    its first request instead of going on their own (one round trip less per new kernel).
    """
    if isinstance(run, CodeRun):
        spec: dict[str, Any] = {kernel_side.RUN_ENV: dict(run.env_vars)} if run.env_vars else {}
    else:
        spec = _call_spec(run)
    if configure is not None:
        spec[kernel_side.CONFIGURE] = configure
    metadata = {kernel_side.METADATA_KEY: spec} if spec else {}
    if isinstance(run, CodeRun):
        return ExecuteRequest(code=run.code, user_expressions=_REPORT, metadata=metadata)
    code = f"await {_MODULE}.acall()" if run.tool.is_async else f"{_MODULE}.call()"
    if served:  # the same metadata; the code only names what the kernel side runs
        return ExecuteRequest(code=code, metadata=metadata, msg_type=CALL_REQUEST)
    return ExecuteRequest(code=code, user_expressions=_REPORT, metadata=metadata)


def _call_spec(call: ToolCall) -> dict[str, Any]:
    tool = call.tool
    spec: dict[str, Any] = {
        kernel_side.CALL_NAME: tool.name,
        kernel_side.CALL_DIGEST: tool.digest,
        kernel_side.CALL_ARGS: _json.dumps(call.args, ensure_ascii=False),
        kernel_side.RUN_ENV: dict(call.env_vars or {}),
        kernel_side.CALL_MAX_RESULT_CHARS: call.max_result_chars,
        kernel_side.CALL_SOURCE: tool.source_code,
    }
    if tool.takes_agent_state:
        spec[kernel_side.CALL_AGENT_STATE] = dump_state(call.agent_state)
    if call.display:
        spec[kernel_side.CALL_DISPLAY] = True
    if tool.is_async:
        spec[kernel_side.CALL_ASYNC] = True
    return spec


def serves_calls(install_reply: dict[str, Any]) -> bool:
    """Whether the kernel side, by the reply to :func:`bootstrap_request`, serves tool calls."""
    return "call" in _capabilities(install_reply)


def answers_fences(install_reply: dict[str, Any]) -> bool:
    """Whether the kernel side, by the reply to :func:`bootstrap_request`, answers
    :data:`FENCE_REQUEST` (then a run ends on the fence's answer, see ``_core._run``)."""
    return "fence" in _capabilities(install_reply)


def _capabilities(install_reply: dict[str, Any]) -> list[Any]:
    for payload in _payloads(install_reply):
        if payload.get("source") == kernel_side.CAPABILITIES_PAYLOAD:
            serves = payload.get(kernel_side.SERVES)
            return serves if isinstance(serves, list) else []
    return []


def with_configure(request: ExecuteRequest, settings: dict[str, Any]) -> ExecuteRequest:
    """``request`` carrying a session's settings (working directory) for a fresh kernel.

    They ride on the session's first request instead of going on their own: one round trip
    less per new kernel.
    """
    metadata = dict(request.metadata)
    spec = dict(metadata.get(kernel_side.METADATA_KEY) or {})
    spec[kernel_side.CONFIGURE] = settings
    metadata[kernel_side.METADATA_KEY] = spec
    return dataclasses.replace(request, metadata=metadata)


def with_metadata(request: ExecuteRequest, entries: dict[str, Any] | None) -> ExecuteRequest:
    """``request`` with more top-level metadata ``entries`` (another part's own keys)."""
    if not entries:
        return request
    return dataclasses.replace(request, metadata={**request.metadata, **entries})


@dataclass(frozen=True, slots=True)
class OutputCount:
    """What the kernel side says a run's output was: messages sent, outputs suppressed because
    the budget was spent, and the budget."""

    sent: int
    suppressed: int
    limit: int


@dataclass(frozen=True, slots=True)
class Reply:
    """A run's reply as kernelexec reads it (:func:`read_reply`).

    Attributes:
        ok: The reply's status is ``ok``.
        report: The kernel side's report (None when the reply has none).
        count: The kernel side's count of the run's output messages (None: no count).
        verdict: Which of kernelexec's own checks in the kernel failed, if one did.
        asked_exit: The code asked the kernel to exit (``exit()``, ``quit()``).
        changes: The names the run added, rebound and removed (none when not reported).
    """

    ok: bool = False
    report: Report | None = None
    count: OutputCount | None = None
    verdict: ErrorKind | None = None
    asked_exit: bool = False
    changes: StateChanges = view.NO_CHANGES

    def failure_kind(self, *, tool_call: bool) -> ErrorKind:
        """The kind of a failed run: for a tool call, what kernelexec's own checks in the
        kernel said, else ``"exception"``. An exception's name never decides it, nor a payload
        the code wrote itself (the kernel side keeps only its own verdict); kernelexec checks
        nothing in a ``run_code`` run, so its kind is always ``"exception"``."""
        return self.verdict if tool_call and self.verdict is not None else "exception"


def read_reply(reply: dict[str, Any] | None) -> Reply:
    """Read an ``execute_reply`` (or a served call's reply): its status, the kernel side's
    report and output count, its verdict, and whether the code asked the kernel to exit."""
    if reply is None:
        return Reply()
    count: OutputCount | None = None
    verdict: ErrorKind | None = None
    asked_exit = False
    for payload in _payloads(reply):
        source = payload.get("source")
        if source == kernel_budget.OUTPUTS_PAYLOAD:
            count = count or _output_count(payload)
        elif source == kernel_side.ERROR_PAYLOAD:
            kind = payload.get(kernel_side.ERROR_KIND)
            if verdict is None and kind in _KERNEL_KINDS:
                verdict = cast(ErrorKind, kind)
        elif source == "ask_exit":
            asked_exit = True
    return Reply(
        ok=reply.get("status") == "ok",
        report=_read_report(reply),
        count=count,
        verdict=verdict,
        asked_exit=asked_exit,
        changes=view.read_changes(reply),
    )


def _read_report(reply: dict[str, Any]) -> Report | None:
    entry = (reply.get("user_expressions") or {}).get(kernel_side.REPORT_KEY) or {}
    text = (entry.get("data") or {}).get(RESULT_MIME)
    if not isinstance(text, str):
        return None
    try:
        data = _json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    names = data.get(kernel_side.REPORT_NAMES)
    result = data.get(kernel_side.REPORT_RESULT)
    info = data.get(kernel_side.REPORT_LANGUAGE_INFO)
    return Report(
        names=tuple(str(n) for n in names) if isinstance(names, list) else (),
        result=result if isinstance(result, dict) else None,
        language_info=info if isinstance(info, dict) else None,
        extras={k: v for k, v in data.items() if k not in _REPORT_FIELDS},
    )


_REPORT_FIELDS = frozenset(
    {kernel_side.REPORT_NAMES, kernel_side.REPORT_RESULT, kernel_side.REPORT_LANGUAGE_INFO}
)
_COUNT_KEYS = (kernel_budget.SENT, kernel_budget.SUPPRESSED, kernel_budget.LIMIT)


def _output_count(payload: dict[str, Any]) -> OutputCount | None:
    values = [payload.get(k) for k in _COUNT_KEYS]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return OutputCount(*cast(list[int], values))
    return None


INVALID_ARGUMENTS = "InvalidArguments"
"""The ``ename`` of every ``invalid_args`` error, whether the host's schema check or the
kernel's signature check found the problem."""


def error_from(content: dict[str, Any], kind: ErrorKind) -> ExecError:
    """An :class:`ExecError` from an ``error`` output or an error ``execute_reply``.

    An ``invalid_args`` error found in the kernel looks like one the host found: the same
    ``ename`` and no traceback (it would only show kernelexec's own frames).
    """
    if kind == kernel_side.INVALID_ARGS:
        return ExecError(kind=kind, ename=INVALID_ARGUMENTS, evalue=str(content.get("evalue", "")))
    return ExecError(
        kind=kind,
        ename=str(content.get("ename", "Error")),
        evalue=str(content.get("evalue", "")),
        traceback=[str(t) for t in content.get("traceback") or []],
    )


def _payloads(reply: dict[str, Any]) -> list[dict[str, Any]]:
    payloads = reply.get("payload")
    if not isinstance(payloads, list):
        return []
    return [p for p in payloads if isinstance(p, dict)]


def dump_state(state: Any) -> dict[str, Any]:
    """An agent state as JSON data for the kernel, with its pydantic class when it has one."""
    if isinstance(state, BaseModel):
        cls = type(state)
        return {
            "data": state.model_dump(mode="json"),
            "class": f"{cls.__module__}:{cls.__qualname__}",
        }
    return {"data": state_json(state)}


def load_state(original: Any, data: Any) -> Any:
    """The agent state the kernel sent back, as the class the caller passed in when it can."""
    if isinstance(original, BaseModel):
        try:
            return type(original).model_validate(data)
        except Exception:
            return data
    return data


def state_json(agent_state: Any) -> Any:
    """The JSON data of an agent state (pydantic models dumped, anything else via ``str``)."""
    dump = getattr(agent_state, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    return json.loads(json.dumps(agent_state, default=str))
