"""Every page's examples run in a venv holding only what that page tells a reader to install
(issue 36): an example that needs numpy or JupyterLab fails where its page does not name what
brings it, as it would for a reader, instead of passing on the development venv's plenty.

What a page names: the extras of its ``pip install '.[x,y]'`` lines and its ``kernelexec[x]``
mentions, and the other packages its ``pip install`` lines add. A page whose install lines are a
menu rather than what its examples need (the README's Install section) says so with the line
``<!-- extras: x,y -->`` (empty for the base package alone), which replaces what was found.

One venv per distinct set (``python -m venv``, then ``pip install -e '.[x,y]'``; no development
extras), built once under ``.cache/docs-venvs/<key>``, the key naming the set and a hash of
``pyproject.toml``: ``make test``'s second pass, and the next run on a warm checkout, reuse it.
Examples marked ``<!-- example: skip (why) -->`` skip here as in ``test_docs_examples.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from filelock import FileLock

from tests.test_docs_examples import ROOT, Example, examples

_CACHE = ROOT / ".cache" / "docs-venvs"
_MARKER = re.compile(r"^<!-- extras: ?([a-z0-9,\- ]*) -->$", re.MULTILINE)
_MENTION = re.compile(r"kernelexec\[([a-z0-9,\-]+)\]")
_PIP = re.compile(r"pip install (.+?)(?:#|`|$)", re.MULTILINE)
_CHECKOUT = re.compile(r"^'?\.(?:\[([a-z0-9,\-]+)\])?'?$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


def _project_digest() -> str:
    """A hash of ``pyproject.toml``'s ``[project]`` table (dependencies, extras, entry points):
    a change to the tools' settings there needs no new venvs (the package is installed
    editable)."""
    text = (ROOT / "pyproject.toml").read_bytes()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the whole file
        return hashlib.sha256(text).hexdigest()[:12]
    project = json.dumps(tomllib.loads(text.decode())["project"], sort_keys=True)
    return hashlib.sha256(project.encode()).hexdigest()[:12]


_PROJECT = _project_digest()


class Needs(NamedTuple):
    """What a page tells a reader to install: kernelexec's extras and other packages."""

    extras: tuple[str, ...]
    packages: tuple[str, ...]

    @property
    def named(self) -> str:
        """The set, as a folder name's first part."""
        return "-".join([*self.extras, *self.packages]) or "base"

    @property
    def key(self) -> str:
        """The cache folder's name: the set, and the package metadata it was built from."""
        return f"{self.named}-{_PROJECT}"


def needs(page: Path) -> Needs:
    """The extras and packages ``page`` names (its ``<!-- extras: -->`` line where it has one)."""
    text = page.read_text()
    marker = _MARKER.search(text)
    if marker:
        named = {x.strip() for x in marker.group(1).split(",")} - {""}
        return Needs(tuple(sorted(named)), ())
    extras = {x for m in _MENTION.finditer(text) for x in m.group(1).split(",")}
    packages = set()
    for line in _PIP.finditer(text):
        for token in line.group(1).split():
            checkout = _CHECKOUT.match(token)
            if checkout:
                extras.update(checkout.group(1).split(",") if checkout.group(1) else ())
            elif _PACKAGE.match(token) and token != "kernelexec":
                packages.add(token)
    extras.discard("name")  # "an extra named `kernelexec[name]`": the placeholder
    return Needs(tuple(sorted(extras)), tuple(sorted(packages)))


def venv(what: Needs) -> Path:
    """The python of a venv holding the package with ``what`` (built once, then reused)."""
    home = _CACHE / what.key
    python = home / "bin" / "python"
    done = home / ".complete"
    _CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):  # xdist's workers may want the same venv at once
        if done.exists():
            return python
        shutil.rmtree(home, ignore_errors=True)  # a build cut short
        for old in _CACHE.iterdir():  # the same set built for an earlier [project]
            name = old.name.removesuffix(".lock")
            if name != home.name and name.rsplit("-", 1)[0] == what.named:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, timeout=120)
        spec = f".[{','.join(what.extras)}]" if what.extras else "."
        proc = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-e", spec,
             *what.packages],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, f"pip install {spec} {what.packages}:\n{proc.stderr}"
        done.touch()
    return python


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


EXAMPLES = [(e, needs(e.path)) for page in _pages() for e in examples(page)]


def test_what_a_page_names() -> None:
    assert needs(ROOT / "docs" / "observability.md") == Needs(("otel",), ("opentelemetry-sdk",))
    assert needs(ROOT / "docs" / "attach.md") == Needs(("attach",), ())
    assert needs(ROOT / "README.md") == Needs((), ())  # its Install section is a menu
    frameworks = needs(ROOT / "docs" / "frameworks.md").extras
    assert {"smolagents", "pydantic-ai", "deepagents", "openai-agents"} <= set(frameworks)
    assert "numpy" not in needs(ROOT / "docs" / "frameworks.md").packages


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("example", "what"),
    EXAMPLES,
    ids=[f"{e.path.relative_to(ROOT)}:{e.line}" for e, _ in EXAMPLES],
)
def test_example_runs_with_only_what_its_page_names(
    example: Example, what: Needs, tmp_path: Path
) -> None:
    if example.skip:
        pytest.skip(example.skip)
    python = venv(what)
    script = tmp_path / "example.py"
    script.write_text(example.code)
    proc = subprocess.run(
        [str(python), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    where = f"{example.path.relative_to(ROOT)}, line {example.line}, in a venv with {what}"
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, f"{where}:\n{proc.stderr}"
