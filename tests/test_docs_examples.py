"""The Python examples of README.md and docs/, each a script of its own (issue 30): they run in
venvs holding only what their page names (``test_docs_extras.py``, issue 36).

A fenced ``python`` block is one example. A block that cannot run here (it needs a remote
gateway, the package index, a Letta server) is marked by the line
``<!-- example: skip (why) -->`` right before its fence; the reason is shown when the test skips.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```python\s*$")
_SKIP = re.compile(r"^<!-- example: skip \((.+)\) -->$")


class Example(NamedTuple):
    path: Path
    line: int
    code: str
    skip: str | None


def examples(path: Path) -> list[Example]:
    """The fenced Python blocks of a Markdown file, with the skip reason given before each."""
    lines = path.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            marker = _SKIP.match(lines[start - 1].strip()) if start else None
            found.append(
                Example(
                    path, start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None
                )
            )
        i += 1
    return found


def _all() -> list[Example]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [e for page in pages for e in examples(page)]


EXAMPLES = _all()


def test_the_collector_finds_the_examples() -> None:
    assert any(e.path.name == "README.md" for e in EXAMPLES)
    assert sum(e.skip is None for e in EXAMPLES) >= 5
    sample = examples(ROOT / "docs" / "gateway.md")
    assert sample and sample[0].skip and "gateway" in sample[0].skip.lower()
