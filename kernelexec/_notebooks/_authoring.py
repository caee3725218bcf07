"""Tools authored in notebooks: cells tagged ``tool`` become :class:`~kernelexec.Tool` values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kernelexec._exceptions import NotebookError, ToolDefinitionError
from kernelexec._notebooks._recording import KEY, read_notebook
from kernelexec._tools._tool import Tool

TOOL_TAG = "tool"
_REQUIREMENTS = re.compile(r"^\s*#\s*requirements:\s*(.*)$", re.IGNORECASE)
_SPLIT = re.compile(r",\s*(?![^\[]*\])")  # commas, except inside extras like pkg[a,b]


def strip_cell_magic(source: str) -> str:
    """The cell source without a leading ``%%tool`` line (the authoring magic)."""
    first, _, rest = source.partition("\n")
    return rest if first.strip().split(" ")[0] == "%%tool" else source


def requirements_of(source: str, metadata: dict[str, Any]) -> list[str]:
    """A cell's requirements: ``metadata.kernelexec.pip_requirements`` and ``# requirements:``.

    A comment line lists requirements separated by commas (``# requirements: httpx>=0.27,
    rich``); the metadata holds a list of requirement lines.
    """
    found: list[str] = []
    listed = (metadata.get(KEY) or {}).get("pip_requirements") or []
    if not isinstance(listed, list) or not all(isinstance(r, str) for r in listed):
        raise ToolDefinitionError("metadata kernelexec.pip_requirements must be a list of str")
    found.extend(listed)
    for line in source.splitlines():
        match = _REQUIREMENTS.match(line)
        if match:
            found.extend(r.strip() for r in _SPLIT.split(match.group(1)) if r.strip())
    return list(dict.fromkeys(found))


def tool_from_cell(source: str, metadata: dict[str, Any]) -> Tool:
    """The tool a ``%%tool`` cell (or a cell tagged ``tool``) defines."""
    source = strip_cell_magic(source)
    return Tool.from_source(source, pip_requirements=requirements_of(source, metadata))


def tools_from_notebook(path: str | Path) -> list[Tool]:
    """Every tool defined in the notebook's code cells tagged ``tool``, in order.

    Raises:
        NotebookError: the notebook cannot be read, a tagged cell does not define exactly one
            public function, or two cells define tools of the same name (the message names
            the cell by index).
    """
    nb = read_notebook(path)
    tools: dict[str, Tool] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or TOOL_TAG not in (cell.metadata.get("tags") or []):
            continue
        try:
            tool = tool_from_cell(cell.source, dict(cell.metadata))
        except ToolDefinitionError as exc:
            raise NotebookError(f"{path}, cell {index}: {exc}") from None
        if tool.name in tools:
            raise NotebookError(f"{path}, cell {index}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return list(tools.values())
