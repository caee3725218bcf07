"""What keeping tenants apart costs a kernel start (issue 22), measured against doing nothing
in the same run, the variants taking turns:

* the launcher's private scratch (a size-capped tmpfs over ``/tmp`` with ``/var/tmp`` and
  ``/dev/shm`` bound from it, and an IPC namespace) and its seccomp filter (no user namespaces),
  each timed in a forked child with ``ctypes`` loaded, as the launcher has it;
* handing out and releasing a kernel's uid through the machine-wide record
  (``/var/lib/kernelexec``, file-locked), against deriving it from an inode as before.

Needs root (the uid record and the mounts). Usage: ``.venv/bin/python benchmarks/tenants.py
[--rounds N]``; prints a table and writes ``benchmarks/results/tenants.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kernelexec._sandbox import _mounts, _seccomp, _uids

RESULTS = Path(__file__).parent / "results" / "tenants.json"
_SOURCE: dict[str, object] = {}
exec(_mounts.SOURCE + _seccomp.SOURCE, _SOURCE)


def in_child(step: Callable[[], object]) -> float:
    """Milliseconds ``step`` takes in a forked child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None, use_errno=True).getpid()
        start = time.perf_counter()
        step()
        os.write(write, str(time.perf_counter() - start).encode())
        os._exit(0)
    os.close(write)
    took = float(os.read(read, 64) or b"nan")
    os.close(read)
    os.waitpid(pid, 0)
    return took * 1000


def scratch() -> None:
    bridge = _SOURCE["bridge"]
    assert callable(bridge)
    bridge([], {"size": 64 << 20, "keep": [], "ipc": True})


def seccomp() -> None:
    drop = _SOURCE["drop_userns"]
    assert callable(drop)
    drop()


def uid_record() -> float:
    start = time.perf_counter()
    uid = _uids.allocate()
    _uids.release(uid, False)
    return (time.perf_counter() - start) * 1000


def uid_inode(directory: str) -> float:
    start = time.perf_counter()
    _ = 2_000_000_000 + os.stat(directory).st_ino % 100_000_000
    return (time.perf_counter() - start) * 1000


def main(rounds: int) -> list[dict[str, object]]:
    times: dict[str, list[float]] = {
        k: [] for k in ("nothing", "scratch", "seccomp", "uid inode", "uid record")
    }
    here = tempfile.mkdtemp(prefix="kxbench-")
    try:
        for _ in range(rounds):
            times["nothing"].append(in_child(lambda: None))
            times["scratch"].append(in_child(scratch))
            times["seccomp"].append(in_child(seccomp))
            times["uid inode"].append(uid_inode(here))
            times["uid record"].append(uid_record())
    finally:
        os.rmdir(here)
    rows: list[dict[str, object]] = []
    for name, baseline in (
        ("scratch", "nothing"),
        ("seccomp", "nothing"),
        ("uid record", "uid inode"),
    ):
        value, base = statistics.median(times[name]), statistics.median(times[baseline])
        rows.append(
            {
                "step": name,
                "median_ms": round(value, 3),
                "max_ms": round(max(times[name]), 3),
                "baseline": baseline,
                "baseline_median_ms": round(base, 4),
                "added_ms": round(value - base, 3),
            }
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    ns = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks/tenants.py needs root (the uid record, the mounts)")
    found = main(ns.rounds)
    print(f"{'step':<12} {'median ms':>10} {'max ms':>8}  baseline (median ms)     added ms")
    for row in found:
        print(
            f"{row['step']:<12} {row['median_ms']:>10} {row['max_ms']:>8}  "
            f"{row['baseline']} ({row['baseline_median_ms']})".ljust(62)
            + f"{row['added_ms']}"
        )
    load = os.getloadavg()[0]
    RESULTS.write_text(
        json.dumps({"rounds": ns.rounds, "load_average": load, "rows": found}, indent=2) + "\n"
    )
