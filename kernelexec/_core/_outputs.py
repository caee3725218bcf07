"""Collecting a run's outputs: nbformat outputs from iopub messages, within a budget.

Streams are coalesced, ``clear_output(wait=True)`` and display-id updates are honoured, and the
callers' ``on_stdout``/``on_stderr``/``on_display`` hooks see output as it arrives.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from kernelexec._protocol._kernel_budget import OUTPUT_TYPES
from kernelexec.backends._base import KernelMessage

OutputCallback = Callable[[Any], Awaitable[None] | None]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
"""An ipywidget's view: it means something only to a frontend connected to that kernel's comms."""


class CallbackFailed(Exception):
    """A caller's output hook raised ``error``: the run loop stops the run, and the session
    raises ``error`` to the caller once the kernel is ready for the next call."""

    def __init__(self, hook: str, error: Exception) -> None:
        super().__init__(f"the {hook} callback raised {type(error).__name__}: {error}")
        self.hook = hook
        self.error = error


@dataclass
class Callbacks:
    """Optional hooks called as output arrives (sync functions or coroutines)."""

    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None
    on_display: OutputCallback | None = None

    async def emit(self, hook: OutputCallback | None, value: Any) -> None:
        """Call ``hook`` with ``value``.

        Raises:
            CallbackFailed: the hook raised (an ``Exception``).
        """
        if hook is None:
            return
        try:
            ret = hook(value)
            if inspect.isawaitable(ret):
                await ret
        except Exception as exc:
            names = {id(self.on_stdout): "on_stdout", id(self.on_stderr): "on_stderr"}
            raise CallbackFailed(names.get(id(hook), "on_display"), exc) from exc


@dataclass
class Collected:
    """What a run produced, as the collector built it."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: dict[str, Any] | None = None
    execution_count: int | None = None
    received: int = 0  # output messages that arrived (the kernel side counts those it sent)
    widgets_dropped: int = 0


_JSON_MIME = re.compile(r"application/(.*\+)?json")


def notebook_output(kind: str, content: dict[str, Any]) -> dict[str, Any] | None:
    """The nbformat v4 output of an ``execute_result``, ``display_data`` or ``error``
    message, or None when its content does not fit the notebook schema.

    The checks are the schema's for these outputs, written out: validating each output with
    ``nbformat`` (``output_from_msg``) would import nbformat and jsonschema on every
    executor's path, which costs a second where JupyterLab is installed (issue 36).
    """
    if kind == "error":
        ename, evalue = content.get("ename"), content.get("evalue")
        traceback = content.get("traceback")
        if not (isinstance(ename, str) and isinstance(evalue, str) and _strings(traceback)):
            return None
        return {"output_type": kind, "ename": ename, "evalue": evalue, "traceback": list(traceback)}
    data, metadata = content.get("data"), content.get("metadata")
    if not _mimebundle(data) or not isinstance(metadata, dict):
        return None
    output: dict[str, Any] = {"output_type": kind, "metadata": dict(metadata), "data": dict(data)}
    if kind == "execute_result":
        if "execution_count" not in content:
            return None
        count = content["execution_count"]
        if count is not None and (type(count) is not int or count < 0):
            return None
        output["execution_count"] = count
    return output


