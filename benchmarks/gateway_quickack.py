"""Warm ``call_tool`` through a real Jupyter Kernel Gateway on 127.0.0.1
(``tests/support/gateway.py``), with kernelexec re-arming ``TCP_QUICKACK`` on the websocket
(``GatewayBackend(quickack=True)``, the default) and without it: the figures of
docs/gateway.md's "Latency".

Jupyter Server never sets ``TCP_NODELAY`` on kernel websockets, so without the option each call
waits for the client's delayed ACK. The two variants take turns in rounds (one executor and
kernel each, started before the first round), so load on a shared machine hits them alike.
Prints the medians and writes JSON (default ``benchmarks/results/gateway_quickack.json``).

    python benchmarks/gateway_quickack.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import kernelexec as kx  # noqa: E402
from kernelexec.backends import GatewayBackend  # noqa: E402
from tests.support.gateway import Gateway  # noqa: E402

ADD = (
    'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n        b: B.\n'
    '    """\n    return a + b\n'
)


async def measure(gw: Gateway, rounds: int, calls: int) -> dict[str, list[float]]:
    tool = kx.Tool.from_source(ADD)
    samples: dict[str, list[float]] = {"quickack": [], "no quickack": []}
    async with AsyncExitStack() as stack:
        sessions = {}
        for name in samples:
            backend = GatewayBackend(gw.url, token=gw.token, quickack=name == "quickack")
            ex = await stack.enter_async_context(kx.AsyncKernelExecutor(backend=backend))
            sessions[name] = await ex.session(name.replace(" ", "-"))
            await sessions[name].call_tool(tool, {"a": 1, "b": 2})  # warm
        for _ in range(rounds):
            for name, session in sessions.items():
                for _ in range(calls):
                    t0 = time.perf_counter()
                    result = await session.call_tool(tool, {"a": 1, "b": 2})
                    samples[name].append(time.perf_counter() - t0)
                    assert result.func_return == 3, result.error
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="calls per variant and round")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks/results/gateway_quickack.json"
    )
    ns = parser.parse_args()
    with Gateway() as gw:
        samples = asyncio.run(measure(gw, ns.rounds, ns.calls))
    rows = {
        name: {
            "n": len(values),
            "median_ms": statistics.median(values) * 1000,
            "p90_ms": statistics.quantiles(values, n=10)[-1] * 1000,
        }
        for name, values in samples.items()
    }
    print("| warm call_tool through the gateway | n | median ms | p90 ms |")
    print("| --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['n']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} |")
    ns.out.write_text(
        json.dumps(
            {"machine": platform.platform(), "python": platform.python_version(), **rows},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
