"""Host functions that answer as a recording says: for replaying a cell that called the host.

A recorded cell keeps each host call among its outputs (see ``_calls.record_output``). For a
replay, :func:`recorded_stubs` turns them into functions to expose for that cell only: each
answers its calls in the recorded order with the recorded result, or fails as the call failed.
Their signatures are rebuilt from the recorded arguments (names in the order the calls bound
them), since the original functions are not in the notebook.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable
from typing import Any

from kernelexec._codemode._calls import HOST_CALL_MIME


class RecordedCallMissing(Exception):
    """The replayed code made a call the recording does not have."""


def recorded_calls(outputs: list[Any]) -> list[dict[str, Any]]:
    """The host calls recorded among a cell's outputs, in order."""
    calls = []
    for out in outputs:
        data = out.get("data") if isinstance(out, dict) else None
        record = (data or {}).get(HOST_CALL_MIME)
        if isinstance(record, dict) and isinstance(record.get("name"), str):
            calls.append(record)
    return calls


def recorded_stubs(
    outputs: list[Any], every_call: list[dict[str, Any]]
) -> dict[str, list[Callable[..., Any]]]:
    """Module name -> stub functions answering the host calls recorded in ``outputs`` (one
    cell's); ``every_call`` (the whole notebook's) says which functions exist and their
    parameters, so a cell that imports a function it does not call still can."""
    answers: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in recorded_calls(outputs):
        if record.get("outcome") in ("refused", "invalid_args"):
            continue  # never reached a function: the replay's own checks answer again
        answers.setdefault(_key(record), []).append(record)
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in every_call:
        seen.setdefault(_key(record), []).append(record)
    modules: dict[str, list[Callable[..., Any]]] = {}
    for (module, name), records in seen.items():
        stub = _stub(name, records, answers.get((module, name), []))
        modules.setdefault(module, []).append(stub)
    return modules


def _key(record: dict[str, Any]) -> tuple[str, str]:
    return str(record.get("module", "tools")), str(record["name"])


def _stub(
    name: str, records: list[dict[str, Any]], cell_records: list[dict[str, Any]]
) -> Callable[..., Any]:
    answers = deque(cell_records)
    names: list[str] = []
    for record in records:
        arguments = record.get("arguments")
        for key in arguments if isinstance(arguments, dict) else ():
            if key not in names and key.isidentifier():
                names.append(key)

    def stub(**kwargs: Any) -> Any:
        if not answers:
            raise RecordedCallMissing(f"the recording has no further call of {name}()")
        record = answers.popleft()
        if record.get("outcome") == "ok":
            return record.get("result")
        kind, _, message = str(record.get("error") or "").partition(": ")
        if record.get("outcome") == "timeout":
            raise TimeoutError(message or kind)
        raise type(kind if kind.isidentifier() else "RecordedError", (Exception,), {})(message)

    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = f"{name}(), answering as recorded."
    params = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for n in names
    ]
    stub.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return stub
