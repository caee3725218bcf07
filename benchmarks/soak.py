"""Soak: thousands of mixed calls over a few sessions with faults injected, then a report.

``.venv/bin/python benchmarks/soak.py`` (not part of ``make test``; about 5-10 minutes here).
Each of 8 sessions makes its share of 10,000 calls, drawing each call from a mix: plain tool
calls, exceptions, invalid arguments, timeouts (interrupted, state kept), code that ignores the
interrupt (killed and restarted), the kernel killing itself, and memory-limit hits. At the end
it reports calls by outcome, restarts, recorded cells against calls made (none may be lost),
the host's RSS, open fds and threads at start, after the first tenth of the calls and at the
end (the recordings are kept in memory and grow with the calls; their size is reported), and
leftover processes, cgroups and directories (all must be 0). Writes
``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

import kernelexec as kx
from kernelexec._sandbox import _cgroups

ADD = '''
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b
'''

# (outcome expected, weight, what the call does)
MIX: list[tuple[str, int]] = [
    ("ok", 920),
    ("exception", 30),
    ("invalid_args", 20),
    ("timeout", 15),
    ("stuck", 4),
    ("kernel_killed", 6),
    ("memory_limit", 5),
]


def host_figures() -> dict[str, float]:
    me = psutil.Process()
    gc.collect()
    return {
        "rss_mib": me.memory_info().rss / 2**20,
        "fds": me.num_fds(),
        "threads": me.num_threads(),
    }


async def one_call(s: kx.AsyncSession, tool: kx.Tool, fault: str, i: int) -> tuple[str, bool]:
    """Make one call of the kind ``fault``; return (outcome seen, whether state was lost)."""
    if fault == "ok":
        r: kx.Execution = await s.call_tool(tool, {"a": i, "b": 1})
        good = r.ok and getattr(r, "func_return", None) == i + 1
        return ("ok" if good else f"wrong:{r.error}"), r.kernel_restarted
    if fault == "invalid_args":
        r = await s.call_tool(tool, {"a": "not an int", "b": 1})
    elif fault == "exception":
        r = await s.run_code("1 / 0")
    elif fault == "timeout":
        r = await s.run_code("import time; time.sleep(5)", timeout=0.3)
    elif fault == "stuck":
        r = await s.run_code(
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
            timeout=0.3,
        )
    elif fault == "kernel_killed":
        r = await s.run_code(
            "import os, signal, time\nprint('going', flush=True)\ntime.sleep(0.05)\n"
            "os.kill(os.getpid(), signal.SIGKILL)"
        )
    else:
        r = await s.run_code("b'x' * (2 * 1024**3)")
    kind = r.error.kind if r.error is not None else "ok"
    return kind, r.kernel_restarted


EXPECTED = {
    "ok": "ok",
    "invalid_args": "invalid_args",
    "exception": "exception",
    "timeout": "timeout",
    "stuck": "timeout",
    "kernel_killed": "kernel_died",
    "memory_limit": "limit_exceeded",
}


async def worker(s: kx.AsyncSession, calls: int, rng: random.Random, tally: dict[str, Any]) -> None:
    tool = kx.Tool.from_source(ADD)
    faults, weights = zip(*MIX, strict=False)
    for i in range(calls):
        fault = rng.choices(faults, weights)[0]
        try:
            seen, restarted = await one_call(s, tool, fault, i)
        except Exception as exc:  # a call must never raise: count it as a failure
            seen, restarted = f"raised:{type(exc).__name__}: {exc}", False
        tally["calls"] += 1
        tally["by_fault"][fault] += 1
        tally["by_outcome"][seen] += 1
        if seen != EXPECTED[fault]:
            tally["unexpected"].append({"fault": fault, "seen": seen})
        tally["restarts"] += int(restarted)


async def soak(total: int, sessions: int, seed: int, record: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    tmp = tempfile.gettempdir()
    before_dirs = {p for p in os.listdir(tmp) if p.startswith(("kx-", "kernelexec-"))}
    tally: dict[str, Any] = {
        "calls": 0,
        "restarts": 0,
        "by_fault": collections.Counter(),
        "by_outcome": collections.Counter(),
        "unexpected": [],
    }
    started = time.monotonic()
    async with kx.AsyncKernelExecutor(
        limits=kx.Limits(memory_mb=256),
        record=record,
        interrupt_grace=0.5,
        default_timeout=30,
        max_kernels=sessions + 1,
        prewarm=1,
    ) as ex:
        ss = [await ex.session(f"soak-{n}") for n in range(sessions)]
        for s in ss:
            await s.run_code("0")
        start_figures = host_figures()
        share = total // sessions
        rngs = [random.Random(rng.random()) for _ in ss]
        # A tenth of the calls first: thread pools and sockets reach their working size (and
        # every fault kind has happened); from there on the host's figures must stay flat.
        first = share // 10
        await asyncio.gather(*(worker(s, first, r, tally) for s, r in zip(ss, rngs, strict=True)))
        steady_figures = host_figures()
        await asyncio.gather(
            *(worker(s, share - first, r, tally) for s, r in zip(ss, rngs, strict=True))
        )
        end_figures = host_figures()
        recorded = 0
        recording_bytes = 0
        for s in ss:
            nb = s.notebook
            if nb is None:
                continue
            recording_bytes += len(json.dumps(nb))
            recorded += sum(
                1
                for c in nb.cells
                if c.metadata.get("kernelexec", {}).get("kind") in ("code", "tool_call")
            )
        launchers = [p.pid for p in psutil.Process().children(recursive=True)]
    elapsed = time.monotonic() - started
    left_procs = [p.pid for p in psutil.Process().children(recursive=True)]
    after_dirs = {p for p in os.listdir(tmp) if p.startswith(("kx-", "kernelexec-"))}
    sup = _cgroups.support()
    bases = [h.base for h in sup.v1.values()] + ([sup.v2.base] if sup.v2 else [])
    mine = f"kx-{os.getpid()}-"
    left_groups = [str(e) for b in bases for e in b.iterdir() if e.name.startswith(mine)]
    return {
        "calls": tally["calls"],
        "sessions": sessions,
        "seed": seed,
        "elapsed_s": round(elapsed, 1),
        "by_fault": dict(tally["by_fault"]),
        "by_outcome": dict(tally["by_outcome"]),
        "unexpected": tally["unexpected"][:20],
        "unexpected_count": len(tally["unexpected"]),
        "restarts": tally["restarts"],
        "recorded_cells": recorded,
        "calls_made": tally["calls"] + sessions,  # plus each session's warm-up call
        "recording": record,
        "host_start": start_figures,
        "host_after_first_tenth": steady_figures,
        "host_end": end_figures,
        "recordings_in_memory_mib": round(recording_bytes / 2**20, 1),
        "kernel_processes_during": len(launchers),
        "leftover_processes": len(left_procs),
        "leftover_dirs": sorted(after_dirs - before_dirs),
        "leftover_cgroups": left_groups,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument(
        "--no-record", action="store_true", help="no recordings (host RSS without them)"
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "soak.json"), help="JSON path"
    )
    args = parser.parse_args()
    report = asyncio.run(soak(args.calls, args.sessions, args.seed, record=not args.no_record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = (
        report["unexpected_count"] == 0
        and (not report["recording"] or report["recorded_cells"] == report["calls_made"])
        and report["leftover_processes"] == 0
        and not report["leftover_dirs"]
        and not report["leftover_cgroups"]
    )
    print("soak:", "PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
