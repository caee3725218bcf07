"""Issue 40's goals in one run: what a live kernel costs, how fast a hibernated agent answers,
warm calls, cold starts, branching, and ten thousand agents on one executor.

Every row carries a baseline measured in the same run: the subprocess-per-call sandbox of
``bench.py`` (a fresh ``python`` per call) for times, one stock ipykernel (``jupyter_client``'s
``AsyncKernelManager``, its default launch) for memory. Sections (``--only`` picks some):

- ``live``: N idle sessions at the default isolation (``--sessions``, default 100 and 500): PSS
  per session (every process kernelexec started, divided by N), and where one idle kernel's
  and one launcher's memory goes (``/proc/PID/smaps`` by mapping, split into pages inherited
  from the fork server and pages of mappings the kernel made itself);
- ``wake``: a hibernated agent's first call, timed from ``session()``, with a small namespace
  and with 64 MiB of bytes plus a million-int list, without and with a prewarmed kernel;
- ``warm``: a warm ``call_tool`` p50/p99 interleaved with the baseline; calls/s and the host's
  and kernels' CPU per call with 1 and 8 sessions calling at once;
- ``cold``: the first call of a new session without prewarm at ``"process"`` (forked) and
  ``"bwrap"`` (plain launch), the levels taking turns;
- ``branch``: ``benchmarks/branching.py``'s rows once (``--gib``, default 1);
- ``agents``: ``10,000 x --scale`` agents, each with its own state, on one executor with
  ``max_kernels = 300 x --scale`` (at least 8), the rest hibernated; then random agents called
  by 8 callers: p50/p99 and the answers that were not the agent's own state.

Prints a table (goal, measured, baseline, met) and writes ``benchmarks/results/density.json``.

    python benchmarks/density.py                         # everything, 1,000 agents (scale 0.1)
    python benchmarks/density.py --only wake,warm        # some sections
    python benchmarks/density.py --scale 1 --only agents # the full 10,000 where time allows
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # the baseline and the helpers of the main benchmark
import branching
import scale

import kernelexec as kx

ADD = kx.Tool.from_source(bench.ADD_SOURCE)
ARGS = {"a": 1, "b": 2}
RESULTS = Path(__file__).parent / "results" / "density.json"
SECTIONS = ("live", "wake", "warm", "cold", "branch", "agents")


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {text}", file=sys.stderr)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1e3,
        "p99_ms": pct(values, 0.99) * 1e3,
    }


async def baseline_times(n: int, workdir: str) -> list[float]:
    return await bench.timed(n, lambda: bench.baseline_call(bench.ADD_SOURCE, "add", ARGS, workdir))


# -- memory -----------------------------------------------------------------------------------


def _mappings(pid: int) -> list[dict[str, Any]]:
    """``/proc/PID/smaps`` as a list of mappings with their range, name and kB fields."""
    maps: list[dict[str, Any]] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                name = head[5] if len(head) > 5 else ""
                maps.append({"range": (lo, hi), "name": name})
            elif maps and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
                maps[-1][head[0][:-1]] = int(head[1])
    return maps


def _kind(name: str) -> str:
    if not name:
        return "anonymous (Python heap arenas, thread stacks, mmap buffers)"
    if name.startswith("["):
        return name
    base = os.path.basename(name)
    for key in ("libpython", "libzmq", "libstdc++", "libc.so", "libcrypto", "libssl"):
        if key in base:
            return key
    if ".cpython-" in base or base.endswith(".so") or ".so." in base:
        return "other extension modules and libraries"
    if "python" in base:
        return "python executable"
    return "other files"


def smaps_breakdown(pid: int, parent: int | None) -> dict[str, Any]:
    """Where ``pid``'s PSS goes, by kind of mapping, and split into mappings that ``parent``
    has at the same address (inherited through fork: their private pages are copies made by
    writes, mostly reference counts) and mappings the process made itself."""
    try:
        own = _mappings(pid)
        theirs = {m["range"] for m in _mappings(parent)} if parent else set()
    except OSError:
        return {}
    kinds: dict[str, dict[str, float]] = {}
    split = {"inherited": 0.0, "own": 0.0}
    split_private = {"inherited": 0.0, "own": 0.0}
    for m in own:
        row = kinds.setdefault(_kind(m["name"]), {"pss_mib": 0.0, "private_mib": 0.0})
        row["pss_mib"] += m.get("Pss", 0) / 1024
        private = (m.get("Private_Dirty", 0) + m.get("Private_Clean", 0)) / 1024
        row["private_mib"] += private
        where = "inherited" if m["range"] in theirs else "own"
        split[where] += m.get("Pss", 0) / 1024
        split_private[where] += private
    return {
        "pss_mib": sum(k["pss_mib"] for k in kinds.values()),
        "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["pss_mib"])),
        "pss_mib_inherited_vs_own": split,
        "private_mib_inherited_vs_own": split_private,
    }


async def stock_kernel_pss() -> dict[str, Any]:
    """One stock ipykernel (jupyter_client's default launch), idle after one execute."""
    from jupyter_client.manager import AsyncKernelManager

    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=60)
        await kc.execute_interactive("x = 1", timeout=30)
        kc.stop_channels()
        await asyncio.sleep(1.0)
        pid = km.provisioner.pid if km.provisioner else None  # type: ignore[attr-defined]
        assert pid is not None
        kids = psutil.Process(pid).children(recursive=True)
        return {
            "pss_mib": (bench.pss_kib(pid) + sum(bench.pss_kib(p.pid) for p in kids)) / 1024,
            "rss_mib": bench.rss_kib(pid) / 1024,
        }
    finally:
        await km.shutdown_kernel(now=True)


