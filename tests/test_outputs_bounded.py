"""Findings 1 and 2 of the hostile probe (and issue 21, item 2): every output arrives (a slow
consumer slows the tool), and every kind of output shares the per-run budget, enforced in the
kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import kernelexec as kx

# 1. a slow consumer slows the tool; nothing is lost ------------------------------------------

# The tool prints and displays 10,000 times each. A thread in the kernel notes when the kernel
# side first had to wait for the host (its iopub socket found the host's queue full): the host's
# stalled callback ends then, or when the tool is done (a kernel without flow control never
# waits; it then sends everything while the host stalls, and the transport drops most of it).
BURST = """
import sys, threading, time
from pathlib import Path
from IPython.display import display
done = threading.Event()
def watch():
    gate = sys.modules["__kernelexec__"]._state.get("gate")
    while not done.is_set():
        if gate is not None and gate.holds:
            Path("held").touch()
            return
        time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
for i in range(10_000):
    print(f"line {i}")
    display(i)
done.set()
Path("burst-done").touch()
"""

_BURST_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    from pathlib import Path
    import kernelexec as kx

    with kx.KernelExecutor(default_timeout=90) as ex:
        session = ex.session("burst")
        workdir = Path(str(session.workdir))
        session.run_code("1")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stalled = []

        def stall(text):
            if stalled:
                return
            stalled.append(True)
            deadline = time.monotonic() + 60  # a safety net only: the files end the stall
            while time.monotonic() < deadline:
                if (workdir / "held").exists() or (workdir / "burst-done").exists():
                    break
                time.sleep(0.01)

        result = session.run_code(sys.argv[1], on_stdout=stall)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        held = (workdir / "held").exists()
    print(json.dumps({
        "ok": result.ok, "error": str(result.error), "lost_outputs": result.lost_outputs,
        "lines": sum(1 for l in result.stdout.splitlines() if l.startswith("line ")),
        "displays": sum(1 for o in result.outputs if o["output_type"] == "display_data"),
        "held": held, "rise_kb": after - before,
    }))
    """
)


@pytest.mark.slow
def test_a_stalled_consumer_slows_the_tool_and_loses_nothing() -> None:
    """20,000 prints and displays while the host's on_stdout stalls: the kernel waits for the
    host instead of dropping, every output arrives, and the host's peak RSS (``ru_maxrss`` of a
    fresh process) grows by less than 60 MB."""
    proc = subprocess.run(
        [sys.executable, "-c", _BURST_SCRIPT, BURST],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["ok"], data["error"]
    assert (data["lines"], data["displays"], data["lost_outputs"]) == (10_000, 10_000, 0)
    assert data["held"], "the kernel never had to wait: the stall did not test flow control"
    assert data["rise_kb"] < 60 * 1024, f"host peak RSS rose by {data['rise_kb'] // 1024} MB"


def test_a_run_without_loss_reports_none(executor: kx.KernelExecutor) -> None:
    result = executor.run_code(
        "from IPython.display import display\nfor i in range(50):\n    print(i); display(i)",
        agent_id="no-loss",
    )
    assert result.ok and result.lost_outputs == 0
    assert "lost" not in result.stdout


def test_output_sent_before_the_run_starts_is_waited_for(executor: kx.KernelExecutor) -> None:
    """ipykernel makes a request the parent of output before the run's ``pre_execute``: what
    is sent in between (here an input transformer's print; a daemon thread's in the hostile
    suite) is the run's. The kernel side did not count it, and the host ended the run on it
    without the ``execute_result`` that followed (the result lost, nothing said)."""
    s = executor.session("early-output")
    setup = s.run_code(
        "import sys\n"
        "def _early(lines):\n"
        "    sys.stdout.write('early\\n')\n"
        "    sys.stdout.flush()  # sent now, before the run's pre_execute\n"
        "    return lines\n"
        "get_ipython().input_transformers_post.append(_early)"
    )
    assert setup.ok, setup.error
    for _ in range(20):
        result = s.run_code("21 * 2")
        assert (result.result, result.lost_outputs) == ("42", 0), result
        # IPython may transform a cell more than once (IPython 9 does twice).
        assert result.stdout.startswith("early\n") and not result.stdout.replace("early\n", "")


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


# 3. fd-level output keeps whole characters (issue 22, item 10) -------------------------------


def test_a_character_split_across_two_writes_arrives_whole(executor: kx.KernelExecutor) -> None:
    """ipykernel decoded each read of the captured fd on its own: the two halves of a
    multi-byte character written separately arrived as two U+FFFD."""
    # Each byte is written once the kernel's reader has taken the one before from the pipe,
    # so every character is split across reads.
    result = executor.run_code(
        "import os, select, sys, time\n"
        "pipes = [sys.stdout._fid, sys.stderr._fid]\n"
        "data = 'é€😀'.encode()\n"
        "for i in range(len(data)):\n"
        "    os.write(1, data[i : i + 1])\n"
        "    os.write(2, data[i : i + 1])\n"
        "    while select.select(pipes, [], [], 0)[0]:\n"
        "        time.sleep(0.001)\n"
        "os.write(1, b'\\n'); os.write(2, b'\\n')\n",
        agent_id="utf8-split",
    )
    assert result.ok, result.error
    assert result.stdout == "é€😀\n"
    assert result.stderr == "é€😀\n"
