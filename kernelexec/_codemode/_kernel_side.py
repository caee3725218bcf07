"""The kernel half of code mode: modules of stubs that call functions on the host.

Never imported by the host for running: its source text is sent to a kernel (in the metadata
of one execute request, as ``_protocol/_host.py`` does for kernelexec's main helper) and executed
there as the module ``__kernelexec_codemode__``. Standard library only.

A stub (``from tools import search``) has the host function's signature and docstring. Calling
it binds the arguments like a real call, checks that they are JSON values, and sends them to the
host as a ``HOST_CALL`` message on iopub, with the running request as its parent; the host
answers with a ``HOST_REPLY`` message on the control channel, which ipykernel handles on its
control thread, so the waiting code (a blocked thread, or an awaiting coroutine for an
``async def`` host function) is woken while the main thread is busy running the cell. Every call
carries an id made here; a reply for an id nobody waits for (late, forged, after an interrupt)
is dropped. Calls are refused while no request is running, and every call still waiting when
its request ends fails: the host answers nothing after a run.

The constants below are shared with the host half (``_codemode/_calls.py``), which imports
them; nothing here imports anything of kernelexec.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import sys
import threading
import types
import uuid
from typing import Any

MODULE_NAME = "__kernelexec_codemode__"
"""The name this module is installed under in the kernel's ``sys.modules``."""

METADATA_KEY = "kernelexec_codemode"
"""The request-metadata key of code mode's part of a request (modules to install)."""

HOST_CALL = "kernelexec_host_call"
"""The iopub message type of a call from kernel code to the host."""

HOST_REPLY = "kernelexec_host_reply"
"""The control message type of the host's answer to a ``HOST_CALL``."""

MAX_DEPTH = 100
"""The deepest nesting of an argument (the host checks values the same)."""

MAX_IN_FLIGHT = 64
"""Calls of this kernel waiting for the host at once, unless the host says otherwise at install
(its ``max_host_calls_in_flight``, which it enforces: a call past it is refused there); more
wait here for a slot. Also a guard: the calls' messages stay far below ZeroMQ's high-water mark
of 1,000 on iopub, past which messages are dropped when the host falls behind (as outputs can
be, see ``lost_outputs``), and a dropped call would wait until the run's timeout. Not seen to
drop here without it (10,000 calls gathered at once all arrived); the bound costs nothing
measurable."""


class HostCallError(Exception):
    """A call to a host function failed; the subclasses say why. Only the host's message
    arrives here, never its traceback."""


class HostFunctionError(HostCallError):
    """The host function raised; ``host_type`` is the name of its exception's class."""

    def __init__(self, message: str, host_type: str = "") -> None:
        super().__init__(message)
        self.host_type = host_type


class HostCallTimeout(HostCallError, TimeoutError):
    """The host function did not answer within its own timeout."""


class HostCallRefused(HostCallError, PermissionError):
    """The host refused the call: no run in progress, the run ended, the function is not
    exposed, or the run's call limit is spent."""


class HostCallLimitExceeded(HostCallRefused):
    """A bound of the host was reached (the message names it): the run's calls
    (``max_host_calls``), the session's calls in flight (``max_host_calls_in_flight``), or the
    bytes of a call's arguments or answer (``max_host_call_bytes``)."""


class HostCallCancelled(HostCallError):
    """The run was interrupted while the call waited; the host cancelled it."""


class HostCallInvalidArguments(HostCallError, TypeError):
    """The arguments do not fit the host function's schema (or are not JSON values)."""


_ERRORS: dict[str, type[HostCallError]] = {
    "error": HostFunctionError,
    "timeout": HostCallTimeout,
    "refused": HostCallRefused,
    "limit": HostCallLimitExceeded,
    "cancelled": HostCallCancelled,
    "invalid_args": HostCallInvalidArguments,
}
_EXPORTED = (
    "HostCallError",
    "HostFunctionError",
    "HostCallTimeout",
    "HostCallRefused",
    "HostCallLimitExceeded",
    "HostCallCancelled",
    "HostCallInvalidArguments",
)


