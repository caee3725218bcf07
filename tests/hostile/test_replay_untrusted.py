"""Hostile: ``kernelexec replay`` of a notebook someone else recorded.

Seen before the fix: the CLI ran the interpreter path named in the notebook's metadata and built
the requirements it named, as root with the host's environment, saying only "replaying ... in a
fresh kernel". Now metadata names no host program, and building needs ``--build-requirements``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

from tests.hostile.conftest import needs_root
from tests.hostile.test_builds import make_package


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelexec", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _notebook(path: Path, python: str, requirements: list[str], source: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelexec"] = {
        "env": {"kind": "venv", "requirements": requirements, "python": python}
    }
    nb.cells.append(nbformat.v4.new_code_cell(source))
    nbformat.write(nb, str(path))
    return path


@pytest.mark.slow
def test_replay_runs_no_program_the_notebook_names_and_builds_only_when_asked(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "interpreter-ran"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ntouch {marker}\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    name = f"kxreplay{uuid.uuid4().hex[:8]}"
    pkg = make_package(tmp_path / "src", name, 9, "no-secret")
    nb = _notebook(
        tmp_path / "untrusted.ipynb",
        str(fake),
        [str(pkg)],
        f"import {name}, os\nprint({name}.SEEN)",
    )
    refused = _cli("replay", str(nb))
    assert refused.returncode != 0
    assert "--build-requirements" in refused.stderr
    assert not marker.exists()
    assert "--build-requirements" in _cli("replay", "--help").stdout

    built = _cli("replay", "--json", "--build-requirements", str(nb))
    assert not marker.exists()
    report = json.loads(built.stdout)
    assert report["cells_run"] == 1
    # Said in one line, not silently (issue 36): the recorded interpreter was not used.
    (note,) = report["notes"]
    assert f"python {str(fake)!r} not used" in note
    assert f"kernelexec: {note}\n" in built.stderr
    out = "+[stdout] "
    diff = report["differences"][0]["diff"].splitlines()
    seen = json.loads(next(line[len(out) :] for line in diff if line.startswith(out + "{")))
    if os.geteuid() == 0:
        assert seen["uid"] >= 2_000_000_000  # built as a user of its own, not as root


@needs_root
def test_replay_kernels_get_the_default_isolation(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import os\nprint(os.getuid())"))
    path = tmp_path / "plain.ipynb"
    nbformat.write(nb, str(path))
    done = _cli("replay", "--json", str(path))
    report = json.loads(done.stdout)
    uid = int(report["differences"][0]["diff"].splitlines()[-1].split()[-1])
    assert uid >= 2_000_000_000
    assert "isolation" in done.stderr