def _roles() -> dict[str, list[int]]:
    """kernelexec's processes below this one, by their title."""
    out: dict[str, list[int]] = {"server": [], "launcher": [], "kernel": []}
    for p in scale.descendants():
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role, prefix in (
            ("server", "kernelexec fork server"),
            ("launcher", "kernelexec launcher"),
            ("kernel", "kernelexec kernel"),
        ):
            if title.startswith(prefix):
                out[role].append(p.pid)
    return out


async def live_section(sizes: list[int], workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"stock_kernel": await stock_kernel_pss(), "rows": []}
    log(f"stock kernel: {out['stock_kernel']['pss_mib']:.1f} MiB PSS")
    for n in sizes:
        log(f"{n} live sessions")
        row: dict[str, Any] = {"sessions": n}
        async with kx.AsyncKernelExecutor(max_kernels=n + 1, start_timeout=300) as ex:
            t0 = time.perf_counter()
            for i in range(n):
                r = await ex.run_code(f"mine = {i}", agent_id=f"agent-{i}")
                r.raise_for_error()
            row["fill_s"] = time.perf_counter() - t0
            await asyncio.sleep(1.0)
            procs = scale.descendants()
            pss = sum(bench.pss_kib(p.pid) for p in procs) / 1024
            row["processes"] = len(procs)
            row["pss_mib_per_session"] = pss / n
            roles = _roles()
            server = roles["server"][0] if roles["server"] else None
            kernels = roles["kernel"][:10]
            launchers = roles["launcher"][:10]
            row["kernel_pss_mib"] = statistics.median(bench.pss_kib(p) for p in kernels) / 1024
            row["launcher_pss_mib"] = (
                statistics.median(bench.pss_kib(p) for p in launchers) / 1024 if launchers else 0
            )
            row["server_pss_mib"] = bench.pss_kib(server) / 1024 if server else 0
            row["kernel_threads"] = psutil.Process(kernels[0]).num_threads()
            if kernels:
                # The launcher is the kernel's parent, and itself a fork of the server.
                row["kernel_smaps"] = smaps_breakdown(kernels[0], server)
            if launchers:
                row["launcher_smaps"] = smaps_breakdown(launchers[0], server)
            values = await asyncio.gather(
                *(ex.run_code("mine", agent_id=f"agent-{i}") for i in range(n))
            )
            row["wrong_state"] = sum(v.result != str(i) for i, v in enumerate(values))
        row["vs_stock_kernel"] = out["stock_kernel"]["pss_mib"] / row["pss_mib_per_session"]
        row["gib_per_1000"] = row["pss_mib_per_session"] * 1000 / 1024
        log(f"  {row['pss_mib_per_session']:.1f} MiB per session, fill {row['fill_s']:.0f} s")
        out["rows"].append(row)
    return out


