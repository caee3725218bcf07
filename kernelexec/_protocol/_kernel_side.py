"""The helper that kernelexec installs inside every kernel.

The host imports this module only for its constants. Its source text is installed in a freshly
started kernel (a kernel module of :mod:`kernelexec._protocol._install`: one execute request, so
it works for any backend and any interpreter that has ipykernel) and executed there as the
module ``__kernelexec__``. It uses the standard library only.

What it does inside the kernel:

* uses ``_kernel_budget.py`` (installed before it): every run's output is capped and counted, and
  the count rides on the reply;
* uses ``_kernel_tuning.py`` (installed before it): no output history (IPython 9 would keep every
  printed byte for the kernel's lifetime), less work per call, fd-level output waited for;
* runs tool calls whose arguments arrive as JSON in the request's metadata, never as code,
  served by its own shell handler (``CALL_REQUEST``, see :func:`_serve_call`) without
  IPython's execute machinery, or from an execute request where that is switched off;
* awaits ``async def`` tools on the kernel's own event loop, so that an interrupt stops them;
* converts return values to JSON (see :func:`to_jsonable` for the rules) and hands them back
  through ``user_expressions`` in the execute reply, a channel the tool's own prints and displays
  cannot write to;
* reports the names of user variables after each run, so the host can say what a restart lost,
  and uses ``_namespace/_kernel_namespace.py`` (installed before it): what each run added, rebound
  and removed rides on its reply, and the variables listing is bounded;
* says, in the reply's payload, when one of its own checks failed (``ERROR_PAYLOAD``): the
  host classifies errors by that, never by an exception's name, which user code controls, and
  a payload the code wrote there itself is dropped (:func:`_sealed`);
* answers fences (``FENCE_REQUEST``), which tell the host that a run has really ended;
* uses ``_kernel_output.py`` (installed before it): output waits for the host instead of being
  dropped, and fd-level output keeps its characters whole.

The constants below are shared with the host half (``kernelexec._protocol._host``), which
imports this module; nothing here imports anything of kernelexec (the companion modules are
installed before this one by the same request, and found in ``sys.modules``).
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import dataclasses
import datetime
import decimal
import enum
import importlib
import inspect
import json
import linecache
import math
import os
import pathlib
import signal
import sys
import uuid
from typing import Any

RESULT_MIME = "application/vnd.kernelexec.result+json"
"""The MIME type of the report the host reads from ``user_expressions``."""

MODULE_NAME = "__kernelexec__"
"""The name this module is installed under in the kernel's ``sys.modules``."""

REPORT_KEY = "kx"
"""The ``user_expressions`` key of the report."""

METADATA_KEY = "kernelexec"
"""The request-metadata key that carries kernelexec's part of a request."""

ERROR_PAYLOAD = "kernelexec.error"
"""The ``source`` of the reply payload that names the kind of a failure kernelexec detected."""

INVALID_TOOL = "invalid_tool"
INVALID_ARGS = "invalid_args"
RESULT_TOO_LARGE = "result_too_large"
_HIDDEN = {"In", "Out", "exit", "quit", "get_ipython", "open"}


class KernelexecInvalidTool(Exception):
    """The tool's source did not compile, failed at definition, or lacks the function."""


class InvalidArguments(Exception):
    """The arguments could not be bound to the tool's signature.

    The host gives the same ``ename`` when it rejects arguments against the schema.
    """


class KernelexecResultTooLarge(Exception):
    """The tool's return value is larger than the configured limit once encoded as JSON."""


CALL_REQUEST = "kernelexec_call_request"
"""The shell message type of a tool call served without the execute machinery (see
:func:`_serve_call`); its reply is ``CALL_REPLY``."""

CALL_REPLY = "kernelexec_call_reply"

FENCE_REQUEST = "kernelexec_fence_request"
"""A shell request answered at once with ``FENCE_REPLY``; sent right after a run's request, its
answer means the kernel has finished the run (see :func:`_fence_handler`)."""

FENCE_REPLY = "kernelexec_fence_reply"

CAPABILITIES_PAYLOAD = "kernelexec.capabilities"
"""The ``source`` of the install reply's payload that lists what this kernel's helper serves."""

SERVES = "serves"
"""The capabilities payload's list of what the helper serves (``"call"``, ``"fence"``)."""

