"""Output under pressure: the host's peak memory for a 200 MB print, and a slow-consumer burst.

Each measurement runs in a fresh Python process, so its peak RSS (``ru_maxrss``) belongs to that
measurement alone. The burst is 10,000 prints and 10,000 displays while the host's ``on_stdout``
callback stalls until the kernel has had to wait for the host (or, without flow control, until
the kernel has sent everything). It runs with flow control (the default, issue 21), without it
at ZMQ's high-water mark of 1,000 (what was lost before), and without it with an unlimited host
high-water mark (what holding everything on the host costs in memory).

Usage: ``.venv/bin/python benchmarks/outputs.py`` (about 1 min); writes
``benchmarks/results/outputs.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PRINT = textwrap.dedent(
    """
    import json, resource
    import kernelexec as kx
    with kx.KernelExecutor(max_output_chars=100_000, default_timeout=60) as ex:
        ex.run_code("print('warm')")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = ex.run_code("print('x' * 200_000_000)")
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rise_mb": round((after - before) / 1024, 1),
                      "stdout_chars": len(result.stdout)}))
    """
)

# A thread in the kernel notes when the kernel first had to wait for the host; the stalled
# callback ends then, or once the tool is done (without flow control the kernel never waits).
TOOL_CODE = """
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

BURST = textwrap.dedent(
    """
    import json, os, resource, sys, time
    from pathlib import Path
    import zmq
    import kernelexec as kx
    from kernelexec.backends import _wire

    hwm = json.loads(sys.argv[1])
    if hwm is not None:
        _wire.context().setsockopt(zmq.RCVHWM, hwm)
    with kx.KernelExecutor(default_timeout=120) as ex:
        session = ex.session("burst")
        workdir = Path(str(session.workdir))
        session.run_code("1")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stalled = []

        def stall(text):
            if stalled:
                return
            stalled.append(True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if (workdir / "held").exists() or (workdir / "burst-done").exists():
                    break
                time.sleep(0.01)

        start = time.monotonic()
        result = session.run_code(sys.argv[2], on_stdout=stall)
        seconds = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        held = (workdir / "held").exists()
    displays = sum(1 for o in result.outputs if o["output_type"] == "display_data")
    lines = sum(1 for line in result.stdout.splitlines() if line.startswith("line "))
    print(json.dumps({"rcvhwm": hwm, "kernel_waited": held,
                      "lost_outputs": result.lost_outputs, "lines": lines, "displays": displays,
                      "peak_rise_mb": round((after - before) / 1024, 1),
                      "seconds": round(seconds, 1)}))
    """
)

# (row, host receive high-water mark (None: ZMQ's 1,000; 0: unlimited), flow control)
BURSTS = [
    ("flow control (default)", None, True),
    ("no flow control, ZMQ's HWM 1,000 (before issue 21)", None, False),
    ("no flow control, unlimited host HWM", 0, False),
]


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    data: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def main() -> None:
    results: dict[str, object] = {"print_200mb": _run(PRINT)}
    print("200 MB print, max_output_chars=100_000:", results["print_200mb"])
    bursts: list[dict[str, object]] = []
    for name, hwm, flow in BURSTS:
        env = {} if flow else {"KERNELEXEC_NO_FLOW_CONTROL": "1"}
        row = _run(BURST, json.dumps(hwm), TOOL_CODE, env=env)
        bursts.append({"row": name, "flow_control": flow, **row})
    results["burst"] = bursts
    unlimited = float(str(bursts[-1]["peak_rise_mb"])) or 1.0
    print("\n20,000 outputs (10,000 prints and 10,000 displays) under a stalled on_stdout:\n")
    print("| row | lost | lines | displays | kernel waited | peak RSS rise | vs unlimited | s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in bursts:
        rise = float(str(row["peak_rise_mb"]))
        print(
            f"| {row['row']} | {row['lost_outputs']} | {row['lines']} | {row['displays']} "
            f"| {row['kernel_waited']} | {rise} MB | {rise / unlimited:.2f}x | {row['seconds']} |"
        )
    out = Path(__file__).parent / "results" / "outputs.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
