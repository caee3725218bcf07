"""What agents seeing their state costs (issue 38): the changes on every result, the variables
listing, and atomic runs.

Rows, each with its baseline measured in the same run:

- ``changes``: the kernel side's own work for ``Execution.changes`` (ids before the run, one
  pass after it) on a namespace of 1,000 names, timed inside the kernel (median of 2,000),
  for a run that binds no new name and for one that adds a name.
  Baseline: a warm ``run_code`` of ``pass`` on the same session, end to end.
- ``variables``: one ``session.variables()`` on the same 1,000 names (median of 20).
- ``atomic``: ``run_code("x = 1", atomic=True)`` against the same run without it, on a
  session holding 100 MiB (median of 20 each, interleaved), for a successful run and for a
  failed one (which is rolled back); the first atomic run of the session (at ``"process"`` it
  first puts the kernel on a branch of itself, see ``docs/state.md``), and one whose kernel
  dies (``os._exit``; median of 5), rolled back.

Usage: ``.venv/bin/python benchmarks/state.py [--huge-pages]``; writes
``benchmarks/results/state.json`` (``state-huge-pages.json`` with ``--huge-pages``: kernels
started with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, see ``docs/branching.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import kernelexec as kx

RESULTS = Path(__file__).parent / "results" / "state.json"

MEASURE_CHANGES = """
import sys, time
_t = sys.modules["__kernelexec__"]._state["tracker"]
_g = globals()
for _add in (False, True):
    _runs = []
    for _ in range(2000):
        _s = time.perf_counter()
        _t.before()
        if _add:
            _g["v_new"] = 1
        _t.changes()
        _runs.append(time.perf_counter() - _s)
        _g.pop("v_new", None)
    _runs.sort()
    print(_runs[len(_runs) // 2] * 1e3)
"""


async def _timed(call: object) -> float:
    start = time.perf_counter()
    await call  # type: ignore[misc]
    return time.perf_counter() - start


async def changes_rows(ex: kx.AsyncKernelExecutor) -> list[dict[str, object]]:
    s = await ex.session("names")
    await s.run_code("for _i in range(1000): globals()[f'v{_i}'] = _i")
    rebound_ms, added_ms = map(float, (await s.run_code(MEASURE_CHANGES)).stdout.split())
    warm = [await _timed(s.run_code("pass")) for _ in range(200)]
    listing = [await _timed(s.variables()) for _ in range(20)]
    return [
        {
            "row": "changes",
            "names": 1000,
            "kernel_side_ms_p50_no_new_name": round(rebound_ms, 4),
            "kernel_side_ms_p50_one_name_added": round(added_ms, 4),
            "warm_run_code_ms_p50": round(statistics.median(warm) * 1e3, 3),
        },
        {
            "row": "variables",
            "names": 1000,
            "ms_p50": round(statistics.median(listing) * 1e3, 2),
        },
    ]


async def atomic_row(ex: kx.AsyncKernelExecutor) -> dict[str, object]:
    s = await ex.session("big")
    await s.run_code('blob = bytearray(b"\\x01") * (100 * 1024 * 1024)  # pages touched')
    plain: list[float] = []
    atomic: list[float] = []
    failed: list[float] = []
    first = await _timed(s.run_code("x = 1", atomic=True))  # puts the kernel on a branch
    for _ in range(20):
        plain.append(await _timed(s.run_code("x = 1")))
        atomic.append(await _timed(s.run_code("x = 1", atomic=True)))
        failed.append(await _timed(s.run_code("x = 2\n1/0", atomic=True)))
    died = [await _timed(s.run_code("import os\nos._exit(1)", atomic=True)) for _ in range(5)]
    p50 = statistics.median(plain) * 1e3
    return {
        "row": "atomic",
        "state_mib": 100,
        "plain_ms_p50": round(p50, 2),
        "atomic_ok_ms_p50": round(statistics.median(atomic) * 1e3, 2),
        "atomic_ok_extra_ms": round(statistics.median(atomic) * 1e3 - p50, 2),
        "atomic_rolled_back_ms_p50": round(statistics.median(failed) * 1e3, 2),
        "first_atomic_ms": round(first * 1e3, 2),
        "atomic_kernel_died_rolled_back_ms_p50": round(statistics.median(died) * 1e3, 2),
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--huge-pages", action="store_true")
    huge = parser.parse_args().huge_pages
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"} if huge else {}
    async with kx.AsyncKernelExecutor(default_timeout=60, env_vars=env) as ex:
        rows = await changes_rows(ex)
        rows.append(await atomic_row(ex))
    path = RESULTS.with_name("state-huge-pages.json") if huge else RESULTS
    path.write_text(json.dumps({"huge_pages": huge, "rows": rows}, indent=2) + "\n")
    for row in rows:
        print(row)


if __name__ == "__main__":
    asyncio.run(main())