# -- wake -------------------------------------------------------------------------------------

SMALL = "me = 'agent-{i}'\nn = {i}\nnotes = ['x'] * 10"
LARGE = "me = 'agent-{i}'\nblob = bytes(64 * 1024 * 1024)\nints = list(range(1_000_000))"
CHECK = {"small": ("print(me, n)", "agent-{i} {i}\n"), "large": ("print(me, len(ints))", "")}


async def _wake_once(ex: kx.AsyncKernelExecutor, kind: str, i: int, prewarm: bool) -> dict:
    agent = f"{kind}-{i}"
    s = await ex.session(agent)
    (await s.run_code((SMALL if kind == "small" else LARGE).format(i=i))).raise_for_error()
    await s.hibernate()
    if prewarm:
        await ex.warm_up()  # the pool has its kernel again
    code, _ = CHECK[kind]
    t0 = time.perf_counter()
    s = await ex.session(agent)
    r = await s.run_code(code)
    wake = time.perf_counter() - t0
    want = f"agent-{i} {i}\n" if kind == "small" else f"agent-{i} 1000000\n"
    assert r.stdout == want and r.restored is not None, r
    t0 = time.perf_counter()
    await s.run_code(code)
    warm = time.perf_counter() - t0
    await s.aclose()
    return {"wake": wake, "restore": r.restored.seconds, "warm": warm}


