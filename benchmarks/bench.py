"""kernelexec benchmark: persistent kernels against the subprocess-per-call baseline, one run.

Prints a table and writes JSON (default ``benchmarks/results/latest.json``). Every ratio is
computed between rows measured in this same run, on this machine.

    python benchmarks/bench.py            # full run (a few minutes)
    python benchmarks/bench.py --quick    # tiny counts, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil

import kernelexec as kx

ADD_SOURCE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b
'''

ROUNDS = 10
REPO = str(Path(__file__).resolve().parent.parent)

# -- the baseline: a faithful re-implementation of the subprocess-per-call sandbox ---------------

_MARKER = "<<KX_BASELINE_RESULT>>"

_SCRIPT = """{model}
{source}

import base64, pickle
{validate}
_result = {name}(**{args!r})
print({marker!r} + base64.b64encode(pickle.dumps(_result)).decode())
"""

_MODEL = """
from pydantic import BaseModel

class AddArgs(BaseModel):
    a: int
    b: int
"""


async def baseline_call(
    source: str, name: str, args: dict[str, Any], workdir: str, with_model: bool = False
) -> Any:
    """Write a script with the arguments pasted in, run a fresh python, unpickle stdout."""
    script = _SCRIPT.format(
        model=_MODEL if with_model else "",
        source=source,
        validate="AddArgs(**" + repr(args) + ")" if with_model else "",
        name=name,
        args=args,
        marker=_MARKER,
    )
    path = os.path.join(workdir, f"tool_{time.monotonic_ns()}.py")
    Path(path).write_text(script)  # noqa: ASYNC240
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=os.environ.copy(),
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        os.unlink(path)
    text = out.decode()
    if _MARKER not in text:
        raise RuntimeError(f"baseline call failed: {err.decode()[-500:]}")
    payload = text.split(_MARKER, 1)[1].strip()
    return pickle.loads(base64.b64decode(payload))


# -- helpers --------------------------------------------------------------------------------------


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    n = len(ordered)

    def pct(p: float) -> float:
        return ordered[min(n - 1, int(p * n))] * 1000

    return {
        "n": n,
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
    }


async def timed(n: int, fn: Callable[[], Awaitable[Any]]) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 if it is gone)."""
    try:
        return int(psutil.Process(pid).memory_info().rss // 1024)
    except psutil.Error:
        return 0


def pss_kib(pid: int) -> int:
    """Proportional set size of ``pid`` in KiB (shared pages split among their users)."""
    try:
        return int(getattr(psutil.Process(pid).memory_full_info(), "pss", 0) // 1024)
    except psutil.Error:
        return 0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used, from /proc (0 if it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- scenarios ------------------------------------------------------------------------------------


async def bench_warm(results: dict[str, Any], n: int, n_base: int, workdir: str) -> None:
    """Every warm-latency row, interleaved: ``ROUNDS`` rounds, each running a block of every
    variant in turn, so that drift in machine load hits all rows alike."""
    tool = kx.Tool.from_source(ADD_SOURCE)
    args = {"a": 1, "b": 2}
    log(f"warm rows: {ROUNDS} interleaved rounds, {n} calls per kernelexec row in total")
    async with contextlib.AsyncExitStack() as stack:
        ex = await stack.enter_async_context(kx.AsyncKernelExecutor())
        fast = await ex.session("warm")
        os.environ["KERNELEXEC_NO_FAST_PATHS"] = "1"
        try:
            stock_ex = await stack.enter_async_context(kx.AsyncKernelExecutor())
            stock = await stock_ex.session("stock")
            await stock.run_code("0")  # start its kernel while the variable is set
        finally:
            del os.environ["KERNELEXEC_NO_FAST_PATHS"]
        exec_ex = await stack.enter_async_context(kx.AsyncKernelExecutor(fast_calls=False))
        exec_path = await exec_ex.session("execute-path")
        rec_ex = await stack.enter_async_context(
            kx.AsyncKernelExecutor(record_dir=os.path.join(workdir, "recordings"))
        )
        recorded = await rec_ex.session("recorded")
        sync_ex = stack.enter_context(kx.KernelExecutor())
        sync = sync_ex.session("sync")
        floor = await stack.enter_async_context(bare_client(shell_only=False))
        shell = await stack.enter_async_context(bare_client(shell_only=True))
        peer = await stack.enter_async_context(nbclient_peer())
        gateway = await stack.enter_async_context(gateway_session())
        await fast.run_code(ADD_SOURCE)

        async def sync_call() -> None:
            await asyncio.to_thread(sync.call_tool, tool, args)

        variants: dict[str, tuple[Callable[[], Awaitable[Any]], int]] = {
            "baseline": (lambda: baseline_call(ADD_SOURCE, "add", args, workdir), n_base),
            "baseline_model": (
                lambda: baseline_call(ADD_SOURCE, "add", args, workdir, with_model=True),
                n_base // 2,
            ),
            "call_tool_warm": (lambda: fast.call_tool(tool, args), n),
            "call_tool_warm_no_fast_paths": (lambda: stock.call_tool(tool, args), n),
            "call_tool_warm_execute_path": (lambda: exec_path.call_tool(tool, args), n),
            "call_tool_warm_sync": (sync_call, n // 2),
            "call_tool_warm_recorded": (lambda: recorded.call_tool(tool, args), n),
            "run_code_warm": (lambda: fast.run_code("add(1, 2)"), n // 2),
            "floor_jupyter_client": (floor, n),
            "floor_shell_only": (shell, n),
            "nbclient_peer": (peer, n // 2),
        }
        if gateway is not None:
            variants["call_tool_warm_gateway"] = (lambda: gateway.call_tool(tool, args), n)
        for fn, _ in variants.values():  # warm every path up
            for _ in range(3):
                await fn()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, (fn, total) in variants.items():
                samples[name] += await timed(max(1, total // ROUNDS), fn)
        for name, values in samples.items():
            results[name] = stats(values)


@contextlib.asynccontextmanager
async def bare_client(shell_only: bool) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A stock AsyncKernelClient execute of the same code, iopub drained until idle.

    The kernel gets the same flags kernelexec's local backend uses, so the difference between
    this row and call_tool is kernelexec's own layer. ``shell_only`` waits for the shell reply
    only (result read from ``user_expressions``; iopub ignored): the raw floor of one request.
    """
    from jupyter_client.manager import AsyncKernelManager

    from kernelexec.backends._local_process import KERNEL_FLAGS as _KERNEL_FLAGS

    sockdir = tempfile.mkdtemp(prefix="kxfloor-")
    km = AsyncKernelManager(
        kernel_name="python3",
        transport="ipc",
        ip=os.path.join(sockdir, "s"),
        connection_file=os.path.join(sockdir, "kernel.json"),
    )
    await km.start_kernel(extra_arguments=list(_KERNEL_FLAGS))
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        await kc.execute_interactive(ADD_SOURCE, timeout=30)

        async def shell() -> None:
            kc.execute("0", user_expressions={"r": "add(1, 2)"})
            reply = await kc.get_shell_msg(timeout=30)
            assert reply["content"]["user_expressions"]["r"]["data"]["text/plain"] == "3"

        async def one() -> None:
            msg_id = kc.execute("add(1, 2)")
            while True:
                msg = await kc.get_iopub_msg(timeout=30)
                if (
                    msg["parent_header"].get("msg_id") == msg_id
                    and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"
                ):
                    break
            await kc.get_shell_msg(timeout=30)

        yield shell if shell_only else one
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
        shutil.rmtree(sockdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def nbclient_peer() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """The peer approach: an nbclient NotebookClient executing a cell per call (warm kernel),
    as notebook-driven executors (AutoGen's Jupyter executor family) do."""
    import nbformat
    from nbclient import NotebookClient

    from kernelexec.backends._local_process import KERNEL_FLAGS as _KERNEL_FLAGS

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(ADD_SOURCE), nbformat.v4.new_code_cell("add(1, 2)")]
    client = NotebookClient(nb, timeout=30, kernel_name="python3")
    client.extra_arguments = list(_KERNEL_FLAGS)
    async with client.async_setup_kernel():
        await client.async_execute_cell(nb.cells[0], 0)

        async def one() -> None:
            cell = nb.cells[1]
            cell.outputs = []
            await client.async_execute_cell(cell, 1)
            assert cell.outputs[0]["data"]["text/plain"] == "3"

        yield one


@contextlib.asynccontextmanager
async def gateway_session() -> AsyncIterator[kx.AsyncSession | None]:
    """A session on a real jupyter-kernel-gateway on 127.0.0.1 (the tests' fixture: same kernel
    flags as the local backend), or None when the gateway extra or the gateway is missing."""
    try:
        import kernel_gateway  # noqa: F401
        import websockets  # noqa: F401
    except ImportError as exc:
        log(f"no gateway row: {exc}")
        yield None
        return
    sys.path.insert(0, REPO)
    from kernelexec.backends import GatewayBackend
    from tests.support.gateway import Gateway

    with Gateway() as gw:
        async with kx.AsyncKernelExecutor(backend=GatewayBackend(gw.url, token=gw.token)) as ex:
            yield await ex.session("gateway")


async def bench_first_call(results: dict[str, Any], rounds: int) -> None:
    tool = kx.Tool.from_source(ADD_SOURCE)
    cold, warm = [], []
    log(f"first call of a new session: {rounds} rounds with and without prewarm")
    for i in range(rounds):
        async with kx.AsyncKernelExecutor() as ex:
            t0 = time.perf_counter()
            await ex.call_tool(tool, {"a": 1, "b": 2}, agent_id=f"cold-{i}")
            cold.append(time.perf_counter() - t0)
        async with kx.AsyncKernelExecutor(prewarm=1) as ex:
            await ex.warm_up()
            t0 = time.perf_counter()
            await ex.call_tool(tool, {"a": 1, "b": 2}, agent_id=f"warm-{i}")
            warm.append(time.perf_counter() - t0)
    results["first_call_cold"] = stats(cold)
    results["first_call_prewarm"] = stats(warm)


async def bench_cold_start(results: dict[str, Any], rounds: int) -> None:
    """First call of a new session without a prewarmed kernel, in an executor that already runs
    (its fork server, when on, was started by an earlier session), with and without the fork
    server, at "none" and "process" ("bwrap" always launches the plain way); variants take
    turns. Each measured session is closed before the next, so one kernel runs at a time."""
    tool = kx.Tool.from_source(ADD_SOURCE)
    args = {"a": 1, "b": 2}
    variants = [(level, fork) for level in ("none", "process") for fork in (True, False)]
    log(f"cold start of a new session, fork server on/off: {rounds} rounds")
    samples: dict[str, list[float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        executors = {}
        for level, fork in variants:
            ex = await stack.enter_async_context(
                kx.AsyncKernelExecutor(isolation=level, backend_options={"fork_server": fork})
            )
            first = await ex.session("first")
            await first.call_tool(tool, args)  # starts the fork server (when on)
            await first.aclose()
            executors[(level, fork)] = ex
        for i in range(rounds):
            for (level, fork), ex in executors.items():
                name = f"cold_start_{level}_{'fork' if fork else 'plain'}"
                t0 = time.perf_counter()
                await ex.call_tool(tool, args, agent_id=f"cold-{i}")
                samples.setdefault(name, []).append(time.perf_counter() - t0)
                await (await ex.session(f"cold-{i}")).aclose()
    for name, values in samples.items():
        results[name] = stats(values)


ISOLATION_LEVELS = ("none", "process", "bwrap")


async def bench_isolation(results: dict[str, Any], n: int, rounds: int) -> None:
    """Warm call and cold start at each isolation level (bwrap only where it is installed).

    Warm calls are interleaved across the levels like the warm rows; each cold start is a new
    executor's first call (no prewarm), levels taking turns.
    """
    tool = kx.Tool.from_source(ADD_SOURCE)
    args = {"a": 1, "b": 2}
    levels = [lv for lv in ISOLATION_LEVELS if lv != "bwrap" or shutil.which("bwrap")]
    log(f"isolation levels {', '.join(levels)}: {n} warm calls each, {rounds} cold starts each")
    cold: dict[str, list[float]] = {lv: [] for lv in levels}
    for _ in range(rounds):
        for level in levels:
            async with kx.AsyncKernelExecutor(isolation=level) as ex:
                t0 = time.perf_counter()
                await ex.call_tool(tool, args, agent_id="cold")
                cold[level].append(time.perf_counter() - t0)
    async with contextlib.AsyncExitStack() as stack:
        sessions = {}
        for level in levels:
            ex = await stack.enter_async_context(kx.AsyncKernelExecutor(isolation=level))
            sessions[level] = await ex.session("warm")
            for _ in range(5):
                await sessions[level].call_tool(tool, args)
        warm: dict[str, list[float]] = {lv: [] for lv in levels}
        for _ in range(ROUNDS):
            for level in levels:
                s = sessions[level]
                warm[level] += await timed(max(1, n // ROUNDS), lambda s=s: s.call_tool(tool, args))
    results["isolation"] = {
        level: {"warm": stats(warm[level]), "cold": stats(cold[level])} for level in levels
    }


def cold_table(results: dict[str, Any]) -> list[str]:
    """The cold-start rows alone (``--cold-only``)."""
    lines = ["| cold start: first call of a new session | median ms | p90 ms | p99 ms |"]
    lines.append("|---|---|---|---|")
    for level in ("none", "process"):
        for kind in ("fork", "plain"):
            r = results.get(f"cold_start_{level}_{kind}")
            if r:
                lines.append(
                    f"| {level}, {'fork server' if kind == 'fork' else 'plain launch'} | "
                    f"{r['median_ms']:.1f} | {r['p90_ms']:.1f} | {r['p99_ms']:.1f} |"
                )
    return lines if len(lines) > 2 else []


def isolation_table(results: dict[str, Any]) -> list[str]:
    """The per-level rows."""
    rows = results.get("isolation")
    if not rows:
        return []
    lines = [
        "",
        "| isolation | warm call_tool median ms | p99 ms | cold start (first call) median ms "
        "| p90 ms |",
        "|---|---|---|---|---|",
    ]
    for level, r in rows.items():
        lines.append(
            f"| {level} | {r['warm']['median_ms']:.2f} | {r['warm']['p99_ms']:.2f} | "
            f"{r['cold']['median_ms']:.0f} | {r['cold']['p90_ms']:.0f} |"
        )
    return lines


async def bench_throughput(results: dict[str, Any], levels: list[int], window: float) -> None:
    tool = kx.Tool.from_source(ADD_SOURCE)
    rows = []
    for n in levels:
        log(f"throughput: {n} concurrent sessions for {window:g} s")
        async with kx.AsyncKernelExecutor(max_kernels=max(n, 1)) as ex:
            sessions = [await ex.session(f"t{i}") for i in range(n)]
            await asyncio.gather(*(s.call_tool(tool, {"a": 1, "b": 2}) for s in sessions))
            errors = 0
            count = 0
            lat: list[float] = []
            stop = time.perf_counter() + window

            async def worker(
                s: kx.AsyncSession, stop: float = stop, lat: list[float] = lat
            ) -> None:
                nonlocal errors, count
                while time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    r = await s.call_tool(tool, {"a": 1, "b": 2})
                    lat.append(time.perf_counter() - t0)
                    count += 1
                    errors += not r.ok

            pids = [int((await s.run_code("import os; os.getpid()")).result or 0) for s in sessions]
            host_cpu, kernel_cpu = cpu_s(os.getpid()), sum(cpu_s(p) for p in pids)
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(s) for s in sessions))
            elapsed = time.perf_counter() - t0
            host_cpu = cpu_s(os.getpid()) - host_cpu
            kernel_cpu = sum(cpu_s(p) for p in pids) - kernel_cpu
            row = {
                "host_cpu_ms_per_call": host_cpu / max(count, 1) * 1000,
                "kernel_cpu_ms_per_call": kernel_cpu / max(count, 1) * 1000,
                "sessions": n,
                "calls_per_s": count / elapsed,
                "errors": errors,
                **{k: v for k, v in stats(lat).items() if k != "n"},
                "kernel_rss_mib_per_session": sum(rss_kib(p) for p in pids) / n / 1024,
                "kernel_pss_mib_per_session": sum(pss_kib(p) for p in pids) / n / 1024,
                "host_rss_mib": rss_kib(os.getpid()) / 1024,
            }
            rows.append(row)
    results["throughput"] = rows


_BUILD_BODY = """
    table = [{"id": i, "group": i % 97, "value": (i * 7919) % 1000} for i in range(rows)]
    index = {}
    for row in table:
        index.setdefault(row["group"], []).append(row["value"])
    means = {g: sum(v) / len(v) for g, v in index.items()}
"""

STATE_BUILD = f'''
def build(rows: int) -> int:
    """Build a 1M-row table and its per-group index once; keep them in the session."""
    global table, means
{_BUILD_BODY}
    return len(table)
'''

STATE_QUERY = '''
def query(group: int) -> float:
    """Mean value of one group, from the index built earlier."""
    return means[group]
'''

# The baseline has no state between calls: every query rebuilds the table and index.
BASELINE_STATEFUL = f"""
def query(group: int, rows: int = 1000000) -> float:
{_BUILD_BODY}
    return means[group]
"""

STATE_ROWS = 1_000_000


async def bench_stateful(results: dict[str, Any], queries: int, workdir: str) -> None:
    log(f"stateful workload: build {STATE_ROWS:,} rows once, then {queries} queries")
    build = kx.Tool.from_source(STATE_BUILD)
    query = kx.Tool.from_source(STATE_QUERY)
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("stateful")
        await s.run_code("1")
        t0 = time.perf_counter()
        assert (await s.call_tool(build, {"rows": STATE_ROWS})).func_return == STATE_ROWS
        t1 = time.perf_counter()
        answers = [
            (await s.call_tool(query, {"group": g % 97})).func_return for g in range(queries)
        ]
        kx_query = time.perf_counter() - t1
        kx_total = time.perf_counter() - t0
    n_base = max(2, queries // 20)
    t0 = time.perf_counter()
    base_answers = [
        await baseline_call(BASELINE_STATEFUL, "query", {"group": g % 97}, workdir)
        for g in range(n_base)
    ]
    base_per_call = (time.perf_counter() - t0) / n_base
    assert base_answers == answers[:n_base]
    results["stateful"] = {
        "queries": queries,
        "kernelexec_total_s": kx_total,
        "kernelexec_per_query_ms": kx_query / queries * 1000,
        "baseline_per_call_ms": base_per_call * 1000,
        "baseline_total_s_extrapolated": base_per_call * queries,
        "baseline_calls_measured": n_base,
    }


# -- report ---------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    if "baseline" not in results:  # --isolation-only or --cold-only
        return "\n".join(cold_table(results) + isolation_table(results))
    base = results["baseline"]["median_ms"]
    floor = results["floor_jupyter_client"]["median_ms"]
    lines = [
        "| scenario | median ms | p90 ms | p99 ms | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for key, label in [
        ("baseline", "baseline: subprocess per call (pickle between markers)"),
        ("baseline_model", "baseline + generated pydantic args model"),
        ("floor_jupyter_client", "floor: bare jupyter-client execute, iopub to idle"),
        ("floor_shell_only", "floor: raw shell-only execute, user_expressions, no iopub"),
        ("nbclient_peer", "peer: nbclient execute_cell, warm"),
        ("call_tool_warm", "kernelexec call_tool, warm (served by the kernel side)"),
        ("call_tool_warm_execute_path", "kernelexec call_tool, warm, execute path (switch)"),
        ("call_tool_warm_gateway", "kernelexec call_tool, warm, Kernel Gateway on 127.0.0.1"),
        ("call_tool_warm_sync", "kernelexec call_tool, warm, blocking KernelExecutor"),
        ("call_tool_warm_no_fast_paths", "kernelexec call_tool, warm, kernel fast paths off"),
        ("call_tool_warm_recorded", "kernelexec call_tool, warm, recorded (1,000+ cells)"),
        ("run_code_warm", "kernelexec run_code `add(1, 2)`, warm"),
        ("first_call_prewarm", "first call of a new session, prewarm=1"),
        ("first_call_cold", "first call of a new executor's first session, no prewarm"),
        ("cold_start_none_fork", "cold start: new session, no prewarm, 'none', fork server"),
        ("cold_start_none_plain", "cold start: new session, no prewarm, 'none', plain launch"),
        ("cold_start_process_fork", "cold start: new session, no prewarm, 'process', fork server"),
        ("cold_start_process_plain", "cold start: new session, no prewarm, 'process', plain"),
    ]:
        if key not in results:
            continue
        r = results[key]
        ratio = base / r["median_ms"]
        lines.append(
            f"| {label} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{ratio:.1f}x faster |"
            if ratio >= 1
            else f"| {label} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{1 / ratio:.1f}x slower |"
        )
    warm = results["call_tool_warm"]["median_ms"]
    lines.append("")
    lines.append(
        f"call_tool vs baseline: {base / warm:.1f}x faster; vs baseline with args model: "
        f"{results['baseline_model']['median_ms'] / warm:.1f}x faster; "
        f"overhead over the bare jupyter-client floor: {warm / floor:.2f}x"
    )
    if "floor_shell_only" in results:
        lines.append(
            f"call_tool / raw shell-only floor: "
            f"{warm / results['floor_shell_only']['median_ms']:.2f}x; nbclient peer / call_tool: "
            f"{results['nbclient_peer']['median_ms'] / warm:.2f}x; fast paths off / on: "
            f"{results['call_tool_warm_no_fast_paths']['median_ms'] / warm:.2f}x"
        )
    if "call_tool_warm_execute_path" in results:
        warm_row = results["call_tool_warm"]
        lines.append(
            f"served call / execute path: "
            f"{results['call_tool_warm_execute_path']['median_ms'] / warm:.2f}x faster; "
            f"served call vs baseline {base / warm:.1f}x (target >= 14x); "
            f"p99 / p50 {warm_row['p99_ms'] / warm:.2f} (target <= 3)"
        )
    if "call_tool_warm_gateway" in results:
        lines.append(
            f"gateway call_tool / local call_tool: "
            f"{results['call_tool_warm_gateway']['median_ms'] / warm:.2f}x (target <= 1.5x)"
        )
    if "first_call_prewarm" in results:
        lines.append(
            f"first call with prewarm / warm call: "
            f"{results['first_call_prewarm']['median_ms'] / warm:.2f}x"
        )
    if "throughput" in results:
        lines += [
            "",
            "| sessions | calls/s | p50 ms | p99 ms | errors | host CPU ms/call "
            "| kernel CPU ms/call | kernel RSS MiB/session | kernel PSS MiB/session "
            "| host RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in results["throughput"]:
            lines.append(
                f"| {row['sessions']} | {row['calls_per_s']:.0f} | {row['median_ms']:.2f} | "
                f"{row['p99_ms']:.2f} | {row['errors']} | {row['host_cpu_ms_per_call']:.3f} | "
                f"{row['kernel_cpu_ms_per_call']:.3f} | {row['kernel_rss_mib_per_session']:.1f} "
                f"| {row['kernel_pss_mib_per_session']:.1f} | {row['host_rss_mib']:.0f} |"
            )
        eight = [r for r in results["throughput"] if r["sessions"] == 8]
        if eight:
            lines.append(
                f"8 sessions: {eight[0]['calls_per_s']:.0f} calls/s with {eight[0]['errors']} "
                "errors (target >= 1000, 0 errors)"
            )
    if "stateful" in results:
        st = results["stateful"]
        ratio = st["baseline_total_s_extrapolated"] / st["kernelexec_total_s"]
        lines += [
            "",
            f"stateful (build {STATE_ROWS:,} rows once, {st['queries']} queries): kernelexec "
            f"{st['kernelexec_total_s']:.2f} s in total including the build "
            f"({st['kernelexec_per_query_ms']:.2f} ms per query); the baseline rebuilds on "
            f"every call, {st['baseline_per_call_ms']:.0f} ms/call -> "
            f"{st['baseline_total_s_extrapolated']:.1f} s ({ratio:.0f}x slower in total, "
            f"{st['baseline_per_call_ms'] / st['kernelexec_per_query_ms']:.0f}x per query)",
        ]
    lines += isolation_table(results)
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "kernelexec": kx.__version__,
        },
        "quick": quick,
    }
    if args.isolation_only:
        await bench_isolation(results, n=50 if quick else 1000, rounds=1 if quick else 8)
        return results
    if args.cold_only:
        await bench_cold_start(results, rounds=2 if quick else 20)
        return results
    with tempfile.TemporaryDirectory(prefix="kxbench-") as workdir:
        await bench_warm(
            results, n=50 if quick else 1000, n_base=10 if quick else 200, workdir=workdir
        )
        await bench_first_call(results, rounds=1 if quick else 8)
        await bench_cold_start(results, rounds=2 if quick else 20)
        await bench_throughput(
            results, levels=[1, 2] if quick else [1, 2, 4, 8, 32], window=0.5 if quick else 3.0
        )
        await bench_stateful(results, queries=10 if quick else 100, workdir=workdir)
    await bench_isolation(results, n=50 if quick else 1000, rounds=1 if quick else 8)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny counts (smoke run)")
    parser.add_argument(
        "--isolation-only", action="store_true", help="only the rows per isolation level"
    )
    parser.add_argument(
        "--cold-only",
        action="store_true",
        help="only the cold-start rows (fork server on and off)",
    )
    parser.add_argument("--out", default=None, help="JSON path (default: results/latest.json)")
    args = parser.parse_args()
    if args.out is None:
        name = (
            "isolation.json"
            if args.isolation_only
            else "cold.json"
            if args.cold_only
            else "latest.json"
        )
        args.out = str(Path(__file__).parent / "results" / name)
    results = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(table(results))
    log(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
