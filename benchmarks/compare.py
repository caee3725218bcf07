"""Warm calls, cold starts and an idle kernel's memory of this tree against another checkout of
kernelexec, in one run.

For a change that must not make calls slower (a refactor), or that should make a kernel start
faster or cost less: each round starts one host process per tree (``PYTHONPATH`` set to the
tree), which times an executor made to its first result (``executor_start``, the first in the
process), warm ``call_tool`` and ``run_code`` calls on one session, then the first call
of ``--cold`` new sessions (no prewarm: a kernel forked from the running fork server) and each
one's PSS once idle; the trees take turns, so the machine's noise falls on both. Prints a table of
the medians over rounds and the ratio this tree / base, and writes JSON.

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
import psutil
import kernelexec as kx

ADD = 'def add(a: int, b: int) -> int:\n    "Add two numbers."\n    return a + b\n'
n = int(sys.argv[1])
tool = kx.Tool.from_source(ADD)
out = {"tree": kx.__file__}
# An executor made to its first result, the first in this process (its fork server starts too).
t0 = time.perf_counter()
with kx.KernelExecutor() as ex:
    ex.session("first").run_code("1 + 1")
    out["executor_start"] = (time.perf_counter() - t0) * 1000
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
    # A new session's first call without prewarm (its kernel forked from the running fork
    # server), and what that kernel costs idle.
    times, cpu, pss = [], [], []
    for i in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        s = ex.session(f"cold-{i}")
        s.call_tool(tool, {"a": 1, "b": 2})
        times.append(time.perf_counter() - t0)
        kernel = psutil.Process(int(s.run_code("import os; os.getpid()").result))
        used = kernel.cpu_times()
        cpu.append(used.user + used.system)  # the start, less noisy under load than its time
        time.sleep(0.3)
        pss.append(kernel.memory_full_info().pss / 2**20)
        s.close()
    out["cold_start"] = statistics.median(times) * 1000
    out["cold_start_kernel_cpu"] = statistics.median(cpu) * 1000
    out["idle_kernel_pss_mib"] = statistics.median(pss)
print(json.dumps(out))
"""


def measure(tree: Path, calls: int, cold: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(calls), str(cold)],
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
    parser.add_argument("--cold", type=int, default=5, help="new sessions per round")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compare.json")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this tree": ROOT}
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for label, tree in order:
            for row, ms in measure(tree, args.calls, args.cold).items():
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
    print("| row (median of round medians; ms, PSS in MiB) | base | this tree | this / base |")
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