ERROR_KIND = "kind"
"""The ``ERROR_PAYLOAD``'s key naming the kind of failure (:data:`INVALID_TOOL`, ...)."""

# The keys of kernelexec's part of a request's metadata (under METADATA_KEY): a tool call's
# spec, a run's own environment variables, and a fresh kernel's settings.
CALL_NAME = "name"
CALL_DIGEST = "digest"
CALL_SOURCE = "source"
CALL_ARGS = "args"
CALL_AGENT_STATE = "agent_state"
CALL_MAX_RESULT_CHARS = "max_result_chars"
CALL_DISPLAY = "display"
CALL_ASYNC = "async"
RUN_ENV = "env"
CONFIGURE = "configure"

# The keys of the report (the JSON under RESULT_MIME in the REPORT_KEY user expression), and of
# a tool call's result in it.
REPORT_NAMES = "names"
REPORT_RESULT = "result"
REPORT_LANGUAGE_INFO = "language_info"
RESULT_RETURN = "return"
RESULT_AGENT_STATE = "agent_state"

BUDGET_MODULE_NAME = "__kernelexec_budget__"
"""The name ``_kernel_budget.py`` (the output budget and count) is installed under."""

TUNING_MODULE_NAME = "__kernelexec_tuning__"
"""The name ``_kernel_tuning.py`` (install-time tuning of ipykernel and IPython) is installed
under."""

OUTPUT_MODULE_NAME = "__kernelexec_output__"
"""The name ``_kernel_output.py`` (flow control, whole characters) is installed under."""

NAMESPACE_MODULE_NAME = "__kernelexec_namespace__"
"""The name ``_namespace/_kernel_namespace.py`` (a run's changes, the variables listing) is
installed under."""

COMPILED_MODULE_NAME = "__kernelexec_compiled__"
"""A module a fork server leaves in its kernels: ``codes`` maps each of these sources, as the
install request carries it, to its code, compiled once in the server (see ``_forkserver``)."""

CHANGES_PAYLOAD = "kernelexec.changes"
"""The ``source`` of the reply payload with a run's changes (the namespace module's)."""

KERNEL_FILENAME = "<kernelexec>"
"""The file name every kernel half is compiled under (a tool's traceback starts below them)."""

_budgets: Any = None  # ``_kernel_budget``, once install() has executed it


_state: dict[str, Any] = {"result": None, "tools": {}, "budget": None}


def _ip() -> Any:
    shell = _state.get("shell")
    if shell is None:  # before install(); IPython's module __getattr__ makes this import slow
        from IPython import get_ipython

        shell = get_ipython()
    return shell


def _payload() -> dict[str, Any]:
    parent = _ip().kernel.get_parent()
    return dict(parent.get("metadata", {}).get(METADATA_KEY, {}))


def _failed(kind: str, error: Exception) -> Exception:
    """Note what kind of failure ``error`` is: one of kernelexec's own checks failed.

    The note is the run's verdict; the reply carries it (:func:`_sealed`), whatever the run's
    status. The tool's own code runs between the checks before it and the check after it,
    and the verdict is cleared once that code is done (:func:`call`), so the tool cannot leave
    one of its own.
    """
    _state["verdict"] = kind
    return error


def _sealed(payloads: Any) -> list[Any]:
    """A reply's payloads with the run's verdict as the only ``ERROR_PAYLOAD``: whatever the
    code wrote there itself (``payload_manager.write_payload``) is dropped."""
    kind = _state.pop("verdict", None)
    kept = [
        p
        for p in (payloads if isinstance(payloads, list) else [])
        if not (isinstance(p, dict) and p.get("source") in (ERROR_PAYLOAD, CHANGES_PAYLOAD))
    ]
    if kind:
        kept.append({"source": ERROR_PAYLOAD, ERROR_KIND: kind})
    tracker = _state.get("tracker")
    changes = tracker.changes() if tracker is not None else None
    if changes is not None:
        kept.append(changes)
    return kept


