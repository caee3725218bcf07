"""Many live sessions on one host: no descriptor ceiling (hundreds of kernels, a soft limit of
1,024 open files raised as needed, a clear error when the hard limit is too low), every
session keeping its own state, and nothing left after close."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from kernelexec._sandbox import _cgroups
from kernelexec.backends import _hostlimits
from kernelexec.backends._forkservers import enabled
from tests.conftest import fork_servers, kernel_children, kernels_matching, our_temp_dirs

REPO = str(Path(__file__).resolve().parent.parent)

MIB_PER_KERNEL = {"fork server": 30, "plain": 60}
"""Memory a live idle session needs here, with room (measured: about 20 and 45 MiB)."""


def cgroups_of(pid: int) -> list[str]:
    """The kernel cgroups the host process ``pid`` has now."""
    sup = _cgroups.support()
    bases = [h.base for h in sup.v1.values()] + ([sup.v2.base] if sup.v2 else [])
    found = []
    for base in bases:
        try:
            found += [e.name for e in base.iterdir() if e.name.startswith(f"kx-{pid}-")]
        except OSError:
            continue
    return found


def skip_unless_memory_for(n: int) -> None:
    """Skip when this machine cannot hold ``n`` idle kernels of the kind this run starts."""
    kind = "fork server" if enabled(True) else "plain"
    need = n * MIB_PER_KERNEL[kind] * 2**20
    free = psutil.virtual_memory().available
    if free < need:
        pytest.skip(f"{n} {kind} kernels need about {need >> 30} GiB, {free >> 30} GiB free")


async def fill_and_ask(ex: kx.AsyncKernelExecutor, n: int) -> list[str | None]:
    """Open ``n`` sessions, give each its own value, then ask all of them at once."""
    sessions = []
    for i in range(n):
        s = await ex.session(f"agent-{i}")
        r = await s.run_code(f"mine = {i} * 7")
        assert r.ok, r.error
        sessions.append(s)
    answers = await asyncio.gather(*(s.run_code("mine") for s in sessions))
    return [a.result for a in answers]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_executor_holds_400_live_sessions_and_leaves_nothing() -> None:
    skip_unless_memory_for(400)
    before, before_servers, before_dirs = kernel_children(), fork_servers(), our_temp_dirs()

    async def main() -> None:
        async with kx.AsyncKernelExecutor(max_kernels=400, start_timeout=300) as ex:
            answers = await fill_and_ask(ex, 400)
            assert answers == [str(i * 7) for i in range(400)]
            assert ex.kernel_count == 400
            assert len(kernel_children() - before) == 400

    asyncio.run(main())
    assert not kernel_children() - before
    assert not fork_servers() - before_servers
    assert not our_temp_dirs() - before_dirs
    assert not cgroups_of(os.getpid())


_CHILD = """
import asyncio, logging, os, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
import kernelexec as kx

N = int(sys.argv[1])

async def main():
    async with kx.AsyncKernelExecutor(max_kernels=N, start_timeout=300) as ex:
        print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
        sessions = []
        for i in range(N):
            s = await ex.session(f"agent-{i}")
            assert (await s.run_code(f"mine = {i} * 7")).ok
            sessions.append(s)
        answers = await asyncio.gather(*(s.run_code("mine") for s in sessions))
        wrong = [i for i, a in enumerate(answers) if a.result != str(i * 7)]
        print("wrong", len(wrong), "fds", len(os.listdir("/proc/self/fd")), flush=True)

asyncio.run(main())
print("closed", flush=True)
"""


def run_limited(code: str, args: list[str], soft: int, hard: int | None, tmp: Path) -> str:
    """Run ``code`` in a Python whose RLIMIT_NOFILE is ``soft`` (and ``hard``, when given),
    with its own temporary directory; its stdout, then its stderr."""

    def limit() -> None:
        _, old_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard if hard is not None else old_hard))

    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
        timeout=800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_200_sessions_in_a_process_with_a_soft_limit_of_1024_files(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    needed = _hostlimits.fds_needed(200)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard limit here ({hard}) is below the {needed} 200 kernels need")
    skip_unless_memory_for(200)
    out = run_limited(_CHILD, ["200"], 1024, None, tmp_path)
    assert f"soft {needed}" in out
    assert (
        f"raised this process's soft RLIMIT_NOFILE from 1024 to {needed} for max_kernels=200"
    ) in out
    assert "wrong 0 fds" in out and "closed" in out
    fds = int(out.split("wrong 0 fds ", 1)[1].split()[0])
    assert fds > 1024  # the kernels really needed more than the old soft limit
    assert not [p for p in kernels_matching(str(tmp_path)) if p.is_running()]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("kx-", "kernelexec-"))]


_MAKE = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
import kernelexec as kx
try:
    kx.AsyncKernelExecutor(max_kernels=int(sys.argv[1]))
except kx.HostLimitError as exc:
    assert isinstance(exc, kx.ConfigError) and isinstance(exc, ValueError)
    print("HostLimitError:", exc)
else:
    print("made; soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_a_hard_limit_too_low_for_max_kernels_is_a_clear_error(tmp_path: Path) -> None:
    out = run_limited(_MAKE, ["100"], 512, 512, tmp_path)
    assert "HostLimitError: max_kernels=100 needs about 1256 open files" in out
    assert "hard limit (RLIMIT_NOFILE) is 512: use max_kernels=25 or less" in out
    # What the hard limit allows is made, the soft limit left where it was.
    assert "made; soft 512" in run_limited(_MAKE, ["25"], 512, 512, tmp_path)


def test_the_soft_limit_is_raised_only_as_far_as_max_kernels_needs(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 5256:
        pytest.skip(f"the hard limit here ({hard}) is too low")
    out = run_limited(_MAKE, ["500"], 1024, None, tmp_path)
    assert "raised this process's soft RLIMIT_NOFILE from 1024 to 5256 for max_kernels=500" in out
    assert "made; soft 5256" in out
    assert "made; soft 1024" in run_limited(_MAKE, ["70"], 1024, None, tmp_path)
