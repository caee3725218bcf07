"""Tools authored in notebooks: finding the cells tagged ``tool`` and their requirements."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelexec._exceptions import NotebookError, ToolDefinitionError
from kernelexec._notebooks._io import KEY, read_notebook

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


@dataclass(frozen=True)
class ToolCell:
    """A code cell tagged ``tool``: its index, its source without the ``%%tool`` line, and
    its requirements."""

    index: int
    source: str
    requirements: list[str]


def tool_cells(path: str | Path) -> list[ToolCell]:
    """The notebook's code cells tagged ``tool``, in order (``Tool.from_notebook`` makes the
    tools; this module does not depend on them).

    Raises:
        NotebookError: the notebook cannot be read, or a cell's requirements metadata is bad.
    """
    nb = read_notebook(path)
    cells = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or TOOL_TAG not in (cell.metadata.get("tags") or []):
            continue
        source = strip_cell_magic(cell.source)
        try:
            requirements = requirements_of(source, dict(cell.metadata))
        except ToolDefinitionError as exc:
            raise NotebookError(f"{path}, cell {index}: {exc}") from None
        cells.append(ToolCell(index, source, requirements))
    return cells
