"""The example notebooks in ``notebooks/`` run with nbclient, so they cannot rot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str) -> Any:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    return nb


def text_of(cell: Any) -> str:
    parts = []
    for out in cell.outputs:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
    return "".join(parts)


def test_authoring_notebook() -> None:
    nb = execute("authoring_a_tool.ipynb")
    cells = [c for c in nb.cells if c.cell_type == "code"]
    schema_out = text_of(cells[1])
    assert '"name": "word_stats"' in schema_out
    assert '"description": "How many of the most common words to return."' in schema_out
    assert text_of(cells[2]) == "5 words\n{'words': 5, 'top': [('the', 2), ('cat', 1)]}"
    assert text_of(cells[3]) == "5 words\n{'words': 5, 'top': [['the', 2], ['cat', 1]]}"
    assert text_of(cells[4]) == (
        "error invalid_args - argument 'text': 5 is not of type 'string'\n"
    )
    assert text_of(cells[5]) == "['word_stats']"


def test_debugging_notebook() -> None:
    nb = execute("debugging_a_recorded_session.ipynb")
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert text_of(cells[1]).splitlines() == [
        "[1, 2, 3] -> success 2.0",
        "[] -> error ZeroDivisionError",
        "[10] -> success 10.0",
        "'analyst.ipynb'",
    ]
    listing = text_of(cells[2]).splitlines()
    assert listing[0] == "0 tool_definition   "
    assert listing[2] == "2 tool_call error exception average(values=[])"
    assert text_of(cells[3]) == "{'values': []} ZeroDivisionError\n"
    replay_out = text_of(cells[4])
    assert replay_out.startswith("cell 2 (average(values=[])): error -> success")
    assert "-[error] ZeroDivisionError: division by zero" in replay_out
    assert "+[text/plain] 0.0" in replay_out


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_debugging_a_tool_notebook() -> None:
    nb = execute("debugging_a_tool.ipynb")
    cells = [c for c in nb.cells if c.cell_type == "code"]
    shown = cells[0].outputs[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in shown  # the debugger was displayed
    assert text_of(cells[1]) == "success {'words': 5, 'top': [['the', 2], ['cat', 1]]}\n"
    assert text_of(cells[2]) == (
        "error invalid_args - env vars: must be a JSON object of strings\n"
    )
    assert text_of(cells[3]).splitlines() == [
        "[({'text': 'the cat and the hat', 'top': 2}, 'success')]",
        "['word_stats']",
    ]
    assert text_of(cells[4]) == "2 cells replayed, 0 differing\n"
