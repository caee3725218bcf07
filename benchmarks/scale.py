"""kernelexec at scale: many live sessions on one host, against the subprocess-per-call
baseline measured in the same run.

For each N in ``--sessions``: one executor fills N sessions (each keeps its own variable), then
measures the memory per session (PSS of every process kernelexec started, divided by N, and of
one idle kernel), processes, threads and descriptors, a warm call at N and the first call of
one more session at N, checks every session still holds its own value, and closes. Then calls/s
at each of ``--levels`` sessions calling at once, with the host's and the kernels' CPU time per
call, against as many subprocess-per-call calls at once. Prints a table and writes JSON
(default ``benchmarks/results/scale.json``).

    python benchmarks/scale.py                           # 100 and 500 sessions; 1, 8, 64 at once
    python benchmarks/scale.py --sessions 100,500,1000   # where memory allows
    python benchmarks/scale.py --quick                   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # the baseline and the helpers of the main benchmark

import kernelexec as kx

ADD = kx.Tool.from_source(bench.ADD_SOURCE)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def descendants() -> list[psutil.Process]:
    """Every process below this one (fork servers, launchers, kernels)."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def fds_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def footprint(n: int, kernel_pids: list[int]) -> dict[str, Any]:
    """Memory, processes, threads and descriptors of ``n`` live sessions."""
    procs = descendants()
    pss = sum(bench.pss_kib(p.pid) for p in procs)
    sample = kernel_pids[: min(20, len(kernel_pids))]
    threads = []
    for pid in sample:
        with contextlib.suppress(psutil.Error):
            threads.append(psutil.Process(pid).num_threads())
    names: dict[str, int] = {}
    for p in procs:
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        kind = " ".join(title.split()[:2]) if title.startswith("kernelexec") else "other"
        names[kind] = names.get(kind, 0) + 1
    return {
        "processes": len(procs),
        "processes_by_title": names,
        "pss_mib_per_session": pss / n / 1024,
        "kernel_pss_mib": statistics.median(bench.pss_kib(p) for p in sample) / 1024,
        "kernel_threads": statistics.median(threads) if threads else 0,
        "kernel_fds": statistics.median(fds_of(p) for p in sample),
        "host_fds": fds_of(os.getpid()),
        "host_threads": psutil.Process().num_threads(),
        "host_rss_mib": bench.rss_kib(os.getpid()) / 1024,
    }


async def baseline_median(n: int, workdir: str) -> float:
    times = await bench.timed(
        n, lambda: bench.baseline_call(bench.ADD_SOURCE, "add", {"a": 1, "b": 2}, workdir)
    )
    return statistics.median(times) * 1000


async def live_sessions(n: int, workdir: str, warm_calls: int) -> dict[str, Any]:
    log(f"{n} live sessions")
    row: dict[str, Any] = {"sessions": n}
    async with kx.AsyncKernelExecutor(max_kernels=n + 1, start_timeout=300) as ex:
        t0 = time.perf_counter()
        sessions = []
        for i in range(n):
            s = await ex.session(f"agent-{i}")
            r = await s.run_code(f"mine = {i}\nimport os; os.getpid()")
            if not r.ok:
                raise RuntimeError(f"session {i}: {r.error}")
            sessions.append((s, int(r.result or 0)))
            if (i + 1) % 100 == 0:
                log(f"  {i + 1} sessions, {fds_of(os.getpid())} host fds")
        row["fill_s"] = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # let the last kernels settle (idle threads, freed buffers)
        row.update(footprint(n, [pid for _, pid in sessions]))
        first, _ = sessions[0]
        warm = await bench.timed(warm_calls, lambda: first.call_tool(ADD, {"a": 1, "b": 2}))
        row["warm_call_ms"] = statistics.median(warm) * 1000
        t0 = time.perf_counter()
        extra = await ex.session("one-more")
        r = await extra.call_tool(ADD, {"a": 1, "b": 2})
        row["first_call_ms"] = (time.perf_counter() - t0) * 1000
        assert r.func_return == 3, r
        values = await asyncio.gather(*(s.run_code("mine") for s, _ in sessions))
        wrong = [i for i, v in enumerate(values) if v.result != str(i)]
        row["sessions_with_wrong_state"] = len(wrong)
        t0 = time.perf_counter()
    row["close_s"] = time.perf_counter() - t0
    row["left_processes"] = len(descendants())
    baseline = await baseline_median(20, workdir)
    row["baseline_call_ms"] = baseline
    row["warm_vs_baseline"] = baseline / row["warm_call_ms"]
    row["first_vs_baseline"] = baseline / row["first_call_ms"]
    return row


