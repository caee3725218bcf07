"""A host with many open descriptors: kernels whose descriptors are above 1,023 (where
``select()`` fails), and kernel starts that fail for want of descriptors, which must neither
break ``aclose()`` nor leave anything behind. Each runs in its own Python (own limits, own
temporary directory)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import kernels_matching

REPO = str(Path(__file__).resolve().parent.parent.parent)


def run(code: str, tmp: Path, *args: str) -> str:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def assert_nothing_left(tmp: Path) -> None:
    assert not [p for p in kernels_matching(str(tmp)) if p.is_running()]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(("kx-", "kernelexec-"))]


_HIGH = """
import asyncio, os, resource, sys
import kernelexec as kx

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the next ones are > 1023

async def main():
    async with kx.AsyncKernelExecutor(max_kernels=2, isolation=sys.argv[1]) as ex:
        s = await ex.session("high")
        assert (await s.run_code("x = 6 * 7")).ok
        print("answer", (await s.run_code("x")).result, flush=True)
    print("closed", flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("level", ["process", "none"])
def test_kernels_run_and_stop_with_descriptors_above_1023(level: str, tmp_path: Path) -> None:
    if sys.platform != "linux":
        pytest.skip("Linux only")
    out = run(_HIGH, tmp_path, level)
    assert "answer 42" in out and "closed" in out
    assert_nothing_left(tmp_path)


_STARVED = """
import asyncio, os, resource, sys
import kernelexec as kx

async def main():
    ex = kx.AsyncKernelExecutor(max_kernels=8, start_timeout=5)
    await ex.start()
    first = await ex.session("first")
    for tries in range(1, 7):
        # Unstarved, but on a loaded host: 5 s keeps the starved starts below short.
        try:
            assert (await first.run_code("x = 1")).ok
            break
        except kx.KernelStartError:
            if tries == 6:
                raise
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + int(sys.argv[1]), hard))
    for i in range(3):
        try:
            s = await ex.session(f"starved-{i}")
            await s.run_code("1")
            print("started", i, flush=True)
        except kx.KernelStartError as exc:
            # Only a start that says it ran out counts: a loaded host times starts out too.
            why = "descriptors" if "Too many open files" in str(exc) else "other"
            print("failed", i, why, repr(str(exc)[:300]), flush=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print("first", (await first.run_code("x")).result, flush=True)
    await ex.aclose()
    print("closed", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("spare", [4, 14])
def test_starts_that_run_out_of_descriptors_leave_close_working(spare: int, tmp_path: Path) -> None:
    out = run(_STARVED, tmp_path, str(spare))
    assert out.count("descriptors") >= 1, out  # at least one start really ran out
    assert "first 1" in out and out.rstrip().endswith("closed"), out
    assert_nothing_left(tmp_path)