def _fast_report(expression: str) -> None:
    """Answer kernelexec's own report expression without IPython's display formatter.

    ``user_expressions`` runs every registered formatter (HTML, LaTeX, PNG, ...) over the
    result; for the report only one JSON string is wanted. Other expressions go the usual way.
    """
    shell = _ip()
    original = shell.user_expressions

    def user_expressions(expressions: dict[str, str]) -> dict[str, Any]:
        if len(expressions) != 1 or expressions.get(REPORT_KEY) != expression:
            return dict(original(expressions))
        try:
            data = _Report()._repr_mimebundle_()
        except Exception:
            return dict(original(expressions))
        return {REPORT_KEY: {"status": "ok", "data": data, "metadata": {}}}

    shell.user_expressions = user_expressions


def install() -> None:
    """Set up the kernel for kernelexec; called once after the kernel starts."""
    global _budgets
    cfg = _payload()
    if "debugpy" in sys.modules and sys.modules["debugpy"] is None:
        del sys.modules["debugpy"]  # blocked only while ipykernel started (see the launcher)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # big integers cross as JSON both ways (see the README)
    _budgets = sys.modules[BUDGET_MODULE_NAME]
    tuning = sys.modules[TUNING_MODULE_NAME]
    budget = _budgets.Budget(int(cfg.get("max_output_chars", 1_000_000)))
    _state["budget"] = budget
    if cfg.get("title_source"):
        titles: dict[str, Any] = {}
        exec(compile(cfg["title_source"], "<kernelexec title>", "exec"), titles)
        _state["set_title"] = titles.get("kx_set_title")
    shell = _ip()
    _state["shell"] = shell
    kernel = shell.kernel
    tuning.keep_no_output_history(shell)
    tuning.quiet_debug_log(kernel)
    streams = [s for s in (sys.stdout, sys.stderr) if hasattr(s, "session")]
    output = sys.modules.get(OUTPUT_MODULE_NAME)
    gate = None
    readers: list[Any] = []  # kernelexec's readers of the captured fds (see wait_for_fd_output)
    if output is not None:
        for stream in streams:
            reader = output.decode_whole_characters(stream)
            if reader is not None:
                readers.append(reader)
        if cfg.get("flow_control", True):
            gate = output.install_flow_control(kernel, streams)
    _state["gate"] = gate
    guarded: set[int] = set()
    for owner in (kernel, sys.stdout, sys.stderr, shell.displayhook, shell.display_pub):
        session = getattr(owner, "session", None)
        if session is not None and id(session) not in guarded:
            guarded.add(id(session))
            _budgets.guard_session(session, budget, gate)
    if cfg.get("fast_paths", True):
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "session"):  # an ipykernel OutStream
                tuning.skip_empty_flush(stream)
    if cfg.get("fast_paths", True):
        tuning.fast_dates()
    if cfg.get("fast_paths", True) and cfg.get("report_expression"):
        _fast_report(cfg["report_expression"])
    polled = [s for s in streams if all(r.stream is not s for r in readers)]
    shell.events.register("post_execute", lambda: tuning.wait_for_fd_output(readers, polled))
    namespace = sys.modules.get(NAMESPACE_MODULE_NAME)
    if namespace is not None:
        tracker = _state["tracker"] = namespace.Tracker(shell)
        # A function of this module: a branch drops this module's hooks before installing it
        # again (a bound method of the tracker's would stay, and run twice).
        shell.events.register("pre_execute", lambda: tracker.before())
    shell.events.register("pre_execute", lambda: budget.reset(_run_id()))
    shell.events.register("pre_execute", lambda: _state.pop("verdict", None))
    shell.events.register("pre_execute", configure)
    shell.events.register("pre_execute", _enter_env)
    _hold_interrupts(kernel, shell)
    finish_metadata = kernel.finish_metadata

    def finish(parent: Any, metadata: Any, reply_content: Any) -> Any:
        # Called after every execute request, sync or async cell, success or error (IPython
        # skips post_execute for top-level-await cells): the one place to end an overlay.
        # The run's output was flushed just before, so its count is complete here.
        _leave_env()
        if isinstance(reply_content, dict):
            reply_content["payload"] = _sealed(reply_content.get("payload"))
        _budgets.account(budget, parent, reply_content)
        return finish_metadata(parent, metadata, reply_content)

    kernel.finish_metadata = finish
    handlers: dict[str, Any] = {"fence": (FENCE_REQUEST, _fence_handler(kernel))}
    if cfg.get("fast_calls", True):
        handlers["call"] = (CALL_REQUEST, _call_handler(kernel, shell, budget))
    served = _serve(kernel, handlers)
    shell.payload_manager.write_payload({"source": CAPABILITIES_PAYLOAD, SERVES: served})
    tuning.return_free_memory()


