"""A Letta-shaped tool call through ``kernelexec.compat.letta`` against a subprocess per call.

The baseline is ``bench.py``'s: a generated script, a fresh ``python`` per call, the result
pickled between stdout markers. The adapter rows construct an ``AsyncToolSandboxKernel`` per
call and await ``run()``, exactly as Letta's ``SandboxToolExecutor`` does with
``AsyncToolSandboxLocal``: a tool object, a user, the default sandbox config, sandbox
variables, and (second row) an agent state the tool edits. Rows are interleaved in rounds, in
one run, on this machine. Prints a table and writes JSON (default
``benchmarks/results/letta.json``).

    python benchmarks/letta.py            # 10 rounds (10-40 s)
    python benchmarks/letta.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import baseline_call, log, stats, timed
from pydantic import BaseModel, Field

import kernelexec as kx
from kernelexec.compat import letta

ADD = '''
def add(x: int, y: int) -> int:
    """Add two integers.

    Args:
        x: First.
        y: Second.
    """
    return x + y
'''

REMEMBER = '''
def remember(fact: str, agent_state: "AgentState") -> str:
    """Append a fact to the agent's memory.

    Args:
        fact: What to remember.
    """
    agent_state.memory.append(fact)
    return f"{len(agent_state.memory)} facts"
'''


class AgentState(BaseModel):
    id: str
    memory: list[str] = Field(default_factory=list)
    secrets: list[dict[str, str]] = Field(default_factory=list)


def letta_tool(source: str, name: str) -> SimpleNamespace:
    schema = kx.Tool.from_source(source, name=name).json_schema
    return SimpleNamespace(
        id=f"tool-{name}",
        name=name,
        source_code=source,
        json_schema=schema,
        args_json_schema=None,
        pip_requirements=None,
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    user = SimpleNamespace(id="user-1", organization_id="org-1")
    add, remember = letta_tool(ADD, "add"), letta_tool(REMEMBER, "remember")
    state = AgentState(id="agent-bench", secrets=[{"key": "API_TOKEN", "value": "t"}])
    env = {"SANDBOX_VAR": "1"}

    async def adapter_add() -> None:
        sandbox = letta.AsyncToolSandboxKernel(
            "add",
            {"x": 1, "y": 2},
            user,
            tool_id=add.id,
            agent_id=state.id,
            tool_object=add,
            sandbox_env_vars=env,
        )
        result = await sandbox.run()
        assert result.func_return == 3, result

    async def adapter_state() -> None:
        sandbox = letta.AsyncToolSandboxKernel(
            "remember",
            {"fact": "sky is blue"},
            user,
            tool_id=remember.id,
            agent_id=state.id,
            tool_object=remember,
            sandbox_env_vars=env,
        )
        result = await sandbox.run(agent_state=state)
        assert result.status == "success", result
        assert isinstance(result.agent_state, AgentState)

    with tempfile.TemporaryDirectory() as workdir:

        async def baseline() -> None:
            assert await baseline_call(ADD, "add", {"x": 1, "y": 2}, workdir) == 3

        rows: dict[str, list[float]] = {"baseline": [], "adapter": [], "adapter_state": []}
        calls = {"baseline": baseline, "adapter": adapter_add, "adapter_state": adapter_state}
        for fn in calls.values():  # warm up: the kernel starts, the tools are defined
            for _ in range(5):
                await fn()
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            for key, fn in calls.items():
                n = args.n_base if key == "baseline" else args.n
                rows[key] += await timed(n, fn)
    letta.shutdown()
    results = {key: stats(samples) for key, samples in rows.items()}
    results["meta"] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rounds": args.rounds,
    }
    return results


LABELS = {
    "baseline": "baseline: subprocess per call (bench.py's, pickle between markers)",
    "adapter": "AsyncToolSandboxKernel(...).run(), add(x, y)",
    "adapter_state": "AsyncToolSandboxKernel(...).run(agent_state=...), state edited",
}


def table(results: dict[str, Any]) -> str:
    base = results["baseline"]["median_ms"]
    lines = ["| scenario | median ms | p90 ms | p99 ms | vs baseline |", "|---|---|---|---|---|"]
    for key, label in LABELS.items():
        r = results[key]
        ratio = base / r["median_ms"]
        lines.append(
            f"| {label} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {ratio:.1f}x faster |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts (a smoke run)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "letta.json"))
    args = parser.parse_args()
    args.rounds, args.n, args.n_base = (2, 10, 3) if args.quick else (10, 100, 20)
    results = asyncio.run(main_async(args))
    print(table(results))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
