"""Many executors on one ``state_dir`` (issue 37): what moving an agent between processes costs,
and what several worker processes serve together.

Rows, each with its baseline measured in the same run:

- ``handoff``: a worker process holds agent ``h-i`` idle (its kernel alive, a small namespace);
  this process asks for it (``await ex.session(...)`` and a first ``run_code``) and times the
  first result: the holder's hibernation on request, the lease changing hands, the wake. The
  baseline, interleaved: this executor then hibernates the same agent and times its wake from
  the ``state_dir`` (a fresh kernel, the same restore). Both start with a prewarmed kernel at
  hand (``prewarm=1``, waited for). Goal: hand-off <= 2x the wake.
- ``workers``: 1, 2 (and ``--workers`` more) worker processes on one ``state_dir``, each with
  its own executor and ``--agents`` agents of its own, every agent calling ``run_code`` in a loop
  for ``--seconds``; the calls of all workers per second, and the ratio to one worker (the
  mean of the one-worker rows: ``--workers 1,2,1,2`` interleaves them against drifting load).

Usage: ``.venv/bin/python benchmarks/handoff.py [--rounds N] [--workers 1,2] [--agents 4]
[--seconds 10]``; writes ``benchmarks/results/handoff.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kernelexec as kx

RESULTS = Path(__file__).parent / "results" / "handoff.json"

# A worker: an executor on the state_dir, one JSON command per line on stdin.
_WORKER = """
import asyncio, json, sys, time, kernelexec as kx

def say(**answer):
    print(json.dumps(answer), flush=True)

async def loop(ex, agents, seconds):
    count = 0
    async def one(agent):
        nonlocal count
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            (await ex.run_code("n += 1", agent_id=agent)).raise_for_error()
            count += 1
    await asyncio.gather(*(one(a) for a in agents))
    return count

async def main():
    async with kx.AsyncKernelExecutor(state_dir=sys.argv[1], max_kernels=64) as ex:
        say(ready=True)
        # stdin is read in a thread: the executor's loop must stay free to serve hand-overs
        while line := await asyncio.to_thread(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "run":
                out = await ex.run_code(cmd["code"], agent_id=cmd["agent"])
                say(error=out.error.evalue if out.error else None)
            elif cmd["op"] == "loop":
                for a in cmd["agents"]:
                    (await ex.run_code("n = 0", agent_id=a)).raise_for_error()
                say(warm=True)
                await asyncio.to_thread(sys.stdin.readline)  # go
                say(calls=await loop(ex, cmd["agents"], cmd["seconds"]))

asyncio.run(main())
"""


class Worker:
    """A worker process (see ``_WORKER``)."""

    def __init__(self, state: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, state],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.next() == {"ready": True}

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} ended")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(120)
        self.proc.stdout.close()


def _ms(values: list[float], q: float = 0.5) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 1)


async def handoff_row(rounds: int) -> dict[str, object]:
    handoff: list[float] = []
    wake: list[float] = []
    with tempfile.TemporaryDirectory() as state:
        holder = await asyncio.to_thread(Worker, state)
        try:
            async with kx.AsyncKernelExecutor(state_dir=state, prewarm=1) as ex:
                await ex.run_code("1")  # this executor's pool is warm before the first round
                for i in range(rounds):
                    agent = f"h-{i}"
                    code = f"x = {i}\ndata = list(range(1000))"
                    holder.send(op="run", code=code, agent=agent)
                    assert (await asyncio.to_thread(holder.next))["error"] is None
                    await ex.warm_up()  # both timings start with a prewarmed kernel at hand
                    start = time.perf_counter()
                    session = await ex.session(agent)
                    out = await session.run_code("print(x, len(data))")
                    handoff.append(time.perf_counter() - start)
                    assert out.stdout == f"{i} 1000\n" and out.restored is not None, out
                    await session.hibernate()
                    await ex.warm_up()
                    start = time.perf_counter()
                    out = await session.run_code("print(x, len(data))")
                    wake.append(time.perf_counter() - start)
                    assert out.stdout == f"{i} 1000\n" and out.restored is not None, out
        finally:
            await asyncio.to_thread(holder.close)
    return {
        "rounds": rounds,
        "handoff_p50_ms": _ms(handoff),
        "handoff_p90_ms": _ms(handoff, 0.9),
        "baseline_wake_p50_ms": _ms(wake),
        "baseline_wake_p90_ms": _ms(wake, 0.9),
        "handoff_over_wake": round(statistics.median(handoff) / statistics.median(wake), 2),
        "goal": "handoff_over_wake <= 2",
    }


def workers_row(n: int, agents: int, seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as state:
        workers = [Worker(state) for _ in range(n)]
        try:
            for w, worker in enumerate(workers):
                names = [f"w{w}-a{a}" for a in range(agents)]
                worker.send(op="loop", agents=names, seconds=seconds)
            for worker in workers:
                assert worker.next() == {"warm": True}
            for worker in workers:
                assert worker.proc.stdin is not None
                worker.proc.stdin.write("go\n")
                worker.proc.stdin.flush()
            calls = [worker.next()["calls"] for worker in workers]
        finally:
            for worker in workers:
                worker.close()
    return {
        "workers": n,
        "agents_per_worker": agents,
        "seconds": seconds,
        "calls": sum(calls),
        "calls_per_s": round(sum(calls) / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "handoff": asyncio.run(handoff_row(args.rounds)),
    }
    print(json.dumps(results["handoff"]), flush=True)
    rows = []
    for n in (int(x) for x in args.workers.split(",")):
        rows.append(workers_row(n, args.agents, args.seconds))
        print(json.dumps(rows[-1]), flush=True)
    ones = [float(r["calls_per_s"]) for r in rows if r["workers"] == 1]  # type: ignore[arg-type]
    for row in rows:
        over = float(row["calls_per_s"]) / statistics.mean(ones)  # type: ignore[arg-type]
        row["over_one_worker"] = round(over, 2)
    results["workers"] = rows
    results["load_average_after"] = os.getloadavg()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
