"""Branching a live session: fork, snapshot and restore of a kernel holding ``--gib`` GiB.

For each measure the baseline of the same run is what an agent does without branching:
a new session that rebuilds the same state (for a fork), and pickling the state in the kernel
and loading it back (for a snapshot and a restore).

Measured, at the default isolation (``"process"`` on a root host), best of ``--repeat``:

* one fork: ``session.fork()`` until the child has answered a call;
* the parent's pause: how long the kernel's main thread was inside the fork request (the
  kernel's own clock: flush, bind, ``fork()``);
* eight children: ``session.fork(8)`` until all eight have answered a call;
* an untouched child's own memory (USS) after its first call;
* ``snapshot()``, and ``restore()`` of that snapshot (until the next call has answered).

``--huge-pages`` starts the kernels with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc
backs large allocations with transparent huge pages, where the host allows it on request
(``madvise``)): a ``fork()`` then copies one page-table entry per 2 MiB instead of per 4 KiB.

Usage: ``.venv/bin/python benchmarks/branching.py [--gib 1] [--repeat 3] [--huge-pages]``;
prints a table and writes ``benchmarks/results/branching[-huge-pages].json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

import kernelexec as kx

STATE = "blob = bytearray(b'x') * {size}\nsmall = [str(i) for i in range({items})]\n"


async def timed(coro: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = await coro
    return time.perf_counter() - start, value


def uss_mib(session: kx.AsyncSession) -> float:
    conn = session.lease.connection
    assert conn is not None
    pid = conn.kernel_pid()
    assert pid is not None
    return float(psutil.Process(pid).memory_full_info().uss) / (1 << 20)


HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


async def measure(gib: float, env_vars: dict[str, str]) -> dict[str, float]:
    size = int(gib * (1 << 30))
    items = 1_000_000
    state = STATE.format(size=size, items=items)
    out: dict[str, float] = {}
    async with kx.AsyncKernelExecutor(max_kernels=12, default_timeout=300, env_vars=env_vars) as ex:
        parent = await ex.session("bench")
        rebuild, result = await timed(parent.run_code(state))
        assert result.error is None, result.error
        out["baseline_rebuild_state_s"] = rebuild

        # Baseline for a fork: a second session that rebuilds the same state.
        other = await ex.session("rebuilt")
        fresh, result = await timed(other.run_code(state + "print(len(blob))"))
        assert result.error is None, result.error
        out["baseline_new_session_s"] = fresh
        await other.aclose()

        one, (child,) = await timed(parent.fork())
        first, result = await timed(child.run_code("print(len(blob))"))
        assert result.stdout == f"{size}\n", result
        out["fork_one_s"] = one + first
        out["parent_paused_s"] = ex._sessions.brancher.last_pause_s
        out["child_uss_mib"] = uss_mib(child)
        await child.aclose()

        async def answered() -> list[Any]:
            children = await parent.fork(8)
            return list(await asyncio.gather(*(c.run_code("print(len(small))") for c in children)))

        eight, results = await timed(answered())
        assert all(r.stdout == f"{items}\n" for r in results)
        out["fork_eight_answered_s"] = eight
        for name, session in list(ex.sessions.items()):
            if name.startswith("bench~"):
                await session.aclose()

        snap_s, snap = await timed(parent.snapshot())
        out["snapshot_s"] = snap_s
        await parent.run_code("blob[0] = 0\ndel small")

        async def restore() -> Any:
            await parent.restore(snap)
            return await parent.run_code("print(blob[0], len(small))")

        restore_s, result = await timed(restore())
        assert result.stdout == f"120 {items}\n", result
        out["restore_s"] = restore_s
        await snap.aclose()

        # Baseline for snapshot/restore: pickle the state in the kernel, load it back.
        dump, result = await timed(
            parent.run_code("import pickle\nsaved = pickle.dumps((blob, small), protocol=5)")
        )
        assert result.error is None
        out["baseline_pickle_save_s"] = dump
        load, result = await timed(parent.run_code("blob, small = pickle.loads(saved)"))
        assert result.error is None
        out["baseline_pickle_load_s"] = load
    return out


ROWS = [
    ("one fork, child answered", "fork_one_s", "baseline_new_session_s", 0.030),
    ("parent paused by a fork", "parent_paused_s", None, 0.030),
    ("8 children, all answered", "fork_eight_answered_s", "baseline_new_session_s", 0.100),
    ("snapshot()", "snapshot_s", "baseline_pickle_save_s", 0.030),
    ("restore() + next call", "restore_s", "baseline_pickle_load_s", 0.030),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--huge-pages", action="store_true")
    args = parser.parse_args()
    env_vars = HUGE_PAGES if args.huge_pages else {}
    runs = [asyncio.run(measure(args.gib, env_vars)) for _ in range(args.repeat)]
    best = {key: min(run[key] for run in runs) for key in runs[0]}
    pages = "huge pages on request" if args.huge_pages else "default pages"
    print(
        f"state: {args.gib:g} GiB bytearray + 1,000,000 small strings; {pages}; "
        f"best of {args.repeat}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'measure':32} {'kernelexec':>11} {'baseline':>10} {'ratio':>7} {'goal':>7}")
    for label, key, base, goal in ROWS:
        value = best[key]
        base_value = best[base] if base else None
        ratio = f"{base_value / value:6.1f}x" if base_value else "      -"
        base_text = f"{base_value * 1000:8.0f}ms" if base_value else "         -"
        print(f"{label:32} {value * 1000:9.1f}ms {base_text} {ratio} {goal * 1000:5.0f}ms")
    print(f"{'untouched child USS':32} {best['child_uss_mib']:9.1f}MiB {'':>10} {'':>7}   5MiB")
    result = {
        "gib": args.gib,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "huge_pages": args.huge_pages,
        "load_average": os.getloadavg()[0],
        "best": best,
        "runs": runs,
    }
    name = "branching-huge-pages.json" if args.huge_pages else "branching.json"
    path = Path(__file__).parent / "results" / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