def _serve(kernel: Any, handlers: dict[str, tuple[str, Any]]) -> list[str]:
    """Register kernelexec's own shell handlers (name -> message type, handler); the names
    registered, none when this ipykernel has no handler table (the host then sends execute
    requests and no fences).

    ipykernel publishes ``status: busy``/``idle`` around every shell request; for these it
    does not: a call's reply says how many output messages were sent, which tells the host
    when it has them all (the one thing idle was for), and two iopub messages less per call is
    a quarter of a warm call's kernel time.
    """
    table = getattr(kernel, "shell_handlers", None)
    publish = getattr(kernel, "_publish_status", None)
    if not isinstance(table, dict) or publish is None or not hasattr(kernel, "get_parent"):
        return []
    quiet = {msg_type for msg_type, _ in handlers.values()}

    def publish_status(status: Any, channel: Any, parent: Any = None) -> Any:
        msg = parent if parent is not None else kernel.get_parent(channel)
        header = msg.get("header") if isinstance(msg, dict) else None
        if isinstance(header, dict) and header.get("msg_type") in quiet:
            return None
        return publish(status, channel, parent)

    kernel._publish_status = publish_status
    for msg_type, handler in handlers.values():
        table[msg_type] = handler
    return sorted(handlers)


class _HeldInterrupt:
    """A SIGINT held from the start of a run's shell handler until its code starts.

    ipykernel ignores SIGINT between shell requests and installs Python's default handler as
    each handler starts. A SIGINT in the gap before the code runs (kernelexec's
    ``pre_execute`` callbacks, users', IPython's own) raised there, and IPython's event
    trigger catches and prints it: the code then ran on as if never interrupted (measured: 3
    of 120 interrupts sent as ``execute_input`` arrived). Here the gap only records the
    signal, and :meth:`release` raises it where the code starts: the last AST transformer, or
    a served call's start. The host holds an interrupt until the run's ``execute_input``
    (see ``RunOutcome.interrupt_now``), so one sent before the handler started is not lost
    either.
    """

    def __init__(self) -> None:
        self.seen = False

    def record(self, signum: int, frame: Any) -> None:
        self.seen = True

    def arm(self) -> None:
        """A run's handler starts: hold SIGINT (where ipykernel just set the default)."""
        self.seen = False
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self.record)

    def release(self) -> None:
        """The run's code starts: SIGINT raises again, and one held till now is raised."""
        if signal.getsignal(signal.SIGINT) == self.record:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.seen:
            self.seen = False
            # Through whatever handler is in place: the default raises KeyboardInterrupt
            # here, ipykernel's own for a top-level-await cell cancels the cell.
            signal.raise_signal(signal.SIGINT)


_held_interrupt = _HeldInterrupt()


class _CodeStarts(ast.NodeTransformer):
    """The last AST transformer: IPython runs it right before the cell's code."""

    def visit(self, node: Any) -> Any:
        _held_interrupt.release()
        return node


def _hold_interrupts(kernel: Any, shell: Any) -> None:
    """Hold SIGINT while a run's request is set up (see :class:`_HeldInterrupt`)."""
    original = kernel.__dict__.get("_kx_pre_handler_hook") or kernel.pre_handler_hook
    kernel._kx_pre_handler_hook = original
    runs = {"execute_request", CALL_REQUEST}

    def pre_handler_hook() -> None:
        original()
        parent = kernel.get_parent("shell") if hasattr(kernel, "get_parent") else None
        header = parent.get("header") if isinstance(parent, dict) else None
        if isinstance(header, dict) and header.get("msg_type") in runs:
            _held_interrupt.arm()

    kernel.pre_handler_hook = pre_handler_hook
    transformers = shell.ast_transformers
    transformers[:] = [t for t in transformers if type(t).__name__ != _CodeStarts.__name__]
    transformers.append(_CodeStarts())


def _call_handler(kernel: Any, shell: Any, budget: Any) -> Any:
    async def handler(stream: Any, ident: Any, parent: Any) -> None:
        await _serve_call(kernel, shell, budget, stream, ident, parent)

    return handler


