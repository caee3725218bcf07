"""Warm calls of this tree against another checkout of kernelexec, in one run.

For a change that must not make calls slower (a refactor): each round starts one host process
per tree (``PYTHONPATH`` set to the tree), which times two cold starts (an executor made to its
first result; the first in a process that has started no kernel) and warm ``call_tool`` and
``run_code`` calls on one session; the trees take turns, so the machine's noise falls on both.
Prints a table of the medians over rounds and the ratio this tree / base, and writes JSON.

    git worktree add /tmp/base <rev>
    python benchmarks/compare.py --base /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PROBE = r"""
import json, statistics, sys, time
import kernelexec as kx

ADD = 'def add(a: int, b: int) -> int:\n    "Add two numbers."\n    return a + b\n'
n = int(sys.argv[1])
tool = kx.Tool.from_source(ADD)
out = {"tree": kx.__file__}
# Cold start: an executor made to its first session's first result, twice (the first in a
# process that has started no kernel yet).
for row in ("cold_start_first", "cold_start"):
    t0 = time.perf_counter()
    with kx.KernelExecutor() as ex:
        ex.session("cold").run_code("1 + 1")
        out[row] = (time.perf_counter() - t0) * 1000
with kx.KernelExecutor() as ex:
    s = ex.session("compare")
    for _ in range(50):
        s.call_tool(tool, {"a": 1, "b": 2})
        s.run_code("1 + 1")
    for name, fn in (
        ("call_tool", lambda: s.call_tool(tool, {"a": 1, "b": 2})),
        ("run_code", lambda: s.run_code("1 + 1")),
    ):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1000
print(json.dumps(out))
"""


def measure(tree: Path, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(calls)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tree),
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(result.pop("tree")).startswith(str(tree)):
        raise SystemExit(f"{tree}: the probe imported kernelexec from elsewhere")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=400, help="timed calls per row and round")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compare.json")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this tree": ROOT}
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for label, tree in order:
            for row, ms in measure(tree, args.calls).items():
                samples[label].setdefault(row, []).append(ms)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    rows = sorted(samples["base"])
    table = {
        row: {
            "base_ms": statistics.median(samples["base"][row]),
            "this_ms": statistics.median(samples["this tree"][row]),
        }
        for row in rows
    }
    print("| row, median of round medians | base ms | this tree ms | this / base |")
    print("|---|---|---|---|")
    for row, v in table.items():
        v["ratio"] = v["this_ms"] / v["base_ms"]
        print(f"| {row} | {v['base_ms']:.3f} | {v['this_ms']:.3f} | {v['ratio']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"base": str(trees["base"]), "rows": table, "samples": samples}, indent=2)
    )


if __name__ == "__main__":
    main()
