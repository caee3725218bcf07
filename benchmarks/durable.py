"""Durable sessions (issue 24): many agents with their own state on few kernels, a 256 MiB
namespace saved and restored, and what ``checkpoint="after_call"`` costs a warm call.

Rows, each with its baseline measured in the same run:

- ``agents``: N agents (default 2,000; ``--agents`` to scale down on a slow machine), each with
  its own small namespace, served by ``max_kernels=64`` with 8 callers at once. Every agent is
  called twice; the second call wakes a hibernated agent (its kernel went under the budget)
  and must answer with the agent's own state. Baseline: the first call of a new session (a
  fresh kernel, nothing to restore) in the same executor.
- ``large``: ``hibernate()`` and the restoring call of 256 MiB of bytes plus a list of 2 million
  ints.
- ``after_call``: a warm tool call that changes nothing, with ``checkpoint="after_call"``,
  with the default ``"on_evict"`` and without a ``state_dir`` (p50 over 1,000 calls each,
  interleaved).

Usage: ``.venv/bin/python benchmarks/durable.py [--agents N]``; writes
``benchmarks/results/durable.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import kernelexec as kx

RESULTS = Path(__file__).parent / "results" / "durable.json"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def agents_row(n: int, callers: int = 8) -> dict[str, object]:
    first: list[float] = []
    wake: list[float] = []
    wrong = 0
    with tempfile.TemporaryDirectory() as state:
        async with kx.AsyncKernelExecutor(state_dir=state, max_kernels=64) as ex:
            queue: asyncio.Queue[int] = asyncio.Queue()

            async def worker(times: list[float], code: str, check: bool) -> None:
                nonlocal wrong
                while not queue.empty():
                    i = queue.get_nowait()
                    start = time.perf_counter()
                    out = await ex.run_code(code.format(i=i), agent_id=f"agent-{i}")
                    times.append(time.perf_counter() - start)
                    if check and (out.stdout != f"agent-{i} {i}\n" or out.restored is None):
                        wrong += 1

            start = time.perf_counter()
            for i in range(n):
                queue.put_nowait(i)
            make = "me = 'agent-{i}'\nn = {i}\nnotes = ['x'] * 10"
            await asyncio.gather(*(worker(first, make, False) for _ in range(callers)))
            for i in range(n):
                queue.put_nowait(i)
            await asyncio.gather(*(worker(wake, "print(me, n)", True) for _ in range(callers)))
            elapsed = time.perf_counter() - start
    return {
        "agents": n,
        "max_kernels": 64,
        "callers": callers,
        "calls": 2 * n,
        "calls_per_s": round(2 * n / elapsed, 1),
        "wake_p50_ms": round(_pct(wake, 0.5) * 1e3, 1),
        "wake_p99_ms": round(_pct(wake, 0.99) * 1e3, 1),
        "baseline_first_call_p50_ms": round(_pct(first, 0.5) * 1e3, 1),
        "wake_over_first_call": round(_pct(wake, 0.5) / _pct(first, 0.5), 2),
        "wrong_state": wrong,
    }


async def large_row() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as state:
        async with kx.AsyncKernelExecutor(state_dir=state, default_timeout=300) as ex:
            s = await ex.session("large")
            made = await s.run_code(
                "blob = bytes(256 * 1024 * 1024)\nints = list(range(2_000_000))"
            )
            made.raise_for_error()
            start = time.perf_counter()
            saved = await s.hibernate()
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            back = await s.run_code("print(len(blob), len(ints))")
            restore_call_s = time.perf_counter() - start
            assert back.stdout == f"{256 * 1024 * 1024} 2000000\n", back
            assert back.restored is not None
            start = time.perf_counter()
            again = await s.run_code("print(len(ints))")  # baseline: a warm call
            warm_s = time.perf_counter() - start
            assert again.ok
    return {
        "checkpoint_mb": round(saved.bytes / 2**20, 1),
        "save_s": round(save_s, 3),
        "restore_s": round(back.restored.seconds, 3),
        "restoring_call_s": round(restore_call_s, 3),
        "baseline_warm_call_ms": round(warm_s * 1e3, 2),
    }


def _add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def after_call_row(calls: int = 1000) -> dict[str, object]:
    tool = kx.Tool.from_function(_add)
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        async with (
            kx.AsyncKernelExecutor(state_dir=one, checkpoint="after_call") as after,
            kx.AsyncKernelExecutor(state_dir=two) as on_evict,
            kx.AsyncKernelExecutor() as plain,
        ):
            sessions = {
                "after_call": await after.session("a"),
                "on_evict": await on_evict.session("a"),
                "no_state_dir": await plain.session("a"),
            }
            times: dict[str, list[float]] = {k: [] for k in sessions}
            for s in sessions.values():
                await s.run_code("x = 1\nitems = list(range(100))\ntext = 'hello' * 20")
                for _ in range(50):
                    await s.call_tool(tool, {"a": 1, "b": 2})
            for _ in range(calls):  # interleaved, so load changes hit all three alike
                for name, s in sessions.items():
                    start = time.perf_counter()
                    out = await s.call_tool(tool, {"a": 1, "b": 2})
                    times[name].append(time.perf_counter() - start)
                    assert out.func_return == 3
    p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "calls": calls,
        "after_call_p50_ms": round(p50["after_call"], 3),
        "on_evict_p50_ms": round(p50["on_evict"], 3),
        "baseline_no_state_dir_p50_ms": round(p50["no_state_dir"], 3),
        "overhead_ms": round(p50["after_call"] - p50["no_state_dir"], 3),
    }


async def main(agents: int) -> None:
    rows = {
        "after_call": await after_call_row(),
        "large": await large_row(),
        "agents": await agents_row(agents),
    }
    for name, row in rows.items():
        print(f"{name}:")
        for key, value in row.items():
            print(f"  {key:28} {value}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2000)
    asyncio.run(main(parser.parse_args().agents))