async def wake_section(rounds: int, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    samples: dict[str, list[dict[str, float]]] = {}
    base: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        executors = {}
        for prewarm in (False, True):
            state = stack.enter_context(tempfile.TemporaryDirectory(prefix="kxwake-"))
            ex = await stack.enter_async_context(
                kx.AsyncKernelExecutor(state_dir=state, prewarm=int(prewarm), default_timeout=120)
            )
            await ex.run_code("1", agent_id="first")  # the fork server is up
            executors[prewarm] = ex
        log(f"wake: {rounds} rounds, small and large, prewarm 0 and 1")
        for i in range(rounds):
            for kind in ("small", "large"):
                if kind == "large" and i >= max(2, rounds // 3):
                    continue
                for prewarm, ex in executors.items():
                    one = await _wake_once(ex, kind, i, prewarm)
                    samples.setdefault(f"{kind}_prewarm{int(prewarm)}", []).append(one)
            base += await baseline_times(3, workdir)
    for key, rows in samples.items():
        out[key] = {
            "wake": ms([r["wake"] for r in rows]),
            "restore_p50_ms": statistics.median(r["restore"] for r in rows) * 1e3,
            "warm_after_p50_ms": statistics.median(r["warm"] for r in rows) * 1e3,
        }
    out["baseline"] = ms(base)
    return out


# -- warm calls, throughput, cold start --------------------------------------------------------


async def warm_section(rounds: int, calls: int, window: float, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    warm: list[float] = []
    base: list[float] = []
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("warm")
        for _ in range(50):
            await s.call_tool(ADD, ARGS)
        log(f"warm calls: {rounds} rounds of {calls}, interleaved with the baseline")
        for _ in range(rounds):
            warm += await bench.timed(calls, lambda: s.call_tool(ADD, ARGS))
            base += await baseline_times(4, workdir)
    out["call_tool"] = ms(warm)
    out["baseline"] = ms(base)
    out["throughput"] = await scale.throughput([1, 8], window, workdir)
    return out


async def cold_section(rounds: int, workdir: str) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"process": [], "bwrap": []}
    base: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        executors = {}
        for level in samples:
            ex = await stack.enter_async_context(kx.AsyncKernelExecutor(isolation=level))
            await ex.call_tool(ADD, ARGS, agent_id="first")  # the fork server (where used)
            executors[level] = ex
        log(f"cold start: {rounds} rounds, process and bwrap")
        for i in range(rounds):
            for level, ex in executors.items():
                t0 = time.perf_counter()
                r = await ex.call_tool(ADD, ARGS, agent_id=f"cold-{i}")
                samples[level].append(time.perf_counter() - t0)
                assert r.func_return == 3, r
                await (await ex.session(f"cold-{i}")).aclose()
            base += await baseline_times(2, workdir)
    return {**{k: ms(v) for k, v in samples.items()}, "baseline": ms(base)}


# -- ten thousand agents -----------------------------------------------------------------------


def tree_cpu_s() -> float:
    """CPU seconds of this process and everything below it, ended processes included (a
    process's reaped children count in its ``children_*`` times)."""
    me = psutil.Process().cpu_times()
    total = me.user + me.system + me.children_user + me.children_system
    for p in scale.descendants():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return float(total)


async def agents_section(scale_: float, calls: int, callers: int, prewarm: int) -> dict[str, Any]:
    agents = max(16, int(10_000 * scale_))
    budget = max(8, int(300 * scale_))
    log(f"agents: {agents} agents, max_kernels={budget}, prewarm={prewarm}, {callers} callers")
    times: list[float] = []
    restored = wrong = 0
    with tempfile.TemporaryDirectory(prefix="kxagents-") as state:
        async with kx.AsyncKernelExecutor(
            state_dir=state,
            max_kernels=budget,
            prewarm=prewarm,
            default_timeout=300,
            start_timeout=300,
        ) as ex:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(agents):
                queue.put_nowait(i)

            async def make() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    r = await ex.run_code(SMALL.format(i=i), agent_id=f"agent-{i}")
                    r.raise_for_error()
                    if i % 500 == 0:
                        log(f"  agent {i}")

            t0 = time.perf_counter()
            await asyncio.gather(*(make() for _ in range(8)))
            fill_s = time.perf_counter() - t0
            picks = [random.randrange(agents) for _ in range(calls)]
            for i in picks:
                queue.put_nowait(i)

            async def call() -> None:
                nonlocal restored, wrong
                while not queue.empty():
                    i = queue.get_nowait()
                    t = time.perf_counter()
                    r = await ex.run_code("print(me, n)", agent_id=f"agent-{i}")
                    times.append(time.perf_counter() - t)
                    restored += r.restored is not None
                    wrong += r.stdout != f"agent-{i} {i}\n"

            log(f"  filled in {fill_s:.0f} s; {calls} calls of random agents")
            cpu0, t0 = tree_cpu_s(), time.perf_counter()
            await asyncio.gather(*(call() for _ in range(callers)))
            call_s = time.perf_counter() - t0
            cpu_per_call = (tree_cpu_s() - cpu0) / calls
            live = len(ex.sessions)
    return {
        "agents": agents,
        "scale": scale_,
        "max_kernels": budget,
        "prewarm": prewarm,
        "callers": callers,
        "fill_s": fill_s,
        "calls": calls,
        "calls_s": call_s,
        "calls_per_s": calls / call_s,
        "cpu_ms_per_call": cpu_per_call * 1e3,
        "call": ms(times),
        "woken": restored,
        "wrong_state": wrong,
        "sessions_known_at_end": live,
    }


FORK_FLOOR = """
import os, sys, time
blob = bytearray(b"x") * int(float(sys.argv[1]) * (1 << 30))
small = [str(i) for i in range(1_000_000)]
times = []
for _ in range(5):
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    times.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
print(sorted(times)[2])
"""


async def fork_floor_ms(gib: float) -> float:
    """The floor of a branch's parent pause: a bare ``os.fork()`` of a Python process holding
    the same state (median of 5)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FORK_FLOOR, str(gib), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return float(out.decode().strip()) * 1e3


# -- table ------------------------------------------------------------------------------------


def rows(res: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(goal, measured, baseline same run, ratio, met) per goal."""
    out: list[tuple[str, str, str, str, str]] = []

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    if "live" in res:
        stock = res["live"]["stock_kernel"]["pss_mib"]
        for r in res["live"]["rows"]:
            out.append(
                (
                    f"PSS per idle session, {r['sessions']} live (<= 8 MiB)",
                    f"{r['pss_mib_per_session']:.1f} MiB (kernel {r['kernel_pss_mib']:.1f},"
                    f" launcher {r['launcher_pss_mib']:.1f}); 1,000 = {r['gib_per_1000']:.1f}"
                    f" GiB; {r['wrong_state']} wrong",
                    f"stock kernel {stock:.1f} MiB",
                    f"{r['vs_stock_kernel']:.1f}x smaller",
                    met(r["pss_mib_per_session"] <= 8),
                )
            )
    if "wake" in res:
        w = res["wake"]
        base = w["baseline"]["p50_ms"]
        for key, goal, label in (
            ("small_prewarm0", 50, "wake, small namespace"),
            ("small_prewarm1", 50, "wake, small namespace, prewarm=1"),
            ("large_prewarm0", 250, "wake, 64 MiB bytes + 1M ints"),
            ("large_prewarm1", 250, "wake, 64 MiB bytes + 1M ints, prewarm=1"),
        ):
            if key not in w:
                continue
            v = w[key]
            p50 = v["wake"]["p50_ms"]
            extra = " (<= 2.5x baseline)" if goal == 50 else ""
            out.append(
                (
                    f"{label} (<= {goal} ms{extra})",
                    f"{p50:.0f} ms p50, {v['wake']['p99_ms']:.0f} p99 (restore"
                    f" {v['restore_p50_ms']:.0f} ms)",
                    f"subprocess call {base:.1f} ms",
                    f"{p50 / base:.2f}x the baseline",
                    met(p50 <= goal and (goal != 50 or p50 <= 2.5 * base)),
                )
            )
    if "warm" in res:
        w = res["warm"]
        c, base = w["call_tool"], w["baseline"]["p50_ms"]
        out.append(
            (
                "warm call p50 <= 0.6 ms, p99 <= 1.5 ms (>= 30x)",
                f"{c['p50_ms']:.2f} ms p50, {c['p99_ms']:.2f} ms p99",
                f"subprocess call {base:.1f} ms",
                f"{base / c['p50_ms']:.1f}x faster",
                met(c["p50_ms"] <= 0.6 and c["p99_ms"] <= 1.5 and base / c["p50_ms"] >= 30),
            )
        )
        for t in w["throughput"]:
            if t["sessions"] == 8:
                out.append(
                    (
                        "8 sessions >= 2,500 calls/s",
                        f"{t['calls_per_s']:,.0f} calls/s, {t['errors']} errors",
                        f"{t['baseline_calls_per_s']:.1f} calls/s",
                        f"{t['ratio']:.1f}x",
                        met(t["calls_per_s"] >= 2500),
                    )
                )
            out.append(
                (
                    f"host CPU per call <= 0.2 ms ({t['sessions']} calling)",
                    f"{t['host_cpu_ms_per_call']:.2f} ms"
                    f" (kernel {t['kernel_cpu_ms_per_call']:.2f})",
                    "-",
                    "-",
                    met(t["host_cpu_ms_per_call"] <= 0.2),
                )
            )
    if "cold" in res:
        c = res["cold"]
        base = c["baseline"]["p50_ms"]
        for level, goal in (("process", 20), ("bwrap", 40)):
            v = c[level]
            out.append(
                (
                    f"cold start at {level!r} <= {goal} ms",
                    f"{v['p50_ms']:.0f} ms p50, {v['p99_ms']:.0f} max",
                    f"subprocess call {base:.1f} ms",
                    f"{v['p50_ms'] / base:.2f}x the baseline",
                    met(v["p50_ms"] <= goal),
                )
            )
    if "branch" in res:
        b = res["branch"]
        gib = res["args"]["gib"]
        for label, key, basekey, goal in (
            (f"parent pause of a {gib:g} GiB fork", "parent_paused_s", "bare_fork_ms", 30),
            ("8 children answering", "fork_eight_answered_s", "baseline_new_session_s", 150),
            ("snapshot", "snapshot_s", "baseline_pickle_save_s", 30),
            ("restore + next call", "restore_s", "baseline_pickle_load_s", 60),
        ):
            v = b[key] * 1e3
            bv = b[basekey] * (1 if basekey.endswith("_ms") else 1e3) if basekey else None
            out.append(
                (
                    f"{label} <= {goal} ms",
                    f"{v:.0f} ms",
                    f"{'bare os.fork() ' if basekey == 'bare_fork_ms' else ''}{bv:.0f} ms"
                    if bv
                    else "-",
                    f"{bv / v:.1f}x faster" if bv else "-",
                    met(v <= goal),
                )
            )
    if "agents" in res:
        a = res["agents"]
        out.append(
            (
                "10,000 agents: random call p50/p99, 0 wrong",
                f"{a['agents']:,} agents (scale {a['scale']:g}), max_kernels {a['max_kernels']},"
                f" prewarm {a.get('prewarm', 0)}, {a['callers']} callers:"
                f" {a['call']['p50_ms']:.0f} / {a['call']['p99_ms']:.0f} ms,"
                f" {a['wrong_state']} wrong of {a['calls']} ({a['woken']} woken),"
                f" {a['cpu_ms_per_call']:.0f} ms CPU a call;"
                f" filled in {a['fill_s']:.0f} s",
                "-",
                "-",
                "0 wrong" if a["wrong_state"] == 0 else "WRONG STATES",
            )
        )
    return out


def table(res: dict[str, Any]) -> str:
    lines = ["| goal | measured | baseline (same run) | ratio | |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(res)]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "kernelexec": kx.__version__,
            "mem_total_gib": psutil.virtual_memory().total / 2**30,
        },
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "load_average": {"start": os.getloadavg()},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kxdensity-") as workdir:
        for section in args.only:
            t0 = time.perf_counter()
            if section == "live":
                res["live"] = await live_section(args.sessions, workdir)
            elif section == "wake":
                res["wake"] = await wake_section(args.rounds, workdir)
            elif section == "warm":
                res["warm"] = await warm_section(args.rounds, 100, args.window, workdir)
            elif section == "cold":
                res["cold"] = await cold_section(args.rounds, workdir)
            elif section == "branch":
                res["branch"] = await branching.measure(args.gib, {})
                res["branch"]["bare_fork_ms"] = await fork_floor_ms(args.gib)
            elif section == "agents":
                res["agents"] = await agents_section(
                    args.scale, args.calls, args.callers, args.prewarm
                )
            res["load_average"][section] = os.getloadavg()
            res.setdefault("section_s", {})[section] = time.perf_counter() - t0
    res["total_s"] = time.perf_counter() - started
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument("--sessions", default="100,500", help="live sessions, comma-separated")
    parser.add_argument("--scale", type=float, default=0.1, help="of 10,000 agents")
    parser.add_argument("--calls", type=int, default=400, help="random agent calls")
    parser.add_argument("--callers", type=int, default=8, help="agents row: calling at once")
    parser.add_argument("--prewarm", type=int, default=0, help="agents row: pooled kernels")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--window", type=float, default=3.0, help="seconds per calls/s row")
    parser.add_argument("--gib", type=float, default=1.0, help="branching state")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.scale, args.calls, args.rounds = "10", 0.005, 40, 3
        args.window, args.gib = 0.5, 0.1
    args.only = [s for s in args.only.split(",") if s]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    args.sessions = [int(x) for x in str(args.sessions).split(",") if x]
    res = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"load average at the start {res['load_average']['start'][0]:.1f} on {os.cpu_count()}")
    print(table(res))
    print(f"wrote {args.out} ({res['total_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