def _fence_handler(kernel: Any) -> Any:
    """Answers ``FENCE_REQUEST`` at once. ipykernel handles shell requests one at a time, so
    the answer to a fence sent right after a run's request leaves only once the kernel has
    finished that run: the host ends a run on that, not on a reply the run's own code may
    have forged (it holds the session key)."""
    send = kernel.session.send

    async def handler(stream: Any, ident: Any, parent: Any) -> None:
        send(stream, FENCE_REPLY, {}, parent, ident=ident)

    return handler


async def _serve_call(
    kernel: Any, shell: Any, budget: Any, stream: Any, ident: Any, parent: Any
) -> None:
    """Run one tool call and answer in the reply, as an execute request would have.

    Everything the execute path does that a tool call relies on happens here too: the
    ``pre_execute``/``post_execute`` events (the output budget, the session's settings, the
    wait for fd output, users' hooks), stdin refused, the execution count, the return value
    displayed when the call is recorded, errors shown as an ``error`` output with IPython's
    traceback, the payloads, and the report in ``user_expressions``. What it skips is the
    execute machinery: ``execute_input``, busy/idle, input transformers, compiling a cell,
    history. SIGINT reaches the tool as ``KeyboardInterrupt`` (ipykernel installs the default
    handler around every shell handler).
    """
    reply: dict[str, Any] = {"status": "ok"}
    try:
        spec = _payload()
        count = shell.execution_count
        shell.execution_count = count + 1  # as IPython does before running a cell
        shell.events.trigger("pre_execute")
        forward = getattr(kernel, "_forward_input", None)
        if forward is not None:
            forward(False)
        try:
            _held_interrupt.release()  # raises KeyboardInterrupt for a SIGINT held till now
            value = await acall() if spec.get(CALL_ASYNC) else call()
            if value is not None:
                _show_result(shell, value)
        except SystemExit:
            shell.showtraceback(exception_only=True)
            reply = _error_reply(shell)
        except BaseException:
            shell.showtraceback(exc_tuple=_users_frames(*sys.exc_info()), tb_offset=0)
            reply = _error_reply(shell)
        finally:
            if forward is not None:
                kernel._restore_input()
            shell.events.trigger("post_execute")
            for out in (sys.stdout, sys.stderr):
                if out is not None:
                    out.flush()
        reply["execution_count"] = count
        reply["user_expressions"] = {
            REPORT_KEY: {"status": "ok", "data": _Report()._repr_mimebundle_(), "metadata": {}}
        }
        reply["payload"] = _sealed(list(shell.payload_manager.read_payload()))
        shell.payload_manager.clear_payload()
        _budgets.account(budget, parent, reply)
    except BaseException as exc:  # a fault of kernelexec's own: answer rather than go silent
        reply = {
            "status": "error",
            "ename": type(exc).__name__,
            "evalue": f"kernelexec's kernel side failed serving the call: {exc}",
            "traceback": [],
            "payload": [],
        }
    kernel.session.send(stream, CALL_REPLY, reply, parent, ident=ident)


def _users_frames(etype: Any, value: Any, tb: Any) -> tuple[Any, Any, Any]:
    """The exception with kernelexec's own frames taken off the front of its traceback (all
    kept when there is nothing else: then the error is kernelexec's own check)."""
    first = tb
    while tb is not None and tb.tb_frame.f_code.co_filename == KERNEL_FILENAME:
        tb = tb.tb_next
    return etype, value, tb if tb is not None else first


def _error_reply(shell: Any) -> dict[str, Any]:
    etype, evalue, _ = sys.exc_info()
    return {
        "status": "error",
        "ename": getattr(etype, "__name__", "Error"),
        "evalue": str(evalue),
        "traceback": list(getattr(shell, "_last_traceback", None) or []),
    }


def _show_result(shell: Any, value: Any) -> None:
    """Show a recorded call's return value as the cell's result, as IPython's displayhook
    does for a cell's last expression (``execute_result``, ``_``/``Out`` updated)."""
    hook = shell.displayhook
    hook.check_for_underscore()
    hook.start_displayhook()
    hook.write_output_prompt()
    data, metadata = hook.compute_format_data(value)
    hook.update_user_ns(value)
    hook.fill_exec_result(value)
    if data:
        hook.write_format_data(data, metadata)
        hook.log_output(data)
    hook.finish_displayhook()


def _run_id() -> Any:
    return _budgets.parent_id(_ip().kernel.get_parent())


