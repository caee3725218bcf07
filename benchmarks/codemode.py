"""Code mode: the round trip of a host call made by kernel code, against a tool call of the same
function made by the host, in the same run of this script.

One executor at the default isolation, one session. Rows:

* ``kernel -> host (sync def)``: kernel code calls ``search`` exposed with ``session.expose``;
  the host runs it in a worker thread (as every plain function). Timed in the kernel around each
  call, ``N`` calls in one cell.
* ``kernel -> host (async def)``: the same, exposed as an ``async def`` (awaited in the kernel,
  run on the host's event loop).
* ``host -> kernel tool call (baseline)``: ``session.call_tool`` of the same function as a
  ``kx.Tool`` (it runs in the kernel), timed on the host around each call.
* ``gather of 100 host calls``: one cell awaiting 100 async calls at once: calls per second.

Usage: ``.venv/bin/python benchmarks/codemode.py [N]`` (about 20 s); writes
``benchmarks/results/codemode.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import kernelexec as kx


def search(query: str, limit: int = 3) -> list[dict[str, Any]]:
    """A stand-in search: ``limit`` hits for ``query``."""
    return [{"query": query, "rank": i} for i in range(limit)]


async def asearch(query: str, limit: int = 3) -> list[dict[str, Any]]:
    """``search``, as an async function."""
    return [{"query": query, "rank": i} for i in range(limit)]


KERNEL_LOOP = """
import json, time
from tools import search, asearch
times = []
for i in range({n} + 50):
    t = time.perf_counter()
    {call}
    times.append(time.perf_counter() - t)
print(json.dumps(times[50:]))
"""

GATHER = """
import asyncio, time
from tools import asearch
t = time.perf_counter()
await asyncio.gather(*(asearch(str(i)) for i in range(100)))
print(time.perf_counter() - t)
"""


def stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1e3, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 3),
        "n": len(ordered),
    }


def kernel_loop(session: kx.Session, call: str, n: int) -> dict[str, float]:
    out = session.run_code(KERNEL_LOOP.format(n=n, call=call), timeout=300)
    out.raise_for_error()
    return stats(json.loads(out.stdout))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    tool = kx.Tool.from_function(search)
    with kx.KernelExecutor(default_timeout=300, max_host_calls=n + 100) as ex:
        session = ex.session("bench-codemode")
        session.expose(search, asearch)
        rows: dict[str, Any] = {}
        rows["kernel -> host (sync def)"] = kernel_loop(session, "search('q', limit=3)", n)
        rows["kernel -> host (async def)"] = kernel_loop(session, "await asearch('q', limit=3)", n)
        times = []
        for _ in range(n + 50):
            start = time.perf_counter()
            result = session.call_tool(tool, {"query": "q", "limit": 3})
            times.append(time.perf_counter() - start)
            assert result.ok, result.error
        rows["host -> kernel tool call (baseline)"] = stats(times[50:])
        gathers = []
        for _ in range(10):
            out = session.run_code(GATHER)
            out.raise_for_error()
            gathers.append(float(out.stdout))
        rows["gather of 100 host calls"] = {
            "calls_per_s": round(100 / statistics.median(gathers)),
            "p50_ms_per_gather": round(statistics.median(gathers) * 1e3, 2),
        }
        isolation = session.isolation.level
    base = rows["host -> kernel tool call (baseline)"]["p50_ms"]
    print(f"isolation={isolation}, N={n} (after 50 warm-up calls)")
    print(f"{'row':40} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8} {'vs baseline':>12}")
    for name, row in rows.items():
        if "p50_ms" in row:
            ratio = row["p50_ms"] / base
            print(
                f"{name:40} {row['p50_ms']:8.3f} {row['p90_ms']:8.3f} "
                f"{row['mean_ms']:8.3f} {ratio:11.2f}x"
            )
            row["ratio_to_baseline_p50"] = round(ratio, 3)
        else:
            print(f"{name:40} {row['calls_per_s']} calls/s ({row['p50_ms_per_gather']} ms each)")
    results = {"isolation": isolation, "n": n, "rows": rows}
    out_path = Path(__file__).parent / "results" / "codemode.json"
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written to {out_path}")


if __name__ == "__main__":
    main()
