"""Where issue 40's unmet goals lose their time and memory: the profiles behind
``docs/scale.md``.

- ``host``: cProfile of the host over warm ``call_tool`` calls on one session: host CPU per
  call, and the share of it by function (own time) and by package;
- ``kernel``: py-spy (``--py-spy PATH``) on the kernel over the same loop: the share of the
  main thread's busy samples in each function (inclusive);
- ``start``: py-spy on the fork server and its children (``--subprocesses``) over cold starts
  at ``"process"``: what a new kernel spends its start on;
- ``restore``: py-spy on a prewarmed kernel and on the host while it wakes an agent holding
  64 MiB of bytes and a million-int list;
- ``modules``: the modules a forked kernel imports after the fork (its own memory, not shared
  with the fork server), with the size of their source.

    python benchmarks/density_profile.py host modules
    python benchmarks/density_profile.py --py-spy /path/to/py-spy kernel start

Prints the tables and writes ``benchmarks/results/density_profile.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

import kernelexec as kx
from kernelexec.backends import _forkserver

ADD = kx.Tool.from_source(bench.ADD_SOURCE)
ARGS = {"a": 1, "b": 2}
RESULTS = Path(__file__).parent / "results" / "density_profile.json"


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {text}", file=sys.stderr)


def _package(filename: str) -> str:
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins (C: json, hmac, zmq sends, ...)"
    match = re.search(r"site-packages/([^/]+)/", filename) or re.search(r"/(kernelexec)/", filename)
    if match:
        return match.group(1)
    return "standard library (asyncio, ...)"


async def host_profile(calls: int) -> dict[str, Any]:
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("profile")
        for _ in range(100):
            await s.call_tool(ADD, ARGS)
        profile = cProfile.Profile(time.process_time)  # CPU, not the wait for the kernel
        cpu0, t0 = time.process_time(), time.perf_counter()
        profile.enable()
        for _ in range(calls):
            await s.call_tool(ADD, ARGS)
        profile.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        # The same loop without the profiler, for the CPU per call it does not inflate.
        cpu1 = time.process_time()
        for _ in range(calls):
            await s.call_tool(ADD, ARGS)
        plain_cpu = time.process_time() - cpu1
    stats = pstats.Stats(profile)
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in entries.values())
    own = sorted(
        ((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})", k[0]) for k, v in entries.items()),
        reverse=True,
    )
    by_package: dict[str, float] = collections.defaultdict(float)
    by_module: dict[str, float] = collections.defaultdict(float)
    for t, _, filename in own:
        by_package[_package(filename)] += t
        if "/kernelexec/" in filename:
            by_module[filename.split("/kernelexec/", 1)[1]] += t
    return {
        "calls": calls,
        "host_cpu_ms_per_call": plain_cpu / calls * 1e3,
        "host_cpu_ms_per_call_profiled": cpu / calls * 1e3,
        "wall_ms_per_call": wall / calls * 1e3,
        "own_time_share": [(name, t / total) for t, name, _ in own[:30]],
        "kernelexec_module_share": dict(
            sorted(((k, v / total) for k, v in by_module.items()), key=lambda kv: -kv[1])
        ),
        "package_share": dict(
            sorted(((k, v / total) for k, v in by_package.items()), key=lambda kv: -kv[1])
        ),
    }


_IDLE = re.compile(r"(select|poll|wait|sleep|_watch_pipe_fd|recv_into|device)$")


def _inclusive(raw: str, depth: int = 0, thread: str = "") -> tuple[int, list[tuple[str, float]]]:
    """py-spy raw output: (busy samples, [(function, inclusive share)]) over the samples of
    processes ``depth`` deep in ``--subprocesses`` output (a fork server's kernels: 3) and of
    threads named ``thread``; a sample whose innermost frame waits (select, poll, a lock) is
    idle and left out."""
    counts: dict[str, int] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        chain = [f for f in frames if f.startswith("process")]
        if depth and len(chain) != depth:
            continue
        if thread and not any(f.startswith("thread") and f.endswith(thread) for f in frames[:5]):
            continue
        names = [f.split(" (")[0] for f in frames if not f.startswith(("process", "thread"))]
        if not names or _IDLE.search(names[-1]):
            continue
        total += int(n)
        for name in set(names):
            counts[name] += int(n)
    return total, [(k, v / total) for k, v in counts.most_common(45)] if total else []


async def kernel_profile(py_spy: str, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kxprof-") as tmp:
        raw = Path(tmp) / "kernel.txt"
        async with kx.AsyncKernelExecutor() as ex:
            s = await ex.session("profile")
            pid = int((await s.run_code("import os; os.getpid()")).result or 0)
            for _ in range(100):
                await s.call_tool(ADD, ARGS)
            spy = subprocess.Popen(  # noqa: ASYNC220 (py-spy runs beside the loop)
                [
                    py_spy,
                    "record",
                    "-r",
                    "1000",
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "-d",
                    str(int(seconds)),
                    "-p",
                    str(pid),
                    "--threads",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            n = 0
            while spy.poll() is None:
                await s.call_tool(ADD, ARGS)
                n += 1
            text = raw.read_text() if raw.exists() else ""
    main = _inclusive(text, thread="MainThread")
    every = _inclusive(text)
    return {
        "calls": n,
        "main_thread_busy_samples": main[0],
        "main_thread_inclusive": main[1],
        "all_threads_busy_samples": every[0],
        "all_threads_inclusive": every[1][:25],
    }


async def start_profile(py_spy: str, starts: int, keep: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kxprof-") as tmp:
        raw = Path(tmp) / "start.txt"
        async with kx.AsyncKernelExecutor() as ex:
            await ex.call_tool(ADD, ARGS, agent_id="first")
            servers = [s for s in _forkserver_pids()]
            spy = subprocess.Popen(  # noqa: ASYNC220 (py-spy runs beside the loop)
                [
                    py_spy,
                    "record",
                    "-r",
                    "500",
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "-s",
                    "--threads",
                    "-p",
                    str(servers[0]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await asyncio.sleep(1.0)
            times = []
            for i in range(starts):
                t0 = time.perf_counter()
                await ex.call_tool(ADD, ARGS, agent_id=f"cold-{i}")
                times.append(time.perf_counter() - t0)
                await asyncio.sleep(0.3)  # idle: the samples stay the start's
                await (await ex.session(f"cold-{i}")).aclose()
            spy.send_signal(2)
            spy.wait(30)
            text = raw.read_text() if raw.exists() else ""
    if keep:
        Path(keep, "start.txt").write_text(text)  # noqa: ASYNC240
    busy, shares = _inclusive(text, depth=3, thread="MainThread")
    return {
        "starts": starts,
        "cold_start_ms_median": sorted(times)[len(times) // 2] * 1e3,
        "busy_samples": busy,
        "inclusive": shares,
    }


async def restore_profile(py_spy: str, keep: str) -> dict[str, Any]:
    """py-spy on a prewarmed kernel and on this host while the kernel wakes an agent holding
    64 MiB of bytes and a list of a million ints."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="kxprof-") as tmp:
        async with kx.AsyncKernelExecutor(state_dir=tmp, prewarm=1) as ex:
            s = await ex.session("large")
            made = await s.run_code("blob = bytes(64 * 1024 * 1024)\nints = list(range(1_000_000))")
            made.raise_for_error()
            await s.hibernate()
            await ex.warm_up()
            pool = [
                p.pid
                for p in psutil.Process().children(recursive=True)
                if " ".join(p.cmdline()).startswith("kernelexec kernel (pool)")
            ]
            spies = {}
            for who, pid in (("kernel", pool[0]), ("host", os.getpid())):
                out = Path(tmp, f"{who}.txt")
                spies[who] = (
                    out,
                    subprocess.Popen(  # noqa: ASYNC220 (py-spy runs beside the loop)
                        [
                            py_spy,
                            "record",
                            "-r",
                            "1000",
                            "-f",
                            "raw",
                            "-o",
                            str(out),
                            "--threads",
                            "--nonblocking",
                            "-p",
                            str(pid),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    ),
                )
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            back = await (await ex.session("large")).run_code("print(len(ints))")
            wake = time.perf_counter() - t0
            assert back.stdout == "1000000\n" and back.restored is not None, back
            texts = {}
            for who, (out, spy) in spies.items():
                spy.send_signal(2)
                spy.wait(30)
                texts[who] = out.read_text() if out.exists() else ""
                if keep:
                    Path(keep, f"restore-{who}.txt").write_text(texts[who])  # noqa: ASYNC240
    kernel = _inclusive(texts["kernel"], thread="MainThread")
    host = _inclusive(texts["host"], thread="MainThread")
    return {
        "wake_ms": wake * 1e3,
        "restored_seconds_ms": back.restored.seconds * 1e3,
        "kernel_busy_samples": kernel[0],
        "kernel_inclusive": kernel[1],
        "host_busy_samples": host[0],
        "host_inclusive": host[1],
    }


def _forkserver_pids() -> list[int]:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("kernelexec fork server"):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


async def modules_profile() -> dict[str, Any]:
    """Modules a forked kernel has that its fork server did not import."""
    head = _forkserver.SOURCE.split("sys.modules.setdefault('debugpy', None)\n", 1)[1]
    imports = head.split("gc.collect()", 1)[0]
    probe = "import sys, json\nCOMPILED = '__kx_probe__'\nsys.modules.setdefault('debugpy', None)\n"
    probe += imports
    probe += "print(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(  # noqa: ASYNC221 (nothing else runs meanwhile)
        [sys.executable, "-s", "-c", probe], capture_output=True, text=True, check=True
    )
    server = set(json.loads(done.stdout.splitlines()[-1]))
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("modules")
        await s.call_tool(ADD, ARGS)
        r = await s.run_code(
            "import sys, json\n"
            "print(json.dumps({n: getattr(getattr(m, '__spec__', None), 'origin', None)"
            " for n, m in list(sys.modules.items()) if m is not None}))"
        )
    kernel = json.loads(r.stdout)
    extra = {n: o for n, o in kernel.items() if n not in server}
    sizes = {}
    for name, origin in extra.items():
        try:
            sizes[name] = os.path.getsize(origin) if origin and origin.endswith(".py") else 0  # noqa: ASYNC240
        except OSError:
            sizes[name] = 0
    return {
        "server_modules": len(server),
        "kernel_modules": len(kernel),
        "imported_after_fork": len(extra),
        "after_fork_source_kib": sum(sizes.values()) / 1024,
        "after_fork": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"load_average_start": os.getloadavg()}
    for what in args.what:
        log(what)
        if what == "host":
            out["host"] = await host_profile(args.calls)
        elif what == "modules":
            out["modules"] = await modules_profile()
        elif what == "restore":
            out["restore"] = await restore_profile(args.py_spy, args.keep)
        elif what in ("kernel", "start"):
            if not args.py_spy:
                raise SystemExit(f"{what}: needs --py-spy PATH")
            if what == "kernel":
                out["kernel"] = await kernel_profile(args.py_spy, args.seconds)
            else:
                out["start"] = await start_profile(args.py_spy, args.starts, args.keep)
        out.setdefault("load_average", {})[what] = os.getloadavg()
    return out


def show(out: dict[str, Any]) -> None:
    if "host" in out:
        h = out["host"]
        print(
            f"host: {h['host_cpu_ms_per_call']:.3f} ms CPU per call"
            f" ({h['host_cpu_ms_per_call_profiled']:.3f} profiled), {h['calls']} calls"
        )
        for k, v in h["package_share"].items():
            print(f"  {v:6.1%}  {k}")
        for k, v in list(h["kernelexec_module_share"].items())[:10]:
            print(f"  {v:6.1%}  kernelexec/{k}")
        for name, share in h["own_time_share"][:20]:
            print(f"  {share:6.1%}  {name}")
    for key in ("kernel", "start", "restore", "restore-host"):
        if key.split("-")[0] in out:
            k = out[key.split("-")[0]]
            shares = (
                k.get("main_thread_inclusive")
                or k.get("host_inclusive" if key == "restore-host" else "kernel_inclusive")
                or k.get("inclusive")
            )
            print(f"{key}: {json.dumps({x: y for x, y in k.items() if 'inclusive' not in x})}")
            for name, share in shares[:40]:
                print(f"  {share:6.1%}  {name}")
    if "modules" in out:
        m = out["modules"]
        print(
            f"modules: {m['imported_after_fork']} imported after the fork,"
            f" {m['after_fork_source_kib']:.0f} KiB of source"
        )
        for name, size in list(m["after_fork"].items())[:25]:
            print(f"  {size / 1024:7.1f} KiB  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", nargs="+", choices=("host", "kernel", "start", "modules", "restore")
    )
    parser.add_argument("--py-spy", default="", help="a py-spy executable")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--starts", type=int, default=15)
    parser.add_argument("--keep", default="", help="a directory to keep py-spy's raw output in")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    out = asyncio.run(main_async(args))
    show(out)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.out.write_text(json.dumps({**old, **out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
