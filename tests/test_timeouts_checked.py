"""Finding 4 of the hostile probe: a timeout is a finite positive number of seconds or None,
checked wherever it enters (API, configuration, command line, recorded notebooks)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest

import kernelexec as kx

BAD = [math.nan, math.inf, -1.0, 0, True, "5", None]


@pytest.mark.parametrize("value", [v for v in BAD if v is not None])
def test_a_bad_call_timeout_is_refused_before_running(
    executor: kx.KernelExecutor, value: Any
) -> None:
    with pytest.raises(kx.ConfigError, match="timeout"):
        executor.run_code("ran = True", agent_id="timeouts", timeout=value)


@pytest.mark.parametrize("field", ["default_timeout", "interrupt_grace", "start_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, True, "5"])
def test_a_bad_configured_timeout_is_refused(field: str, value: Any) -> None:
    with pytest.raises(kx.ConfigError, match=field):
        kx.KernelExecutor(**{field: value})


def test_cli_refuses_a_bad_timeout_as_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kernelexec", "exec", "--timeout", "nan", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "timeout" in proc.stderr


def _notebook(path: Path, code: str, timeout_s: Any) -> Path:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(code)
    cell.metadata["kernelexec"] = {"kind": "code", "status": "success", "timeout_s": timeout_s}
    nb.cells.append(cell)
    nb.metadata["kernelexec"] = {"agent_id": "t", "env": {"kind": "local"}}
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("recorded", ["ten", -3, 0, True, "nan"])
def test_a_bad_recorded_timeout_is_a_usage_error(tmp_path: Path, recorded: Any) -> None:
    path = _notebook(tmp_path / "bad.ipynb", "1", recorded)
    with pytest.raises(kx.NotebookError, match="timeout_s"):
        kx.replay(path)
    proc = subprocess.run(
        [sys.executable, "-m", "kernelexec", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "timeout_s" in proc.stderr


def test_replay_timeout_caps_the_recorded_ones(tmp_path: Path) -> None:
    path = _notebook(tmp_path / "long.ipynb", "import time\ntime.sleep(60)", 1e9)
    proc = subprocess.run(
        [sys.executable, "-m", "kernelexec", "replay", str(path), "--timeout", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout, proc.stderr
    report = json.loads(proc.stdout)
    assert [d["replayed_status"] for d in report["differences"]] == ["error"]
