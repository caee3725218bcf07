"""Hostile: a kernel that runs into its limits. Each case asserts the exact outcome and that the
session works on the next call."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
from collections.abc import Iterator

import pytest

import kernelexec as kx
from tests.conftest import kernel_children, our_temp_dirs
from tests.hostile.conftest import gone, needs_bwrap, needs_cgroup

LIMITS = kx.Limits(memory_mb=256, max_processes=64, max_file_mb=10, max_open_files=256)
pytestmark = pytest.mark.usefixtures("executor")


@pytest.fixture(scope="module")
def executor() -> Iterator[kx.KernelExecutor]:
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(isolation="process", limits=LIMITS, default_timeout=60) as ex:
        yield ex
    assert not kernel_children() - before
    assert not our_temp_dirs() - before_dirs


@needs_cgroup("memory_mb")
@pytest.mark.parametrize(
    "bomb",
    [
        "data = b'x' * (2 * 1024**3)",  # one 2 GB allocation, every page touched
        "chunks = []\nwhile True:\n    chunks.append(b'x' * 10**7)",  # the runaway loop
    ],
    ids=["2GB", "append-loop"],
)
def test_memory_bomb_kills_only_that_kernel(executor: kx.KernelExecutor, bomb: str) -> None:
    victim = executor.session(f"mem-{len(bomb)}")
    neighbour = executor.session(f"mem-neighbour-{len(bomb)}")
    neighbour.run_code("kept = 'still here'")
    victim.run_code("before = 1")
    result = victim.run_code(bomb)
    assert result.error is not None
    assert result.error.kind == "limit_exceeded"
    assert "memory_mb=256" in result.error.evalue
    assert result.kernel_restarted and result.lost_variables == ["before"]
    after = victim.run_code("1 + 1")
    assert after.ok and after.result == "2"
    assert neighbour.run_code("kept").result == "'still here'"


@needs_cgroup("max_processes")
def test_fork_storm_is_capped_and_reaped(executor: kx.KernelExecutor) -> None:
    s = executor.session("forks")
    result = s.run_code(
        "import subprocess\n"
        "pids, failure = [], None\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pids.append(subprocess.Popen(['sleep', '600']).pid)\n"
        "    except OSError as exc:\n"
        "        failure = type(exc).__name__\n"
        "        break\n"
        "(len(pids), failure, pids)"
    )
    assert result.ok, result.error
    started, failure, pids = eval(result.result or "")
    assert failure == "BlockingIOError"  # EAGAIN from pids.max, not a host-wide limit
    assert 0 < started < 64
    # The kernel still answers, and shutting it down leaves none of them.
    assert s.run_code("'alive'").result == "'alive'"
    s.restart()
    assert gone(pids) == []


@needs_cgroup("max_processes")
def test_fork_bomb_with_os_fork(executor: kx.KernelExecutor) -> None:
    s = executor.session("forkbomb")
    result = s.run_code(
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while n < 10000:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(600)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        "n < 64"
    )
    assert result.ok and result.result == "True"
    assert result.stdout.strip() == "BlockingIOError"
    assert s.run_code("2 * 21").result == "42"


def test_disk_fill_past_max_file_mb(executor: kx.KernelExecutor) -> None:
    s = executor.session("disk")
    result = s.run_code("open('big', 'wb').write(b'x' * 20 * 1024 * 1024)")
    assert result.error is not None and result.error.kind == "exception"
    assert result.error.ename == "OSError" and "File too large" in result.error.evalue
    size = s.run_code("import os; os.path.getsize('big')").result
    assert size == str(10 * 1024 * 1024)
    assert s.run_code("'next'").result == "'next'"


def test_open_files_capped(executor: kx.KernelExecutor) -> None:
    s = executor.session("fds")
    result = s.run_code(
        "import resource; resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "fhs = []\n"
        "try:\n"
        "    while True:\n"
        "        fhs.append(open('/dev/null'))\n"
        "except OSError as exc:\n"
        "    err = exc.errno\n"
        "[fh.close() for fh in fhs]\n"
        "(len(fhs) < 256, err)"
    )
    assert result.ok and result.result == "(True, 24)"  # EMFILE
    assert s.run_code("'ok'").result == "'ok'"


@needs_cgroup("cpus")
@pytest.mark.anyio
async def test_cpu_spin_beside_a_session_that_stays_responsive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "kernelexec.kernel")
    async with kx.AsyncKernelExecutor(limits=kx.Limits(cpus=0.5)) as ex:
        spinner, other = await ex.session("spin"), await ex.session("other")
        await asyncio.gather(spinner.run_code("x = 1"), other.run_code("y = 1"))
        spin = asyncio.ensure_future(spinner.run_code("while True: pass", timeout=30))
        # 20 calls complete on the neighbour while the spinner is still running.
        for i in range(20):
            assert (await other.run_code(f"y + {i}")).result == str(1 + i)
        assert not spin.done()
        await spinner.interrupt()
        # Seen lost twice in double runs (issue 42), cause not found: what the kernel's threads do
        # with SIGINT then is kept for the failure's message (the deadline stops the spin).
        done, _ = await asyncio.wait({spin}, timeout=25)
        seen = "" if done else _signal_state(spinner)
        result = await spin
        assert result.error is not None and result.error.ename == "KeyboardInterrupt", (
            f"{result.error}\n{seen}\n{caplog.text}"
        )
        assert (await spinner.run_code("x")).result == "1"  # interrupted, state kept


def _signal_state(session: kx.AsyncSession) -> str:
    """The host's view of the run, and the signal masks of each thread of the session's kernel
    (from ``/proc``)."""
    conn = session._lease.connection
    pid = conn.kernel_pid() if conn is not None else None
    run = session._runs._current
    lines = [
        f"kernel pid {pid}; the run: "
        + (
            "none"
            if run is None
            else f"started={run.started} executing={run.executing} held={run.interrupt_waits}"
        )
    ]
    for status in sorted(glob.glob(f"/proc/{pid}/task/*/status")):
        with contextlib.suppress(OSError), open(status) as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
            shown = ("Name", "State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
            lines.append(" ".join(f"{k}={fields[k].strip()}" for k in shown if k in fields))
    return "\n".join(lines)


@needs_bwrap
@needs_cgroup("memory_mb")
def test_memory_limit_under_bwrap() -> None:
    with kx.KernelExecutor(isolation="bwrap", limits=kx.Limits(memory_mb=256)) as ex:
        s = ex.session("bwrap-mem")
        result = s.run_code("data = b'x' * (2 * 1024**3)")
        assert result.error is not None and result.error.kind == "limit_exceeded"
        assert "memory_mb=256" in result.error.evalue
        assert s.run_code("'back'").result == "'back'"
