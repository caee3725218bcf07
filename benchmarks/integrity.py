"""What issue 21's output flow control and run fences cost a warm call, in one run.

Three executors side by side, each with one warm session calling ``add(a, b)`` (and running
``1``): as before issue 21 (no flow control, no fence), with flow control only, and with both
(the default). Rounds take turns so that load on the machine falls on every row alike; the table
gives medians and the ratio to the first row.

Usage: ``.venv/bin/python benchmarks/integrity.py [--rounds 5] [--calls 300]``; writes
``benchmarks/results/integrity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import kernelexec as kx

ADD = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b
'''

ROWS = [
    ("before issue 21 (no flow control, no fence)", False, False),
    ("flow control only", True, False),
    ("flow control + fence (default)", True, True),
]


def _executor(flow_control: bool) -> kx.KernelExecutor:
    # The switch is read when the executor builds its install request.
    if flow_control:
        os.environ.pop("KERNELEXEC_NO_FLOW_CONTROL", None)
    else:
        os.environ["KERNELEXEC_NO_FLOW_CONTROL"] = "1"
    try:
        return kx.KernelExecutor()
    finally:
        os.environ.pop("KERNELEXEC_NO_FLOW_CONTROL", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    tool = kx.Tool.from_source(ADD)
    executors = [_executor(flow) for _, flow, _ in ROWS]
    sessions = []
    for ex, (_, _, fence) in zip(executors, ROWS, strict=True):
        s = ex.session("warm")
        for i in range(50):
            s.call_tool(tool, {"a": 1, "b": i})
            s.run_code("1")
        conn = s._inner.lease.connection  # a benchmark's switch: the fence off for one row
        assert conn is not None and conn.fenced
        conn.fenced = fence
        sessions.append(s)
    tool_ms: list[list[float]] = [[] for _ in ROWS]
    code_ms: list[list[float]] = [[] for _ in ROWS]
    try:
        for _ in range(args.rounds):
            for row, s in enumerate(sessions):
                for i in range(args.calls):
                    start = time.perf_counter()
                    s.call_tool(tool, {"a": 1, "b": i})
                    tool_ms[row].append((time.perf_counter() - start) * 1e3)
                    start = time.perf_counter()
                    s.run_code("1")
                    code_ms[row].append((time.perf_counter() - start) * 1e3)
    finally:
        for ex in executors:
            ex.close()
    base_tool, base_code = statistics.median(tool_ms[0]), statistics.median(code_ms[0])
    results = []
    print(
        f"warm calls, {args.rounds} rounds x {args.calls} per row, medians (load: "
        f"{os.getloadavg()[0]:.1f})\n"
    )
    print("| row | call_tool ms | vs before | run_code ms | vs before |")
    print("|---|---|---|---|---|")
    for row, (name, flow, fence) in enumerate(ROWS):
        t, c = statistics.median(tool_ms[row]), statistics.median(code_ms[row])
        results.append(
            {
                "row": name,
                "flow_control": flow,
                "fence": fence,
                "call_tool_ms": round(t, 3),
                "run_code_ms": round(c, 3),
                "call_tool_ratio": round(t / base_tool, 3),
                "run_code_ratio": round(c / base_code, 3),
            }
        )
        print(f"| {name} | {t:.3f} | {t / base_tool:.2f}x | {c:.3f} | {c / base_code:.2f}x |")
    out = Path(__file__).parent / "results" / "integrity.json"
    out.write_text(
        json.dumps({"rounds": args.rounds, "calls": args.calls, "rows": results}, indent=1) + "\n"
    )
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
