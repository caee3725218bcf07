"""Every Python example in README.md and docs/ runs, each as a script of its own (issue 30).

A fenced ``python`` block is one example. A block that cannot run here (it needs a remote
gateway, the package index, a Letta server) is marked by the line
``<!-- example: skip (why) -->`` right before its fence; the reason is shown when the test skips.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

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


@pytest.mark.slow
@pytest.mark.parametrize(
    "example", EXAMPLES, ids=[f"{e.path.relative_to(ROOT)}:{e.line}" for e in EXAMPLES]
)
def test_example_runs(example: Example, tmp_path: Path) -> None:
    if example.skip:
        pytest.skip(example.skip)
    script = tmp_path / "example.py"
    script.write_text(example.code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    where = f"{example.path.relative_to(ROOT)}, line {example.line}"
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, f"{where}:\n{proc.stderr}"
