"""What the bridging step costs a kernel at ``isolation="process"`` on a root host: the
launcher's ``bridge()`` (``kernelexec._sandbox._mounts.SOURCE``: a private mount namespace and
IPC namespace, a size-capped private ``/tmp``, and a read-only tmpfs over each blocked directory
with the needed paths bound back), timed in a fresh forked child each run: the figure of
docs/security.md ("The step itself takes about ...").

The bridges are planned as for a kernel of this interpreter: its prefixes and ``sys.path``
directories, and a kernel's own and working directory under a 0700 temporary root.
Prints the median and writes JSON (default ``benchmarks/results/unshare_cost.json``).

    python benchmarks/unshare_cost.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kernelexec._sandbox import _mounts, _users  # noqa: E402

_TIMED = r"""
import json, os, sys, time
bridges, scratch, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
took = []
for _ in range(runs):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t0 = time.perf_counter()
        bridge(bridges, scratch)
        os.write(w, repr(time.perf_counter() - t0).encode())
        os._exit(0)
    os.close(w)
    took.append(float(os.read(r, 64)))
    os.close(r)
    os.waitpid(pid, 0)
print(json.dumps(took))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/unshare_cost.json")
    ns = parser.parse_args()
    if not _users.is_root() or _mounts.support() is not None:
        sys.exit(f"bridging does not work here: {_mounts.support()}")
    root = tempfile.mkdtemp(prefix="kxunshare-")
    try:
        kernel_dir, workdir = Path(root, "kx-kernel"), Path(root, "sessions", "agent")
        kernel_dir.mkdir()
        workdir.mkdir(parents=True)
        os.chmod(root, 0o700)
        needed = {sys.prefix, sys.base_prefix, *(p for p in sys.path if os.path.isdir(p))}
        bridges = _mounts.plan([*needed, str(kernel_dir), str(workdir)], [str(workdir)])
        keep = [p for p in (str(kernel_dir), str(workdir)) if p.startswith("/tmp/")]
        scratch = {"size": 64 << 20, "keep": keep, "ipc": True}
        out = subprocess.run(
            [
                *(sys.executable, "-I", "-S", "-c", _mounts.SOURCE + _TIMED),
                *(json.dumps(bridges), json.dumps(scratch), str(ns.runs)),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    took = json.loads(out.stdout)
    row = {
        "n": len(took),
        "median_ms": statistics.median(took) * 1000,
        "p90_ms": statistics.quantiles(took, n=10)[-1] * 1000,
        "bridged": [top for top, _ in bridges],
    }
    print(f"bridge(): median {row['median_ms']:.2f} ms, p90 {row['p90_ms']:.2f} ms ({row['n']})")
    print(f"bridged: {', '.join(row['bridged'])}")
    ns.out.write_text(
        json.dumps(
            {"machine": platform.platform(), "python": platform.python_version(), **row}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
