"""Per-step overhead of the framework adapters (issue 27), each against the framework's own
local executor, measured in the same run, taking turns in rounds:

* smolagents: one step's code (``x = x + 1``) through ``KernelPythonExecutor`` vs smolagents'
  ``LocalPythonExecutor`` (its AST interpreter, in the host process);
* pydantic-ai: one command (``true``) through ``KernelWorkspace.run`` vs pydantic-ai's
  ``LocalWorkspaceBackend`` (a host subprocess); and a ``python`` tool step (no local twin);
* deepagents: ``execute("true")`` through ``KernelSandbox`` vs deepagents' ``LocalShellBackend``
  (a host subprocess);
* openai-agents: ``session.exec("true")`` through ``KernelSandboxClient`` vs the SDK's
  ``UnixLocalSandboxClient`` (a host subprocess).

Kernels are warm (started before timing) at ``isolation="none"``, like the host baselines.
Medians in milliseconds; the ratio is adapter / baseline.

Usage: ``.venv/bin/python benchmarks/adapters.py [--steps N] [--rounds R]``; writes
``benchmarks/results/adapters.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient
from deepagents.backends import LocalShellBackend
from pydantic_ai.workspaces import LocalWorkspaceBackend
from rich.console import Console
from smolagents.local_python_executor import LocalPythonExecutor
from smolagents.monitoring import AgentLogger, LogLevel

import kernelexec as kx
from kernelexec.compat.deepagents import KernelSandbox
from kernelexec.compat.openai_agents import KernelSandboxClient
from kernelexec.compat.pydantic_ai import KernelWorkspace
from kernelexec.compat.smolagents import KernelPythonExecutor

RESULTS = Path(__file__).parent / "results" / "adapters.json"


def timed(step: Callable[[], object], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return times


async def atimed(step: Callable[[], Awaitable[object]], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await step()
        times.append((time.perf_counter() - start) * 1000)
    return times


def row(name: str, ours: list[float], base: list[float] | None, baseline: str) -> dict[str, object]:
    o = statistics.median(ours)
    b = statistics.median(base) if base else None
    return {
        "adapter": name,
        "adapter_ms": round(o, 2),
        "baseline": baseline,
        "baseline_ms": None if b is None else round(b, 2),
        "ratio": None if b is None else round(o / b, 1),
        "steps": len(ours),
    }


def smolagents_rows(ex: kx.KernelExecutor, steps: int, rounds: int) -> list[dict[str, object]]:
    logger = AgentLogger(LogLevel.ERROR, Console(file=io.StringIO()))
    ours = KernelPythonExecutor([], logger, agent_id="bench-smol", executor=ex)
    local = LocalPythonExecutor([])
    local.send_tools({})
    ours.send_variables({"x": 0})
    local.send_variables({"x": 0})
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        a += timed(lambda: ours("x = x + 1"), steps)
        b += timed(lambda: local("x = x + 1"), steps)
    ours.cleanup()
    return [row("smolagents KernelPythonExecutor", a, b, "LocalPythonExecutor (AST, in-process)")]


async def pydantic_rows(
    ex: kx.AsyncKernelExecutor, steps: int, rounds: int
) -> list[dict[str, object]]:
    ours = KernelWorkspace(agent_id="bench-pai", executor=ex)
    with tempfile.TemporaryDirectory() as tmp:
        local = LocalWorkspaceBackend(tmp)
        await ours.run(["true"])
        await ours.run_python("x = 0")
        a: list[float] = []
        b: list[float] = []
        p: list[float] = []
        for _ in range(rounds):
            a += await atimed(lambda: ours.run(["true"]), steps)
            b += await atimed(lambda: local.run(["true"]), steps)
            p += await atimed(lambda: ours.run_python("x = x + 1"), steps)
    await ours.aclose()
    return [
        row("pydantic-ai KernelWorkspace.run", a, b, "LocalWorkspaceBackend.run (host subprocess)"),
        row("pydantic-ai python tool (run_python)", p, None, "none (no local Python backend)"),
    ]


def deepagents_rows(ex: kx.KernelExecutor, steps: int, rounds: int) -> list[dict[str, object]]:
    ours = KernelSandbox(agent_id="bench-da", executor=ex)
    with tempfile.TemporaryDirectory() as tmp:
        local = LocalShellBackend(root_dir=tmp)
        ours.execute("true")
        a: list[float] = []
        b: list[float] = []
        for _ in range(rounds):
            a += timed(lambda: ours.execute("true"), steps)
            b += timed(lambda: local.execute("true"), steps)
    ours.close()
    return [
        row("deepagents KernelSandbox.execute", a, b, "LocalShellBackend.execute (host subprocess)")
    ]


async def openai_rows(
    ex: kx.AsyncKernelExecutor, steps: int, rounds: int
) -> list[dict[str, object]]:
    ours_client = KernelSandboxClient(executor=ex)
    local_client = UnixLocalSandboxClient()
    ours = await ours_client.create()
    local = await local_client.create(options=None)
    a: list[float] = []
    b: list[float] = []
    async with ours, local:
        await ours.exec("true")
        await local.exec("true")
        for _ in range(rounds):
            a += await atimed(lambda: ours.exec("true"), steps)
            b += await atimed(lambda: local.exec("true"), steps)
    await local_client.delete(local)
    await ours_client.aclose()
    return [
        row(
            "openai-agents KernelSandboxClient exec",
            a,
            b,
            "UnixLocalSandboxClient exec (host subprocess)",
        )
    ]


async def async_rows(steps: int, rounds: int) -> list[dict[str, object]]:
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        return [*await pydantic_rows(ex, steps, rounds), *await openai_rows(ex, steps, rounds)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    with kx.KernelExecutor(isolation="none") as ex:
        rows += smolagents_rows(ex, args.steps, args.rounds)
        rows += deepagents_rows(ex, args.steps, args.rounds)
    rows += asyncio.run(async_rows(args.steps, args.rounds))
    print(f"{'adapter':42} {'ms':>8}  {'baseline':46} {'ms':>8} {'ratio':>6}")
    for r in rows:
        base = "-" if r["baseline_ms"] is None else f"{r['baseline_ms']:8.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:6.1f}"
        print(f"{r['adapter']:42} {r['adapter_ms']:8.2f}  {r['baseline']:46} {base:>8} {ratio:>6}")
    RESULTS.parent.mkdir(exist_ok=True)
    load = os.getloadavg()[0]
    RESULTS.write_text(json.dumps({"load_average": round(load, 1), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
