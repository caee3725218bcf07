"""``session.commands``: background shell commands in a real kernel at every isolation level,
running while the session's other calls go on, and never outliving their kernel."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest

import kernelexec as kx
from tests.conftest import kernel_children, our_temp_dirs, wait_exited

LEVELS = [
    "none",
    "process",
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="no bubblewrap"),
    ),
]


@pytest.fixture(scope="module", params=LEVELS)
def executor(request: pytest.FixtureRequest) -> Iterator[kx.KernelExecutor]:
    """One executor per isolation level for this module (checked for leaks when it closes)."""
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(isolation=request.param, default_timeout=30) as ex:
        yield ex
    assert not kernel_children() - before, "the executor left kernels running"
    assert not our_temp_dirs() - before_dirs, "the executor left temp dirs"


def test_a_command_runs_to_its_end(executor: kx.KernelExecutor) -> None:
    s = executor.session("run")
    s.files.write("in.txt", "from the host")
    result = s.commands.run(
        "cat in.txt; echo; echo oops >&2; python -c 'import sys; print(sys.executable)'; exit 3"
    )
    kernel_python = s.run_code("import sys; print(sys.executable)").stdout
    assert result.exit_code == 3 and not result.timed_out
    assert result.stdout == "from the host\n" + kernel_python
    assert result.stderr == "oops\n"
    listed = s.commands.run(["ls", "-a"], env={"KX_X": "1"})
    assert listed.stdout.split() == [".", "..", "in.txt"]
    assert s.commands.run("echo $KX_X", env={"KX_X": "seen"}).stdout == "seen\n"
    missing = s.commands.run(["no-such-program-kx"])
    assert missing.exit_code == 127 and "not found" in missing.stderr


def test_output_larger_than_a_pipe_arrives_whole(executor: kx.KernelExecutor) -> None:
    s = executor.session("big-output")
    code = "import sys; sys.stdout.write('x' * 20_000_000); sys.stderr.write('y' * 70_000)"
    # Past the kernel's 16 MiB buffer; the host keeps it all when asked to (default 16 MiB).
    result = s.commands.run(["python", "-c", code], max_output=32 << 20)
    assert result.exit_code == 0 and not result.truncated
    assert len(result.stdout) == 20_000_000 and set(result.stdout) == {"x"}
    assert result.stderr == "y" * 70_000


def test_other_calls_run_while_a_command_does(executor: kx.KernelExecutor) -> None:
    """The command waits for a file that only the session's own later calls create: it can
    end only if those calls ran while it was running (no timer involved)."""
    s = executor.session("background")
    proc = s.commands.start("while [ ! -e go ]; do sleep 0.01; done; cat go")
    assert proc.poll() is None and proc.running
    assert s.run_code("x = 6 * 7; x").result == "42"
    s.files.write("go", "released by a file write\n")
    assert s.files.read("go") == b"released by a file write\n"
    assert proc.wait(timeout=20) == 0
    assert proc.stdout == b"released by a file write\n"


def test_kill_and_timeout_end_the_whole_process_group(executor: kx.KernelExecutor) -> None:
    s = executor.session("kill")
    proc = s.commands.start("sleep 1000 & echo $!; echo $$; exec sleep 1000")
    while proc.stdout.count(b"\n") < 2:
        proc.poll(wait=0.2)
    pids = [int(p) for p in proc.stdout.split()]
    proc.kill()
    assert proc.wait(timeout=20) == -9
    # Both sleeps (pids in the kernel's namespace) end: waited for in the kernel by pidfd.
    gone = s.run_code(
        "import os, select\n"
        "def ended(pid):\n"
        "    try:\n"
        "        fd = os.pidfd_open(pid)\n"
        "    except ProcessLookupError:\n"
        "        return True\n"
        "    return bool(select.select([fd], [], [], 15)[0])\n"
        f"print([ended(p) for p in {pids!r}])"
    )
    assert gone.stdout == "[True, True]\n", gone.error
    timed = s.commands.run(["sleep", "1000"], timeout=0.2)
    assert timed.timed_out and timed.exit_code == -9


def test_a_command_never_outlives_its_kernel() -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        s = ex.session("outlive")
        proc = s.commands.start(["sh", "-c", "echo $$; exec sleep 1000"])
        while not proc.stdout:
            proc.poll(wait=0.2)
        sleeper = int(proc.stdout)
        s.restart()
        assert wait_exited(sleeper), "the command outlived its kernel"
        with pytest.raises(kx.FileTransferError, match="replaced"):
            proc.poll()


@pytest.mark.anyio
async def test_cancelling_run_kills_the_command() -> None:
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        s = await ex.session("cancel")
        task = asyncio.ensure_future(s.commands.run("echo $$ > pid; exec sleep 1000"))
        written = b""
        while not written.strip():  # each check is a kernel call, between the run's polls
            if await s.files.exists("pid"):
                written = await s.files.read("pid")
        pid = int(written)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wait_exited(pid)