def _enter_env() -> None:
    """Set a run's per-call environment variables (``pre_execute``); see :func:`_leave_env`."""
    _leave_env()  # a previous overlay is never left behind, whatever ended that run
    env = _payload().get(RUN_ENV) or {}
    if env and CALL_NAME not in _payload():  # tool calls overlay around the call itself
        _state["env_saved"] = {key: os.environ.get(key) for key in env}
        os.environ.update(env)


def _leave_env() -> None:
    saved = _state.pop("env_saved", None)
    for key, old in (saved or {}).items():
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def configure() -> None:
    """Apply per-session settings that ride on a session's first request (``pre_execute``).

    The host adds ``configure`` (the working directory, the kernel's title, and for backends
    whose kernel service may filter the environment the executor's ``env_vars``) to the metadata
    of the first request a kernel gets from a session, which saves a round trip; that run's
    report also carries the kernel's ``language_info`` (for notebook recordings).
    """
    cfg = _payload().get(CONFIGURE)
    if not cfg:
        return
    if cfg.get("cwd"):
        os.makedirs(cfg["cwd"], exist_ok=True)
        os.chdir(cfg["cwd"])
        # Kept for the files helper: later code may chdir away, and a relative working
        # directory (a gateway kernel's) means something else once the kernel is inside it.
        _state["workdir"] = os.getcwd()
    set_title = _state.get("set_title")
    if cfg.get("title") and set_title is not None:
        set_title(cfg["title"])  # ``kernelexec kernel <agent id> [<isolation>]`` in ps
    if cfg.get("env"):  # the executor's env_vars, where the backend's launch may drop them
        os.environ.update(cfg["env"])
    _state["language_info"] = dict(getattr(_ip().kernel, "language_info", {}))


def warm_tracebacks() -> None:
    """Format one traceback, so a prewarmed kernel's first error is not ~45 ms slower than the
    rest (IPython loads its traceback machinery on first use)."""
    try:
        raise ZeroDivisionError("warm-up")
    except ZeroDivisionError:
        _ip().InteractiveTB.structured_traceback(*sys.exc_info())


def user_names() -> list[str]:
    """Names the user (or a tool) defined in the interactive namespace."""
    ip = _ip()
    hidden = ip.user_ns_hidden
    names = sorted(
        name
        for name in ip.user_ns
        if not name.startswith("_") and name not in hidden and name not in _HIDDEN
    )
    if not all(map(str.isascii, names)) and NAMESPACE_MODULE_NAME in sys.modules:
        # A name with a lone surrogate would stop the reply from being sent at all.
        names = sorted(map(sys.modules[NAMESPACE_MODULE_NAME].text, names))
    return names


class _Report:
    """What the host reads back from ``user_expressions`` after every run."""

    def __repr__(self) -> str:
        return "<kernelexec report>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        result, _state["result"] = _state["result"], None
        report: dict[str, Any] = {REPORT_NAMES: user_names(), REPORT_RESULT: result}
        for key, hook in _state.get("report_hooks", {}).items():  # e.g. durable checkpoints
            report[key] = hook()
        if _state.get("language_info"):
            report[REPORT_LANGUAGE_INFO] = _state.pop("language_info")
        return {RESULT_MIME: json.dumps(report, ensure_ascii=False, allow_nan=False)}


def report() -> _Report:
    return _Report()


def variables() -> Any:
    """For the host's variables view (``AsyncSession.variables``): the namespace module's
    bounded listing."""
    return sys.modules[NAMESPACE_MODULE_NAME].listing(_ip(), RESULT_MIME)


def _define(name: str, source: str, digest: str) -> tuple[Any, inspect.Signature | None]:
    filename = f"<kernelexec tool {name}>"
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as exc:
        raise _failed(INVALID_TOOL, KernelexecInvalidTool(f"{type(exc).__name__}: {exc}")) from None
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        exec(code, _ip().user_ns)
    except Exception as exc:
        message = f"defining tool {name!r} raised {type(exc).__name__}: {exc}"
        raise _failed(INVALID_TOOL, KernelexecInvalidTool(message)) from exc
    fn = _ip().user_ns.get(name)
    if not callable(fn):
        message = f"the tool source defines no function named {name!r}"
        raise _failed(INVALID_TOOL, KernelexecInvalidTool(message))
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None  # builtins without a signature: let the call itself complain
    _refuse_shape(name, fn, signature)
    _state["tools"][name] = (digest, fn, signature)
    return fn, signature