async def throughput(levels: list[int], window: float, workdir: str) -> list[dict[str, Any]]:
    rows = []
    for n in levels:
        log(f"throughput: {n} sessions calling at once for {window:g} s")
        async with kx.AsyncKernelExecutor(max_kernels=n) as ex:
            sessions = [await ex.session(f"t{i}") for i in range(n)]
            await asyncio.gather(*(s.call_tool(ADD, {"a": 1, "b": 2}) for s in sessions))
            count = errors = 0
            stop = [0.0]

            async def worker(s: kx.AsyncSession, stop: list[float] = stop) -> None:
                nonlocal count, errors
                while time.perf_counter() < stop[0]:
                    r = await s.call_tool(ADD, {"a": 1, "b": 2})
                    count += 1
                    errors += not r.ok

            others = [p.pid for p in descendants()]
            host0 = bench.cpu_s(os.getpid())
            kern0 = sum(bench.cpu_s(p) for p in others)
            t0 = time.perf_counter()
            stop[0] = t0 + window
            await asyncio.gather(*(worker(s) for s in sessions))
            elapsed = time.perf_counter() - t0
            host = bench.cpu_s(os.getpid()) - host0
            kern = sum(bench.cpu_s(p) for p in others) - kern0
        log(f"  baseline: {n} subprocess calls at once for {window:g} s")
        base_count = 0
        base_stop = time.perf_counter() + window

        async def base_worker(base_stop: float = base_stop) -> None:
            nonlocal base_count
            while time.perf_counter() < base_stop:
                await bench.baseline_call(bench.ADD_SOURCE, "add", {"a": 1, "b": 2}, workdir)
                base_count += 1

        b0 = time.perf_counter()
        await asyncio.gather(*(base_worker() for _ in range(n)))
        base_elapsed = time.perf_counter() - b0
        rows.append(
            {
                "sessions": n,
                "calls_per_s": count / elapsed,
                "errors": errors,
                "host_cpu_ms_per_call": host / max(count, 1) * 1000,
                "kernel_cpu_ms_per_call": kern / max(count, 1) * 1000,
                "baseline_calls_per_s": base_count / base_elapsed,
                "ratio": (count / elapsed) / max(base_count / base_elapsed, 1e-9),
            }
        )
    return rows


def table(results: dict[str, Any]) -> str:
    lines = [
        "| live sessions | PSS per session | PSS of one idle kernel | processes | kernel threads"
        " / fds | host fds | fill | warm call (vs subprocess) | first call of one more"
        " (vs subprocess) | wrong state | left after close |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["live"]:
        lines.append(
            f"| {r['sessions']} | {r['pss_mib_per_session']:.1f} MiB"
            f" | {r['kernel_pss_mib']:.1f} MiB | {r['processes']}"
            f" | {r['kernel_threads']:g} / {r['kernel_fds']:g} | {r['host_fds']}"
            f" | {r['fill_s']:.1f} s"
            f" | {r['warm_call_ms']:.2f} ms ({r['warm_vs_baseline']:.1f}x)"
            f" | {r['first_call_ms']:.0f} ms ({r['first_vs_baseline']:.2f}x)"
            f" | {r['sessions_with_wrong_state']} | {r['left_processes']} |"
        )
    lines += [
        "",
        "| sessions calling at once | calls/s | host CPU per call | kernel CPU per call"
        " | subprocess per call, calls/s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["throughput"]:
        lines.append(
            f"| {r['sessions']} | {r['calls_per_s']:,.0f} | {r['host_cpu_ms_per_call']:.2f} ms"
            f" | {r['kernel_cpu_ms_per_call']:.2f} ms | {r['baseline_calls_per_s']:,.1f}"
            f" | {r['ratio']:.1f}x |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "kernelexec": kx.__version__,
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
            "mem_total_gib": psutil.virtual_memory().total / 2**30,
        },
        "quick": args.quick,
        "live": [],
    }
    with tempfile.TemporaryDirectory(prefix="kxscale-") as workdir:
        for n in args.sessions:
            results["live"].append(await live_sessions(n, workdir, 10 if args.quick else 200))
        results["throughput"] = await throughput(args.levels, args.window, workdir)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", default="100,500", help="live sessions, comma-separated")
    parser.add_argument("--levels", default="1,8,64", help="sessions calling at once")
    parser.add_argument("--window", type=float, default=3.0, help="seconds per throughput row")
    parser.add_argument("--quick", action="store_true", help="10 sessions, 1 and 4 at once")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.json"))
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.levels, args.window = "10", "1,4", 0.5
    args.sessions = [int(x) for x in str(args.sessions).split(",") if x]
    args.levels = [int(x) for x in str(args.levels).split(",") if x]
    results = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(table(results))
    log(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
