"""JSON as kernelexec carries it: values checked before they travel, and big integers exact.

Python refuses to convert integers of more than 4,300 digits to or from decimal text
(``sys.get_int_max_str_digits()``, a guard against quadratic-time parsing). Kernels run with that
limit lifted (the kernel side lifts it at install), so a tool gets and returns integers of any
size; this host process keeps its limit and converts big integers itself, by splitting them
into pieces below the limit. Nesting is bounded (:data:`MAX_DEPTH`) before anything is sent, so
no part of kernelexec recurses without bound on a caller's value.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

MAX_DEPTH = 100
"""The deepest nesting of lists and objects accepted in tool arguments and return values."""

_SAFE_BITS = 10_000  # ~3,010 decimal digits: below the interpreter's default limit of 4,300
_SAFE_DIGITS = 3_000


def problem(value: Any, name: str) -> str | None:
    """Why ``value`` (the argument ``name``) is not JSON kernelexec can send, or None.

    JSON here is: ``dict`` with ``str`` keys, ``list``/``tuple``, ``str``, ``int``, ``float``,
    ``bool`` and ``None``, nested at most :data:`MAX_DEPTH` deep. Checked without recursion.
    """
    stack: list[tuple[Any, str, int]] = [(value, name, 1)]
    while stack:
        item, where, depth = stack.pop()
        if item is None or isinstance(item, str | int | float):
            continue
        if not isinstance(item, dict | list | tuple):
            return f"argument {where!r}: a {type(item).__name__} is not a JSON value"
        if depth > MAX_DEPTH:
            return (
                f"argument {name!r} is nested deeper than {MAX_DEPTH} levels "
                f"(the limit on JSON nesting)"
            )
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"argument {where!r}: object key {key!r} is not a string"
                stack.append((child, f"{where}.{key}", depth + 1))
        else:
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))
    return None


def int_text(number: int) -> str:
    """The decimal text of any integer, whatever the interpreter's digit limit."""
    if number < 0:
        return "-" + int_text(-number)
    if number.bit_length() <= _SAFE_BITS:
        return str(number)
    half = int(number.bit_length() * 0.30103) // 2  # about half of its decimal digits
    scale: int = 10**half
    high, low = divmod(number, scale)
    return int_text(high) + int_text(low).rjust(half, "0")


def parse_int(text: str) -> int:
    """The integer of any decimal text, whatever the interpreter's digit limit."""
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    if len(digits) <= _SAFE_DIGITS:
        return sign * int(digits)
    half = len(digits) // 2
    scale: int = 10**half
    return sign * (parse_int(digits[:-half]) * scale + parse_int(digits[-half:]))


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps``, with integers of any size written exactly."""
    try:
        return json.dumps(value, **options)
    except ValueError:
        pass  # an integer over the digit limit: place-hold the big ones, then put them back
    token = uuid.uuid4().hex
    found: list[int] = []

    def hold(item: Any) -> Any:
        if isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > _SAFE_BITS:
                found.append(item)
                return f"kx-int-{token}-{len(found) - 1}"
            return item
        if isinstance(item, dict):
            return {k: hold(v) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [hold(v) for v in item]
        return item

    text = json.dumps(hold(value), **options)
    for index, number in enumerate(found):
        text = text.replace(f'"kx-int-{token}-{index}"', int_text(number), 1)
    return text


def loads(text: str | bytes) -> Any:
    """``json.loads``, reading integers of any size exactly."""
    try:
        return json.loads(text)
    except ValueError as exc:
        if "digits" not in str(exc):
            raise
    return json.loads(text, parse_int=parse_int)
