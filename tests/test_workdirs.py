"""The one copy rule for a session's working directory (``kernelexec._workdirs``): what each job
carries, on a real tree."""

from __future__ import annotations

import os
from pathlib import Path

from kernelexec import _workdirs
from kernelexec._durable import _files
from kernelexec._durable._kernel_state import STAGING


def _tree(top: Path) -> None:
    (top / "sub").mkdir()
    (top / "sub" / "data.txt").write_text("data")
    (top / "link").symlink_to("sub/data.txt")
    os.mkfifo(top / "fifo")
    (top / _workdirs.LAYERS).mkdir()
    (top / _workdirs.LAYERS / "upper.txt").write_text("layer")
    (top / _workdirs.STATE).mkdir()
    (top / _workdirs.STATE / "state.bin").write_text("state")


def _names(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*")}


def test_the_state_folder_is_the_kernel_halfs() -> None:
    assert _workdirs.STATE == STAGING


def test_each_job_carries_what_the_rule_says(tmp_path: Path) -> None:
    source, snap, capped = tmp_path / "w", tmp_path / "snap", tmp_path / "capped"
    for path in (source, snap, capped):
        path.mkdir()
    _tree(source)

    skipped = _workdirs.copy(source, snap, _workdirs.SNAPSHOT)
    assert _names(snap) == {"sub", "sub/data.txt", "link", _workdirs.STATE,
                            f"{_workdirs.STATE}/state.bin"}  # fmt: skip
    assert os.readlink(snap / "link") == "sub/data.txt"
    assert set(skipped) == {"fifo"}

    _workdirs.copy(source, capped, _workdirs.CAPPED)
    assert _names(capped) == _names(source) - {"fifo"}

    walked = {entry[0] for entry in _files.signature(source)}  # what the archive looks at
    assert walked == _names(source) - {_workdirs.STATE, f"{_workdirs.STATE}/state.bin"}

    (snap / "sub" / "data.txt").write_text("changed")
    (source / _workdirs.LAYERS / "upper.txt").write_text("kept")
    _workdirs.replace(snap, source)
    assert (source / "sub" / "data.txt").read_text() == "changed"
    assert (source / _workdirs.LAYERS / "upper.txt").read_text() == "kept"
    assert not (source / "fifo").exists()