class _Waiter:
    """One call waiting for its reply: a thread's event, or a coroutine's future."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.future: asyncio.Future[Any] | None = loop.create_future() if loop else None
        self.event = threading.Event()
        self.reply: dict[str, Any] | None = None

    def settle(self, reply: dict[str, Any]) -> None:
        """Called from the control thread (or at the end of a run)."""
        if self.reply is not None:
            return
        self.reply = reply
        self.event.set()
        if self.loop is not None and self.future is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


class _Slots:
    """A semaphore that threads and coroutines (on any loop) can wait on, first come first
    served; an interrupted wait gives its slot back."""

    def __init__(self, size: int) -> None:
        self.free = size
        self.lock = threading.Lock()
        self.queue: collections.deque[Any] = collections.deque()

    def acquire(self) -> None:
        with self.lock:
            if self.free > 0 and not self.queue:
                self.free -= 1
                return
            event = threading.Event()
            self.queue.append(event)
        try:
            event.wait()
        except BaseException:
            self._abandon(event)
            raise

    async def aacquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self.lock:
            if self.free > 0 and not self.queue:
                self.free -= 1
                return
            future = loop.create_future()
            entry = (loop, future)
            self.queue.append(entry)
        try:
            await future
        except BaseException:
            self._abandon(entry)
            raise

    def _abandon(self, entry: Any) -> None:
        with self.lock:
            try:
                self.queue.remove(entry)
                return  # never handed a slot
            except ValueError:
                pass
        self.release()  # it was handed one while being interrupted: pass it on

    def release(self) -> None:
        with self.lock:
            if not self.queue:
                self.free += 1
                return
            entry = self.queue.popleft()
        if isinstance(entry, threading.Event):
            entry.set()
        else:
            loop, future = entry
            try:
                loop.call_soon_threadsafe(_hand_over, future, self)
            except RuntimeError:  # its loop is closed
                self.release()


def _hand_over(future: asyncio.Future[Any], slots: _Slots) -> None:
    if future.done():
        slots.release()  # cancelled meanwhile
    else:
        future.set_result(None)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernel: Any = None
        self.run: Any = None  # the parent message of the request running now
        self.pending: dict[str, _Waiter] = {}
        self.slots = _Slots(MAX_IN_FLIGHT)
        self.max_bytes = 0  # the most bytes of a call's arguments (0: unbounded)
        self.modules: dict[str, types.ModuleType] = {}  # installed by this module
        self.temporary: list[tuple[str, bool, dict[str, Any]]] = []  # this run's functions:
        # (module, whether the run created it, what each name held before)


_state = _State()
_MISSING = object()


class _Annotation:
    """An annotation shown as the host wrote it (``query: str``, not ``query: 'str'``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _HostDefault:
    """A default that is not a JSON value: the host applies it; shown as its repr there."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def install() -> None:
    """Set up code mode in this kernel (once per kernel: the reply handler and run hooks) and
    apply the modules the request carries (all a kept copy does, in a forked kernel)."""
    from IPython import get_ipython

    shell = get_ipython()
    kernel = shell.kernel
    if _state.kernel is not None:
        _apply(kernel.get_parent().get("metadata", {}).get(METADATA_KEY) or {})
        return
    _state.kernel = kernel
    kernel.control_handlers[HOST_REPLY] = _on_reply
    publish = kernel._publish_status

    def publish_status(status: Any, channel: Any, parent: Any = None) -> Any:
        # No busy/idle around a reply: two iopub messages less per host call.
        msg = parent if parent is not None else kernel.get_parent(channel)
        header = msg.get("header") if isinstance(msg, dict) else None
        if isinstance(header, dict) and header.get("msg_type") == HOST_REPLY:
            return None
        return publish(status, channel, parent)

    kernel._publish_status = publish_status
    shell.events.register("pre_execute", _run_started)
    shell.events.register("post_execute", _run_ended)
    finish_metadata = kernel.finish_metadata

    def finish(parent: Any, metadata: Any, reply_content: Any) -> Any:
        _run_ended()  # IPython skips post_execute for top-level-await cells
        return finish_metadata(parent, metadata, reply_content)

    kernel.finish_metadata = finish
    spec = kernel.get_parent().get("metadata", {}).get(METADATA_KEY) or {}
    bounds = spec.get("bounds") or {}
    if bounds.get("in_flight"):
        _state.slots = _Slots(int(bounds["in_flight"]))
    _state.max_bytes = int(bounds.get("bytes") or 0)
    _apply(spec)


def _run_started() -> None:
    kernel = _state.kernel
    parent = kernel.get_parent()
    spec = (parent.get("metadata") or {}).get(METADATA_KEY) or {}
    with _state.lock:
        _state.run = parent
    _apply(spec)


def _apply(spec: dict[str, Any]) -> None:
    for name, functions in (spec.get("modules") or {}).items():
        _install_module(name, functions)
    for name, functions in (spec.get("once") or {}).items():
        created = sys.modules.get(name) is None
        module = _module(name)
        saved = {f["name"]: module.__dict__.get(f["name"], _MISSING) for f in functions}
        _state.temporary.append((name, created, saved))
        _install_module(name, functions)


def _run_ended() -> None:
    with _state.lock:
        if _state.run is None:
            return
        _state.run = None
        pending = list(_state.pending.values())
        _state.pending.clear()
    for waiter in pending:
        waiter.settle(_refusal("the run ended before the host answered"))
    temporary, _state.temporary = _state.temporary, []
    for name, created, saved in reversed(temporary):
        module = _state.modules.get(name)
        if module is None:
            continue
        for attr, value in saved.items():
            if value is _MISSING:
                module.__dict__.pop(attr, None)
            else:
                setattr(module, attr, value)
        if created:
            _remove(name)


def _refusal(message: str) -> dict[str, Any]:
    return {"ok": False, "kind": "refused", "message": message}


def _on_reply(stream: Any, ident: Any, msg: Any) -> None:
    """The control handler of ``HOST_REPLY`` (runs on ipykernel's control thread)."""
    content = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(content, dict) or not isinstance(content.get("id"), str):
        return
    with _state.lock:
        waiter = _state.pending.pop(content["id"], None)
    if waiter is not None:
        waiter.settle(content)


def _remove(name: str) -> None:
    module = _state.modules.pop(name, None)
    if module is None or sys.modules.get(name) is not module:
        return
    del sys.modules[name]
    parent, _, leaf = name.rpartition(".")
    if parent and getattr(sys.modules.get(parent), leaf, None) is module:
        delattr(sys.modules[parent], leaf)


def _install_module(name: str, functions: list[dict[str, Any]]) -> None:
    """Make ``name`` importable with a stub per function (dotted names make parents)."""
    module = _module(name)
    for spec in functions:
        setattr(module, spec["name"], _stub(name, spec))


def _module(name: str) -> types.ModuleType:
    existing = sys.modules.get(name)
    if existing is not None and _state.modules.get(name) is existing:
        return existing
    if existing is not None:
        raise ImportError(f"cannot expose host functions as {name!r}: a module of that name exists")
    module = types.ModuleType(name, f"Functions of the host, exposed by kernelexec as {name!r}.")
    module.__path__ = []  # a package, so that ``tools.<server>`` can live under it
    for export in _EXPORTED:
        setattr(module, export, globals()[export])
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(_module(parent), leaf, module)
    sys.modules[name] = module
    _state.modules[name] = module
    return module


def _signature(spec: dict[str, Any]) -> inspect.Signature:
    params = []
    for p in spec["params"]:
        kind = (
            inspect.Parameter.KEYWORD_ONLY
            if p.get("keyword_only")
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default: Any = inspect.Parameter.empty
        if "default" in p:
            default = json.loads(p["default"])
        elif "default_repr" in p:
            default = _HostDefault(p["default_repr"])
        annotation = _Annotation(p["annotation"]) if p.get("annotation") else inspect._empty
        params.append(inspect.Parameter(p["name"], kind, default=default, annotation=annotation))
    returns = _Annotation(spec["returns"]) if spec.get("returns") else inspect._empty
    return inspect.Signature(params, return_annotation=returns)


def _stub(module: str, spec: dict[str, Any]) -> Any:
    name = spec["name"]
    signature = _signature(spec)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise HostCallInvalidArguments(f"{name}(): {exc}") from None
        for key, value in bound.arguments.items():
            problem = _json_problem(value, key)
            if problem:
                raise HostCallInvalidArguments(f"{name}(): {problem}")
        text = json.dumps(dict(bound.arguments), ensure_ascii=False, allow_nan=False)
        limit = _state.max_bytes
        if limit and len(text) * 4 > limit:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit:
                raise HostCallLimitExceeded(
                    f"{name}(): the arguments are {size} bytes of JSON; a host call takes at "
                    f"most {limit} (max_host_call_bytes)"
                )
        return text

    stub: Any
    if spec.get("async"):

        async def stub(*args: Any, **kwargs: Any) -> Any:
            text = bind(args, kwargs)
            await _state.slots.aacquire()
            try:
                call_id, waiter = _send(module, name, text, asyncio.get_running_loop())
                try:
                    assert waiter.future is not None
                    await waiter.future
                finally:
                    _forget(call_id)
            finally:
                _state.slots.release()
            return _outcome(waiter)

    else:

        def stub(*args: Any, **kwargs: Any) -> Any:
            text = bind(args, kwargs)
            _state.slots.acquire()
            try:
                call_id, waiter = _send(module, name, text, None)
                try:
                    waiter.event.wait()  # SIGINT interrupts the wait (KeyboardInterrupt)
                finally:
                    _forget(call_id)
            finally:
                _state.slots.release()
            return _outcome(waiter)

    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = module
    stub.__doc__ = spec.get("doc") or None
    stub.__signature__ = signature
    return stub


def _send(
    module: str, name: str, args: str, loop: asyncio.AbstractEventLoop | None
) -> tuple[str, _Waiter]:
    kernel = _state.kernel
    call_id = uuid.uuid4().hex
    waiter = _Waiter(loop)
    with _state.lock:
        parent = _state.run
        if parent is None:
            raise HostCallRefused(
                f"{module}.{name}(): no run in progress; host functions answer only while "
                "the session runs code"
            )
        _state.pending[call_id] = waiter
    content = {"id": call_id, "module": module, "name": name, "args": args}
    kernel.session.send(kernel.iopub_socket, HOST_CALL, content, parent)
    return call_id, waiter


def _forget(call_id: str) -> None:
    with _state.lock:
        _state.pending.pop(call_id, None)


def _outcome(waiter: _Waiter) -> Any:
    reply = waiter.reply or _refusal("no answer")
    if reply.get("ok"):
        return json.loads(reply.get("value", "null"))
    error = _ERRORS.get(str(reply.get("kind")), HostCallError)
    message = str(reply.get("message", ""))
    if error is HostFunctionError:
        raise HostFunctionError(message, str(reply.get("type", "")))
    raise error(message)


def _json_problem(value: Any, name: str) -> str | None:
    """Why ``value`` is not a JSON value that crosses exactly, or None (checked iteratively)."""
    stack: list[tuple[Any, str, int]] = [(value, name, 1)]
    while stack:
        item, where, depth = stack.pop()
        if item is None or isinstance(item, (str, bool, int)):
            continue
        if isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return f"argument {where!r}: {item!r} is not a JSON number"
            continue
        if not isinstance(item, (dict, list, tuple)):
            return f"argument {where!r}: a {type(item).__name__} is not a JSON value"
        if depth > MAX_DEPTH:
            return f"argument {name!r} is nested deeper than {MAX_DEPTH} levels"
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"argument {where!r}: object key {key!r} is not a string"
                stack.append((child, f"{where}.{key}", depth + 1))
        else:
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))
    return None