def _refuse_shape(name: str, fn: Any, signature: inspect.Signature | None) -> None:
    """The shapes ``Tool.from_source`` refuses, refused again for a ``Tool`` built by hand."""
    problem = None
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        problem = "is a generator function (it yields); its body would never run"
    elif signature is not None and any(
        p.kind is inspect.Parameter.POSITIONAL_ONLY for p in signature.parameters.values()
    ):
        problem = "has positional-only parameters; arguments arrive by name"
    if problem:
        raise _failed(INVALID_TOOL, KernelexecInvalidTool(f"tool {name!r} {problem}"))


def _load_agent_state(spec: dict[str, Any]) -> Any:
    data = spec["data"]
    cls_path = spec.get("class")
    if cls_path:
        module_name, _, qualname = cls_path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj.model_validate(data)
        except Exception:
            pass  # the class is not importable here: the tool gets attribute-style data
    return _wrap(data)


class AttrDict(dict):  # type: ignore[type-arg]
    """A dict whose keys can also be read and written as attributes."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return AttrDict({k: _wrap(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _prepare() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The tool function, its bound arguments and the request's spec, from the metadata."""
    _state["result"] = None
    _state["verdict"] = None
    spec = _payload()
    name = spec[CALL_NAME]
    # The source comes with every call; it is executed only when new or changed, and the
    # function is kept here so user code rebinding the name does not change the tool.
    digest, fn, signature = _state["tools"].get(name, (None, None, None))
    if digest != spec[CALL_DIGEST]:
        fn, signature = _define(name, spec[CALL_SOURCE], spec[CALL_DIGEST])
    args = json.loads(spec[CALL_ARGS])
    if CALL_AGENT_STATE in spec:
        args["agent_state"] = _load_agent_state(spec[CALL_AGENT_STATE])
    if signature is not None:
        try:
            signature.bind(**args)
        except TypeError as exc:
            raise _failed(INVALID_ARGS, InvalidArguments(f"{name}(): {exc}")) from None
    return fn, args, spec


@contextlib.contextmanager
def _call_env(spec: dict[str, Any]) -> Any:
    """The call's own environment variables, set only while the tool runs."""
    env = spec.get(RUN_ENV) or {}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def call() -> Any:
    """Run the tool call described in the request metadata; the result waits for ``report``.

    When the request asks for ``display`` (a recorded session), the return value is also
    returned, so that IPython shows it as the cell's result exactly as the recorded call would.
    The host sends ``await acall()`` instead for ``async def`` tools; a plain function that
    returns an awaitable anyway is refused rather than reported as an un-awaited object.
    """
    finish = _finish  # bound before the tool's code runs (it may rebind module names)
    fn, args, spec = _prepare()
    try:
        with _call_env(spec):
            value = fn(**args)
    finally:
        _state["verdict"] = None  # a verdict the tool's own code left is not kernelexec's
    if inspect.isawaitable(value):
        close = getattr(value, "close", None)
        if callable(close):
            close()  # no "coroutine was never awaited" warning on top of the error
        message = (
            f"tool {spec[CALL_NAME]!r} returned an awaitable but is not defined with `async def`; "
            "kernelexec awaits only async def tools"
        )
        raise _failed(INVALID_TOOL, KernelexecInvalidTool(message))
    return finish(value, args, spec)


async def acall() -> Any:
    """:func:`call` for ``async def`` tools, awaited on the kernel's own event loop.

    The request's code is ``await __kernelexec__.acall()``, a top-level-await cell that
    IPython runs as a task on the kernel's running loop; the tool's coroutine gets a task of
    its own, so an interrupt can cancel it (see :func:`_await_interruptibly`).
    """
    finish = _finish
    fn, args, spec = _prepare()
    try:
        with _call_env(spec):
            value = fn(**args)
            if inspect.isawaitable(value):
                value = await _await_interruptibly(value)
    finally:
        _state["verdict"] = None
    return finish(value, args, spec)


