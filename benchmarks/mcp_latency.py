"""What the MCP layer costs: a ``run_python`` round trip through ``kernelexec mcp`` (stdio and
streamable HTTP, driven by the MCP SDK's own client) against a direct ``run_code``, one run.

Every row runs ``x + 1`` in a warm session of its own kernel; the rows are interleaved in rounds
so that load drift on a shared machine hits them alike. Prints a table and writes JSON (default
``benchmarks/results/mcp.json``).

    python benchmarks/mcp_latency.py            # 10 rounds x 50 calls per row
    python benchmarks/mcp_latency.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

import kernelexec as kx

CODE = "x + 1"
Call = Callable[[], Awaitable[None]]


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000

    return {
        "n": len(ordered),
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "mean_ms": statistics.fmean(ordered) * 1000,
    }


@asynccontextmanager
async def _stdio(env: dict[str, str], errlog: TextIO) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "kernelexec", "mcp"], env=env
    )
    async with (
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def _start_http_server(env: dict[str, str], token: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``kernelexec mcp --transport http`` on a free port; its process and URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelexec", "mcp", "--transport", "http", "--port", "0"],
        env={**env, "KERNELEXEC_MCP_TOKEN": token},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"at (http://\S+/mcp)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)
    raise RuntimeError("the HTTP server did not start")


@asynccontextmanager
async def _http(env: dict[str, str]) -> AsyncIterator[ClientSession]:
    token = secrets.token_urlsafe(24)
    proc, url = await anyio.to_thread.run_sync(_start_http_server, env, token)
    try:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session
    finally:
        proc.terminate()
        await anyio.to_thread.run_sync(proc.wait)


def _mcp_call(session: ClientSession) -> Call:
    async def call() -> None:
        result = await session.call_tool("run_python", {"code": CODE})
        if result.is_error or result.structured_content["result"] != "42":
            raise RuntimeError(f"unexpected result: {result}")

    return call


def _direct_call(session: kx.AsyncSession) -> Call:
    async def call() -> None:
        result = await session.run_code(CODE)
        if result.result != "42":
            raise RuntimeError(f"unexpected result: {result}")

    return call


async def measure(rounds: int, per_round: int, errlog: TextIO) -> dict[str, Any]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/"),
        **{k: v for k, v in os.environ.items() if k in ("TMPDIR", "KERNELEXEC_CACHE_DIR")},
    }
    async with AsyncExitStack() as stack:
        ex = await stack.enter_async_context(kx.AsyncKernelExecutor())
        direct = await ex.session("bench")
        stdio = await stack.enter_async_context(_stdio(env, errlog))
        http = await stack.enter_async_context(_http(env))
        rows: dict[str, Call] = {
            "direct run_code (AsyncSession, in process)": _direct_call(direct),
            "MCP run_python over stdio (SDK client)": _mcp_call(stdio),
            "MCP run_python over streamable HTTP (SDK client)": _mcp_call(http),
        }
        await direct.run_code("x = 41")
        for session in (stdio, http):
            await session.call_tool("run_python", {"code": "x = 41"})
        for call in rows.values():  # warm every path once
            for _ in range(5):
                await call()
        samples: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(rounds):
            for name, call in rows.items():
                for _ in range(per_round):
                    start = time.perf_counter()
                    await call()
                    samples[name].append(time.perf_counter() - start)
    return {name: _summary(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds x 10 calls")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "mcp.json"))
    ns = parser.parse_args()
    rounds, per_round = (2, 10) if ns.quick else (10, 50)
    with Path(os.devnull).open("w") as errlog:
        results = anyio.run(measure, rounds, per_round, errlog)
    direct = next(iter(results.values()))["median_ms"]
    print(f"{rounds} rounds x {per_round} calls per row, interleaved; code: {CODE!r}")
    print("| path | median ms | p90 ms | p99 ms | mean ms | median overhead vs direct |")
    print("|---|---|---|---|---|---|")
    for name, row in results.items():
        extra = row["median_ms"] - direct
        print(
            f"| {name} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | {row['p99_ms']:.2f} | "
            f"{row['mean_ms']:.2f} | {'' if extra == 0 else f'+{extra:.2f} ms'} |"
        )
    document = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "kernelexec": kx.__version__,
        },
        "quick": ns.quick,
        "code": CODE,
        "rounds": rounds,
        "calls_per_round": per_round,
        "rows": results,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
