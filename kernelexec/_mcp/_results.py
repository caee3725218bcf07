"""Turning kernelexec results into MCP tool results: text, images and structured content."""

from __future__ import annotations

import json
from typing import Any, Literal

import mcp_types as types
from pydantic import BaseModel, Field

from kernelexec._models import Execution, ToolResult
from kernelexec._plaintext import strip_ansi

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


class ErrorInfo(BaseModel):
    """The error of a run as an MCP client sees it."""

    kind: str
    name: str
    message: str
    traceback: str


class RunPythonResult(BaseModel):
    """The structured content of a ``run_python`` result (its ``outputSchema``)."""

    session: str
    status: Literal["success", "error"]
    stdout: str
    stderr: str
    result: str | None
    error: ErrorInfo | None
    images: list[str]
    execution_count: int | None
    duration_s: float | None
    kernel_restarted: bool
    lost_variables: list[str]
    cancelled: bool = False
    changes: dict[str, list[str]] = Field(default_factory=dict)
    rolled_back: bool = False


def error_info(execution: Execution) -> ErrorInfo | None:
    """The run's error with its traceback as plain text, or None."""
    err = execution.error
    if err is None:
        return None
    lines = [strip_ansi(line) for line in err.traceback]
    return ErrorInfo(
        kind=err.kind, name=err.ename, message=strip_ansi(err.evalue), traceback="\n".join(lines)
    )


def _images(execution: Execution) -> list[types.ImageContent]:
    images = []
    for output in execution.outputs:
        if output.get("output_type") not in ("display_data", "execute_result"):
            continue
        data = output.get("data") or {}
        for mime in IMAGE_TYPES:
            value = data.get(mime)
            if isinstance(value, str):
                # Jupyter already sends binary MIME types as base64 text.
                compact = "".join(value.split())
                images.append(types.ImageContent(type="image", data=compact, mime_type=mime))
                break
    return images


def _displayed_text(execution: Execution) -> list[str]:
    """text/plain of displays that carry no image (the execute_result is ``result``)."""
    texts = []
    for output in execution.outputs:
        if output.get("output_type") != "display_data":
            continue
        data = output.get("data") or {}
        if any(m in data for m in IMAGE_TYPES):
            continue
        text = data.get("text/plain")
        if isinstance(text, str):
            texts.append(text)
    return texts


def _text_block(
    execution: Execution, result: str | None, error: ErrorInfo | None, note: str | None
) -> str:
    parts: list[str] = []
    if execution.stdout:
        parts.append(f"[stdout]\n{strip_ansi(execution.stdout).rstrip()}")
    if execution.stderr:
        parts.append(f"[stderr]\n{strip_ansi(execution.stderr).rstrip()}")
    for text in _displayed_text(execution):
        parts.append(f"[display]\n{strip_ansi(text)}")
    if result is not None:
        parts.append(f"[result]\n{strip_ansi(result)}")
    if error is not None:
        head = f"[error: {error.kind}] {error.name}: {strip_ansi(error.message)}"
        parts.append(f"{head}\n{error.traceback}" if error.traceback else head)
    if execution.rolled_back:
        parts.append("[note] rolled back: the session's variables and files are as before")
    elif execution.kernel_restarted:
        lost = ", ".join(execution.lost_variables) or "nothing"
        parts.append(f"[note] the kernel was restarted; lost: {lost}")
    if execution.changes:
        parts.append(f"[changes] {execution.changes.describe()}")
    if note:
        parts.append(f"[note] {note}")
    return "\n\n".join(parts) if parts else "(no output)"


def run_python_result(
    execution: Execution, session: str, *, cancelled: bool = False
) -> types.CallToolResult:
    """``run_python``'s answer: text, one image per rich image output, structured content."""
    images = _images(execution)
    error = error_info(execution)
    note = "cancelled by the client: the kernel was interrupted" if cancelled else None
    text = _text_block(execution, execution.result, error, note)
    structured = RunPythonResult(
        session=session,
        status=execution.status,
        stdout=strip_ansi(execution.stdout),
        stderr=strip_ansi(execution.stderr),
        result=None if execution.result is None else strip_ansi(execution.result),
        error=error,
        images=[image.mime_type for image in images],
        execution_count=execution.execution_count,
        duration_s=execution.duration_s,
        kernel_restarted=execution.kernel_restarted,
        lost_variables=execution.lost_variables,
        cancelled=cancelled,
        changes=execution.changes.model_dump(),
        rolled_back=execution.rolled_back,
    )
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=text)]
    content.extend(images)
    return types.CallToolResult(
        content=content,
        structured_content=structured.model_dump(mode="json"),
        is_error=not execution.ok,
    )


def tool_call_result(result: ToolResult, session: str) -> types.CallToolResult:
    """A ``--tools`` tool's answer: its return value as JSON text (or the error, with
    ``isError``), its images, and the same as structured content."""
    error = error_info(result)
    shown = None if result.func_return is None else _json_text(result.func_return)
    text = _text_block(result, shown, error, None)
    structured: dict[str, Any] = {
        "session": session,
        "status": result.status,
        "return": result.func_return,
        "stdout": strip_ansi(result.stdout),
        "stderr": strip_ansi(result.stderr),
        "error": error.model_dump() if error else None,
    }
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=text)]
    content.extend(_images(result))
    return types.CallToolResult(
        content=content, structured_content=structured, is_error=not result.ok
    )


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2)


def error_result(message: str, kind: str = "invalid_args") -> types.CallToolResult:
    """A tool error (``isError``) with ``message``, for a call refused before it ran:
    ``invalid_args`` (the request was wrong) or ``unavailable`` (no kernel could take it:
    it failed to start, the pool is exhausted, the server is closing)."""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)],
        structured_content={"status": "error", "error": {"kind": kind, "message": message}},
        is_error=True,
    )