async def _await_interruptibly(awaitable: Any) -> Any:
    """Await ``awaitable`` as its own task; SIGINT cancels it and raises KeyboardInterrupt.

    ipykernel's own SIGINT handling for async cells only takes effect once the loop wakes up
    (measured with ipykernel 7.4: an interrupted ``await asyncio.sleep(10)`` ended after the
    full 10 s, as ``CancelledError``). Here the handler wakes the loop at once; when the signal
    lands in the tool's own code (a busy loop between awaits) it raises there instead.
    KeyboardInterrupt is raised from this coroutine, inside the cell, where IPython reports
    it like an interrupted sync tool; it never escapes into the event loop.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        if asyncio.current_task(loop) is task:
            raise asyncio.CancelledError  # in the tool's own code: the task ends cancelled
        loop.call_soon_threadsafe(task.cancel)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return await task
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if not task.done():
            task.cancel()


def _finish(value: Any, args: dict[str, Any], spec: dict[str, Any]) -> Any:
    """Keep the JSON result for ``report``; return ``value`` when the cell should show it."""
    result: dict[str, Any] = {RESULT_RETURN: to_jsonable(value)}
    if CALL_AGENT_STATE in spec:
        result[RESULT_AGENT_STATE] = to_jsonable(args["agent_state"])
    limit = int(spec.get(CALL_MAX_RESULT_CHARS, 10_000_000))
    for part, data in result.items():
        size = len(json.dumps(data, ensure_ascii=False, allow_nan=False))
        if size > limit:
            what = "return value" if part == RESULT_RETURN else "agent state"
            message = f"the {what} is {size} characters as JSON; the limit is {limit}"
            raise _failed(RESULT_TOO_LARGE, KernelexecResultTooLarge(message))
    _state["result"] = result
    return value if spec.get(CALL_DISPLAY) else None


def _float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


MAX_DEPTH = 100
"""The deepest nesting of a return value or agent state (the host checks arguments the same)."""


def to_jsonable(value: Any, _seen: set[int] | None = None, _depth: int = 0) -> Any:
    """Convert a value to JSON data, never failing.

    Rules: JSON types pass through (non-finite floats become ``"NaN"``/``"Infinity"``/
    ``"-Infinity"``); tuples, sets and other iterables of known size become lists (sets sorted
    when their items can be ordered); mapping keys become strings; datetime, date and time become
    ISO 8601 text; timedelta becomes seconds; Decimal, UUID and paths become text; bytes become
    text when they are UTF-8, else base64; enums become their value; pydantic models their
    ``model_dump(mode="json")``; dataclasses their fields; objects with ``tolist`` or ``to_dict``
    (NumPy, pandas) what those return; anything else its ``repr``. A container that contains
    itself yields ``"<circular reference>"`` at the point of recursion. A value nested deeper
    than ``MAX_DEPTH`` fails the call as ``result_too_large``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _float(value)
    if _depth >= MAX_DEPTH:
        message = f"the value is nested deeper than {MAX_DEPTH} levels (the limit on JSON nesting)"
        raise _failed(RESULT_TOO_LARGE, KernelexecResultTooLarge(message))
    depth = _depth + 1
    seen = _seen if _seen is not None else set()
    if id(value) in seen:
        return "<circular reference>"
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, seen, depth)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (decimal.Decimal, uuid.UUID, pathlib.PurePath)):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    seen.add(id(value))
    try:
        if isinstance(value, dict):
            return {_key(k): to_jsonable(v, seen, depth) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [to_jsonable(v, seen, depth) for v in value]
        if isinstance(value, (set, frozenset)):
            items = list(value)
            with contextlib.suppress(TypeError):
                items.sort()
            return [to_jsonable(v, seen, depth) for v in items]
        dump = getattr(value, "model_dump", None)
        if callable(dump) and not isinstance(value, type):
            try:
                return to_jsonable(dump(mode="json"), seen, depth)
            except Exception:
                pass
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {
                f.name: to_jsonable(getattr(value, f.name), seen, depth)
                for f in dataclasses.fields(value)
            }
        for method in ("tolist", "to_dict"):
            fn = getattr(value, method, None)
            if callable(fn) and not isinstance(value, type):
                try:
                    return to_jsonable(fn(), seen, depth)
                except Exception:
                    pass
        return _safe_repr(value)
    finally:
        seen.discard(id(value))


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return _safe_repr(key)


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<unrepresentable {type(value).__name__}: {type(exc).__name__}>"
