"""Output under pressure: the host's peak memory for a 200 MB print, and a slow-consumer burst.

Each measurement runs in a fresh Python process, so its peak RSS (``ru_maxrss``) belongs to that
measurement alone. The burst is 10,000 prints and 10,000 displays while the host's ``on_stdout``
callback stalls until the kernel has sent them all; it is run with the host's iopub receive
high-water mark at ZMQ's default (1,000), at 100,000 and unlimited, to show what raising it costs.

Usage: ``.venv/bin/python benchmarks/outputs.py`` (about 1 min); writes
``benchmarks/results/outputs.json``.
"""

from __future__ import annotations

import json
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

BURST = textwrap.dedent(
    """
    import json, resource, sys, time
    from pathlib import Path
    import zmq
    import kernelexec as kx
    from kernelexec.backends import _local

    hwm = json.loads(sys.argv[1])
    if hwm is not None:
        _local._context().setsockopt(zmq.RCVHWM, hwm)
    code = '''
    from IPython.display import display
    for i in range(10_000):
        print(f"line {i}")
        display(i)
    open("burst-done", "w").close()
    '''
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
            while not (workdir / "burst-done").exists() and time.monotonic() < deadline:
                time.sleep(0.01)

        start = time.monotonic()
        result = session.run_code(code, on_stdout=stall)
        seconds = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    displays = sum(1 for o in result.outputs if o["output_type"] == "display_data")
    lines = sum(1 for line in result.stdout.splitlines() if line.startswith("line "))
    print(json.dumps({"rcvhwm": hwm, "lost_outputs": result.lost_outputs, "lines": lines,
                      "displays": displays, "peak_rise_mb": round((after - before) / 1024, 1),
                      "seconds": round(seconds, 1)}))
    """
)


def _run(script: str, *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=True
    )
    data: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def main() -> None:
    results: dict[str, object] = {"print_200mb": _run(PRINT)}
    print("200 MB print, max_output_chars=100_000:", results["print_200mb"])
    bursts = []
    for hwm in (None, 100_000, 0):
        row = _run(BURST, json.dumps(hwm))
        print("burst:", row)
        bursts.append(row)
    results["burst"] = bursts
    out = Path(__file__).parent / "results" / "outputs.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
