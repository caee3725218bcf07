"""A first result with JupyterLab in the environment (issue 36, item 3): the time from
``import kernelexec`` to a first ``run_code`` result, in fresh venvs holding only the named
extras, with and without ``[debugger]`` (which brings JupyterLab), for each git revision given.

Each revision is exported (``git archive``) and installed as a user would (``pip install
'SRC[extras]'``, no development extras) into a venv under ``.cache/first-result/``, built once
and reused. Each run is a fresh interpreter: ``import kernelexec``, a ``KernelExecutor`` at its
defaults, ``run_code("1 + 1")``; the time is taken when the result is back (closing is not
counted). The runs interleave the venvs, round by round.

Usage: ``.venv/bin/python benchmarks/first_result.py [--revs 146886e main] [--runs 3]``; prints
a table and writes ``benchmarks/results/first_result.json`` with the load average at the start
and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "first-result"
OUT = ROOT / "benchmarks" / "results" / "first_result.json"

_PROBE = """
import time
t0 = time.perf_counter()
import kernelexec as kx
t1 = time.perf_counter()
ex = kx.KernelExecutor()
result = ex.run_code("1 + 1")
t2 = time.perf_counter()
assert result.result == "2", result
ex.close()
print(t1 - t0, t2 - t0)
"""


def _sha(rev: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short=10", rev], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip


def _venv(rev: str, extras: str) -> Path:
    """The python of a venv holding revision ``rev`` of the package with ``extras``."""
    sha = _sha(rev)
    home = CACHE / f"{sha}-{extras or 'base'}"
    python = home / "bin" / "python"
    if (home / ".complete").exists():
        return python
    subprocess.run(["rm", "-rf", str(home)], check=True)
    with tempfile.TemporaryDirectory() as src:
        archive = subprocess.run(
            ["git", "archive", sha], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
        spec = f"{src}[{extras}]" if extras else src
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", spec], capture_output=True, text=True
        )
        if pip.returncode:
            sys.exit(f"pip install {spec}:\n{pip.stderr}")
    (home / ".complete").touch()
    return python


def _run(python: Path) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(
            [str(python), "-c", _PROBE], cwd=cwd, capture_output=True, text=True, check=True,
            timeout=120,
        ).stdout.split()  # fmt: skip
    return float(out[-2]), float(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revs", nargs="+", default=["146886e", "main"])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    load_start = os.getloadavg()
    cases = [(rev, extras) for rev in args.revs for extras in ("", "debugger")]
    pythons = {case: _venv(*case) for case in cases}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {case: [] for case in cases}
    for _ in range(args.runs):
        for case in cases:
            times[case].append(_run(pythons[case]))
    load_end = os.getloadavg()
    rows = []
    for (rev, extras), runs in times.items():
        firsts = [first for _, first in runs]
        rows.append(
            {
                "rev": f"{rev} ({_sha(rev)})" if _sha(rev) != rev else rev,
                "extras": extras or "(none)",
                "import_s": [round(i, 3) for i, _ in runs],
                "first_result_s": [round(f, 3) for f in firsts],
                "median_first_result_s": round(statistics.median(firsts), 3),
            }
        )
    print(f"load average at start {load_start}, at end {load_end}")
    print("| revision | extras | import (s) | import to first result (s), runs | median |")
    print("|---|---|---|---|---|")
    for row in rows:
        imports = ", ".join(f"{t:.2f}" for t in row["import_s"])
        firsts = ", ".join(f"{t:.2f}" for t in row["first_result_s"])
        print(
            f"| {row['rev']} | {row['extras']} | {imports} | {firsts} "
            f"| {row['median_first_result_s']:.2f} |"
        )
    OUT.write_text(
        json.dumps(
            {
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "load_average_start": load_start,
                "load_average_end": load_end,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
