"""Findings 1 and 2 of the hostile probe: every output arrives or is counted as lost, and every
kind of output shares the per-run budget, enforced in the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kernelexec as kx

# 1. output dropped by the transport is accounted for ----------------------------------------

BURST = """
from IPython.display import display
for i in range(10_000):
    print(f"line {i}")
    display(i)
open("burst-done", "w").close()
"""


@pytest.mark.slow
def test_slow_consumer_burst_delivers_or_counts_every_output() -> None:
    """20,000 prints and displays while the host's on_stdout stalls until the kernel has sent
    them all: every output arrives, or the result says how many did not."""
    with kx.KernelExecutor(default_timeout=90) as ex:
        session = ex.session("burst")
        workdir = Path(str(session.workdir))
        stalled: list[bool] = []

        def stall(text: str) -> None:
            if stalled:
                return
            stalled.append(True)
            deadline = time.monotonic() + 60  # the stall ends when the kernel has sent it all
            while not (workdir / "burst-done").exists() and time.monotonic() < deadline:
                time.sleep(0.01)

        result = session.run_code(BURST, on_stdout=stall)
    assert result.ok, result.error
    lines = sum(1 for line in result.stdout.splitlines() if line.startswith("line "))
    displays = sum(1 for o in result.outputs if o.get("output_type") == "display_data")
    missing = (10_000 - lines) + (10_000 - displays)
    if missing == 0:
        assert result.lost_outputs == 0
        return
    assert result.lost_outputs > 0, f"{missing} outputs missing and none reported lost"
    assert result.lost_outputs >= 10_000 - displays  # one message per display
    assert f"[kernelexec: {result.lost_outputs} output message" in result.stdout
    assert "lost" in result.stdout


def test_a_run_without_loss_reports_none(executor: kx.KernelExecutor) -> None:
    result = executor.run_code(
        "from IPython.display import display\nfor i in range(50):\n    print(i); display(i)",
        agent_id="no-loss",
    )
    assert result.ok and result.lost_outputs == 0
    assert "lost" not in result.stdout


# 2. the budget is enforced in the kernel, for every kind of output --------------------------


def _peak_rss_script(max_output_chars: int) -> str:
    return textwrap.dedent(
        f"""
        import json, resource
        import kernelexec as kx
        with kx.KernelExecutor(max_output_chars={max_output_chars}, default_timeout=60) as ex:
            ex.run_code("print('warm')")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            result = ex.run_code("print('x' * 200_000_000)")
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"before_kb": before, "after_kb": after, "stdout": len(result.stdout),
                          "ok": result.ok}}))
        """
    )


@pytest.mark.slow
def test_a_200_mb_print_does_not_cross_to_the_host() -> None:
    """The host's peak RSS (``ru_maxrss`` of a fresh process) rises by less than 60 MB."""
    proc = subprocess.run(
        [sys.executable, "-c", _peak_rss_script(100_000)],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["ok"]
    assert data["stdout"] < 101_000
    rise_mb = (data["after_kb"] - data["before_kb"]) / 1024
    assert rise_mb < 60, f"host peak RSS rose by {rise_mb:.0f} MB"


def test_the_cap_holds_after_ipython_swaps_the_stream_writer() -> None:
    """IPython 9 wraps ``sys.stdout.write`` around every cell (``_tee``): the cap holds anyway,
    from the first run on, and the kernel keeps no output history."""
    with kx.KernelExecutor(max_output_chars=1_000) as ex:
        first = ex.run_code("print('x' * 50_000)")
        assert 1_000 <= len(first.stdout) < 1_200 and "truncated at 1000" in first.stdout
        # What the kernel itself sent (the host's cap is a second line only).
        probe = ex.run_code(
            "import sys\n"
            "hm = get_ipython().history_manager\n"
            "print('y' * 5_000)\n"
            "kept = sum(len(v) for v in hm.outputs.values())\n"
        )
        assert "truncated" in probe.stdout
        assert ex.run_code("kept").result == "0"
        assert ex.run_code("raise ValueError('kept?')").error is not None
        assert ex.run_code("len(hm.exceptions)").result == "0"


def test_displays_and_errors_share_the_budget() -> None:
    with kx.KernelExecutor(max_output_chars=100_000) as ex:
        shown = ex.run_code(
            "from IPython.display import display\n"
            "for i in range(200):\n"
            "    display({'text/plain': str(i) + 'z' * 50_000}, raw=True)\n"
        )
        assert shown.ok, shown.error
        total = sum(len(json.dumps(o)) for o in shown.outputs)
        assert total < 110_000, f"{total} characters of outputs"
        assert "output budget" in shown.stdout

        failed = ex.run_code("raise ValueError('e' * 20_000_000)")
        assert failed.error is not None and failed.error.ename == "ValueError"
        size = len(failed.error.evalue) + sum(len(t) for t in failed.error.traceback)
        assert size < 110_000
        assert sum(len(json.dumps(o)) for o in failed.outputs) < 110_000
