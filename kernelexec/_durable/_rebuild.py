"""Rebuilding names a checkpoint could not hold by replaying the recorded cells that bound them
(a recorded session only): an open file, a generator, a lock come back as the code made them."""

from __future__ import annotations

import ast
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kernelexec._protocol._host import ExecuteRequest

Runner = Callable[[ExecuteRequest, float], Awaitable[dict[str, Any]]]

_NAMES = "kx_names"
_TIMEOUT = 60.0


def bound_names(source: str) -> set[str]:
    """Names a cell binds (assignments, definitions, imports); empty when it does not parse
    as Python (magics)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
    return found


async def replay(sources: Iterable[str], names: list[str], run: Runner) -> list[str]:
    """Run, in order, the cells of ``sources`` that bind any of ``names``; return those of
    ``names`` that exist afterwards."""
    wanted = set(names)
    cells = [src for src in sources if bound_names(src) & wanted]
    if not cells:
        return []
    for src in cells:
        request = ExecuteRequest(code=src, silent=True, store_history=False)
        try:
            await run(request, _TIMEOUT)
        except Exception:
            return []
    ask = ExecuteRequest(
        code="",
        silent=True,
        store_history=False,
        user_expressions={
            _NAMES: "__import__('json').dumps(__import__('__kernelexec__').user_names())"
        },
    )
    try:
        reply = await run(ask, _TIMEOUT)
        text = reply["user_expressions"][_NAMES]["data"]["text/plain"]
        now = set(json.loads(ast.literal_eval(text)))
    except Exception:
        return []
    return sorted(wanted & now)
