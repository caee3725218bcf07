"""How long an MCP client waits for ``kernelexec mcp`` over stdio: process start to the
``initialize`` answer, and from there to the first ``run_python`` result, through the MCP SDK's
own client.

The baseline is the same measurement on another source tree of kernelexec (``--baseline DIR``,
for instance ``git archive`` of the commit before a change), run from the same venv; the rows are
interleaved in rounds so that load on a shared machine hits them alike. Prints a table and writes
JSON (default ``benchmarks/results/mcp_initialize.json``).

    python benchmarks/mcp_initialize.py [--baseline DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

HERE = Path(__file__).resolve().parent.parent


async def one_start(tree: Path, errlog: TextIO) -> tuple[float, float]:
    """Seconds to the ``initialize`` answer and then to the first result, for ``tree``."""
    with tempfile.TemporaryDirectory(prefix="kxmcpinit-") as tmp:
        env = {"PATH": os.environ["PATH"], "HOME": tmp, "TMPDIR": tmp}
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "kernelexec", "mcp"], env=env, cwd=str(tree)
        )
        started = time.perf_counter()
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            initialized = time.perf_counter()
            result = await session.call_tool("run_python", {"code": "1 + 1"})
            first = time.perf_counter()
            assert result.structured_content and result.structured_content["result"] == "2"
    return initialized - started, first - initialized


async def measure(
    trees: dict[str, Path], rounds: int, errlog: TextIO
) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {
        name: {"initialize": [], "first_call": []} for name in trees
    }
    for _ in range(rounds):
        for name, tree in trees.items():
            init, first = await one_start(tree, errlog)
            samples[name]["initialize"].append(init)
            samples[name]["first_call"].append(first)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=None, help="another kernelexec tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks/results/mcp_initialize.json")
    ns = parser.parse_args()
    trees = {"this tree": HERE}
    if ns.baseline is not None:
        trees = {"baseline": ns.baseline.resolve(), **trees}
    with open(os.devnull, "w") as errlog:
        samples = anyio.run(measure, trees, ns.rounds, errlog)
    rows = {
        name: {what: statistics.median(values) for what, values in parts.items()}
        for name, parts in samples.items()
    }
    print(f"{'tree':<12} {'initialize s (median)':>22} {'then first call s':>18}")
    for name, row in rows.items():
        print(f"{name:<12} {row['initialize']:>22.2f} {row['first_call']:>18.2f}")
    if "baseline" in rows:
        ratio = rows["baseline"]["initialize"] / rows["this tree"]["initialize"]
        print(f"initialize: {ratio:.1f}x faster than the baseline")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "load_average": os.getloadavg(),
                "rounds": ns.rounds,
                "samples_s": samples,
                "medians_s": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