def _strings(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _mimebundle(data: Any) -> TypeGuard[dict[str, Any]]:
    if not isinstance(data, dict):
        return False
    return all(
        isinstance(mime, str)
        and (_JSON_MIME.fullmatch(mime) is not None or isinstance(value, str) or _strings(value))
        for mime, value in data.items()
    )


_MARKER_SLACK = 4_096  # room for the kernel side's own truncation markers


class OutputCollector:
    """Builds nbformat outputs from iopub messages, within a character budget.

    The kernel side enforces the budget before it sends anything; this is the second line, for
    a kernel that does not (every kind of output counts against it, as in the kernel).
    """

    def __init__(self, out: Collected, budget: int, callbacks: Callbacks) -> None:
        self.out = out
        self.budget = budget
        self.limit = budget + _MARKER_SLACK
        self.used = 0
        self.callbacks = callbacks
        self.truncated = False
        self.clear_pending = False
        self.display_index: dict[str, list[int]] = {}

    def _room(self) -> int:
        return self.limit - self.used

    async def add(self, msg: KernelMessage) -> None:
        kind = msg.msg_type
        content = msg.content
        if kind in OUTPUT_TYPES:
            self.out.received += 1
        if kind == "execute_input":
            self.out.execution_count = content.get("execution_count")
            return
        if kind == "clear_output":
            if content.get("wait"):
                self.clear_pending = True
            else:
                self._clear()
            return
        if kind == "update_display_data":
            self._update_display(content)
            return
        if kind not in ("stream", "display_data", "execute_result", "error"):
            return
        if self.clear_pending:
            self._clear()
        if kind == "stream":
            await self._stream(content.get("name", "stdout"), str(content.get("text", "")))
            return
        output = notebook_output(kind, content)
        if output is None:
            return  # malformed output from the kernel
        if kind == "error":
            size = len(str(content.get("evalue", ""))) + sum(
                len(str(t)) for t in content.get("traceback") or []
            )
            self.used += size
            self.out.error = content
        elif kind == "execute_result":
            self.out.execution_count = content.get("execution_count")
            self.out.result = str(output.get("data", {}).get("text/plain", ""))
        if kind in ("display_data", "execute_result"):
            self._drop_widget(output)
            self._bound_display(output)
            display_id = (content.get("transient") or {}).get("display_id")
            if display_id:
                self.display_index.setdefault(display_id, []).append(len(self.out.outputs))
        self.out.outputs.append(output)
        if kind == "display_data":
            await self.callbacks.emit(self.callbacks.on_display, output)

    async def _stream(self, name: str, text: str) -> None:
        name = "stderr" if name == "stderr" else "stdout"
        if self.truncated:
            return
        room = self._room()
        if len(text) > room:
            text = text[: max(room, 0)] + (
                f"\n[kernelexec: output truncated at {self.budget} characters]\n"
            )
            self.truncated = True
        if not text:
            return
        self.used += len(text)
        if name == "stdout":
            self.out.stdout += text
        else:
            self.out.stderr += text
        outputs = self.out.outputs
        if outputs and outputs[-1].get("output_type") == "stream" and outputs[-1]["name"] == name:
            outputs[-1]["text"] += text
        else:
            outputs.append({"output_type": "stream", "name": name, "text": text})
        hook = self.callbacks.on_stdout if name == "stdout" else self.callbacks.on_stderr
        await self.callbacks.emit(hook, text)

    def _drop_widget(self, output: dict[str, Any]) -> None:
        data = output.get("data") or {}
        if WIDGET_MIME in data:
            # The widget's model lives in the sandbox kernel and nobody holds its comm: the
            # view would render as an error, so keep the text fallback and say so.
            del data[WIDGET_MIME]
            data.setdefault("text/plain", "<ipywidget>")
            self.out.widgets_dropped += 1

    def _bound_display(self, output: dict[str, Any]) -> None:
        data = output.get("data") or {}
        size = sum(len(str(v)) for v in data.values())
        if size > self._room():
            output["data"] = {
                "text/plain": f"[kernelexec: display output of {size} characters dropped]"
            }
            size = 0
        self.used += size

    def _update_display(self, content: dict[str, Any]) -> None:
        display_id = (content.get("transient") or {}).get("display_id")
        for index in self.display_index.get(display_id or "", []):
            output = self.out.outputs[index]
            output["data"] = content.get("data", {})
            output["metadata"] = content.get("metadata", {})
            self._bound_display(output)

    def _clear(self) -> None:
        self.out.outputs.clear()
        self.display_index.clear()
        self.clear_pending = False
