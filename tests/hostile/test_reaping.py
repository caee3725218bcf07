"""Hostile: a kernel leaves processes behind (double forks, ``setsid`` daemons) or kills its own
parent; after a restart, a shutdown or the host's death, none of them is alive."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable

import psutil
import pytest

import kernelexec as kx
from kernelexec._sandbox import _cgroups
from kernelexec._tempdirs import sweep_stale
from tests.hostile.conftest import gone, host_groups, needs_bwrap

SPAWN = (
    "import os, subprocess, time\n"
    "daemon = subprocess.Popen(['sleep', {daemon!r}], start_new_session=True).pid\n"
    "r, w = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        os.write(w, str(os.getpid()).encode())\n"
    "        os.execvp('sleep', ['sleep', {double!r}])\n"
    "    os._exit(0)\n"
    "os.close(w)\n"
    "out = b''\n"
    # EOF once the grandchild is in its exec of sleep: its end of the pipe closes there
    # (its arguments show a moment later: see _shown).
    "while chunk := os.read(r, 20):\n"
    "    out += chunk\n"
    "double = int(out)\n"
    "(os.getpid(), daemon, double)"
)


def _marked(seconds: int) -> str:
    """A ``sleep`` argument of ``seconds`` that no other process on the machine has: another
    test (this one on a second xdist worker, at another isolation level) runs the same code."""
    return f"{seconds}.{uuid.uuid4().int % 10**12:012d}"


def _pgrep(*args: str) -> list[int]:
    """Pids of the machine's ``sleep`` processes whose arguments are exactly ``args``."""
    pattern = "^sleep (" + "|".join(re.escape(a) for a in args) + ")$"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _shown(*args: str) -> list[int]:
    """``_pgrep(*args)`` once each of ``args`` shows: a child's close-on-exec pipe closes (and
    ``Popen`` returns) part way through its exec, before the kernel has set its arguments up,
    and a loaded machine can hold it there while the test already looks for it."""
    deadline = time.monotonic() + 30.0
    while len(found := _pgrep(*args)) < len(args) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def _spawn(session: kx.Session, daemon: str, double: str) -> list[int]:
    result = session.run_code(SPAWN.format(daemon=daemon, double=double))
    assert result.ok, result.error
    return list(eval(result.result or "()"))


@pytest.mark.parametrize("level", ["process", pytest.param("bwrap", marks=needs_bwrap)])
def test_descendants_are_gone_after_restart_and_shutdown(level: str) -> None:
    with kx.KernelExecutor(isolation=level) as ex:
        s = ex.session("reap")
        marks = [_marked(607), _marked(608)]
        first = _spawn(s, *marks)
        if level == "bwrap":  # pids of another namespace: find them by what they run
            first = _shown(*marks)
            assert len(first) == 2
        s.restart()
        assert gone(first) == []
        assert _pgrep(*marks) == []
        marks = [_marked(607), _marked(608)]
        second = _spawn(s, *marks)
        if level == "bwrap":
            second = []
        left = _shown(*marks)
        assert len(left) == 2  # the second pair, alive until shutdown
    assert gone(second + left) == []


@pytest.mark.slow
@pytest.mark.parametrize("level", ["process", pytest.param("bwrap", marks=needs_bwrap)])
def test_descendants_die_with_a_sigkilled_host(level: str) -> None:
    mark = _marked(601)
    host = textwrap.dedent(
        f"""
        import sys, kernelexec as kx
        ex = kx.KernelExecutor(isolation={level!r})
        out = ex.session('h').run_code(
            "import subprocess; subprocess.Popen(['sleep', {mark!r}], start_new_session=True).pid"
        )
        print(out.result if out.ok else out.error, flush=True)
        sys.stdin.read()
        """
    )
    tmp = tempfile.gettempdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": tmp},
    )
    try:
        _kill_the_host_and_check(proc, mark, tmp)
    finally:
        # A failed check must not leave the host (and its kernel) to the next test.
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            sweep_stale(tmp)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _kill_the_host_and_check(proc: subprocess.Popen[str], mark: str, tmp: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.isdigit(), line
    children = psutil.Process(proc.pid).children()
    # The host's one namespace helper (kernelexec._sandbox._nshelper: capped and lent directories)
    helpers = [c.pid for c in children if c.name() == "kx-ns-helper"]
    launchers = [c.pid for c in children if c.pid not in helpers]
    daemons = _shown(mark)
    assert len(launchers) == 1 and len(daemons) == 1, (launchers, daemons)
    groups = host_groups(proc.pid)
    assert groups or _cgroups.support().kill is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert gone(launchers + daemons + helpers) == []
    # What the dead host could not remove is swept by the next one.
    removed = sweep_stale(tmp)
    assert len(removed) == 2  # its working directory and the kernel's directory
    # Any kernelexec process's first kernel sweeps them (another test's may come first).
    _cgroups.sweep_stale()
    assert host_groups(proc.pid) == []


def _go_on(pid: int) -> Callable[[str], None]:
    """An ``on_stdout`` hook that sends the kernel ``pid`` SIGUSR1 once: the host has seen its
    output, so the request is known to have started (a kernel that dies before it shows any
    sign of the request gets the request again on a fresh kernel)."""
    sent: list[bool] = []

    def hook(_: str) -> None:
        if not sent:
            sent.append(True)
            os.kill(pid, signal.SIGUSR1)

    return hook


def _on_go(action: str) -> str:
    """Kernel code that prints, then runs ``action`` once the host says it saw the output."""
    return (
        "import os, signal, time\n"
        f"signal.signal(signal.SIGUSR1, lambda *_: {action})\n"
        "print('bye', flush=True)\n"
        "time.sleep(30)"
    )


def test_killing_the_parent_kills_only_that_kernel() -> None:
    with kx.KernelExecutor() as ex:
        s, other = ex.session("parent"), ex.session("bystander")
        other.run_code("kept = 1")
        s.run_code("before = 1")
        pid = int(s.run_code("import os; os.getpid()").result or 0)
        code = _on_go("os.kill(os.getppid(), signal.SIGKILL)")
        hook = _go_on(pid)
        if s.isolation.boundaries["user"].startswith("its own"):
            # As its own user (a root host) the kernel may not signal its launcher at all.
            denied = s.run_code("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
            assert denied.error is not None and denied.error.ename == "PermissionError"
            assert s.run_code("before").result == "1"
            # Where the kill is allowed (an ordinary host user) it goes as the host does here.
            launcher = psutil.Process(pid).ppid()
            code = "import time\nprint('bye', flush=True)\ntime.sleep(30)"

            def hook(_: str) -> None:
                os.kill(launcher, signal.SIGKILL)

        result = s.run_code(code, on_stdout=hook)
        assert result.error is not None and result.error.kind == "kernel_died"
        assert "SIGKILL" in result.error.evalue
        assert gone([pid]) == []
        assert s.run_code("'back'").result == "'back'"
        assert other.run_code("kept").result == "1"


def test_killpg_of_its_own_group() -> None:
    with kx.KernelExecutor() as ex:
        s = ex.session("killpg")
        pid = int(s.run_code("import os; os.getpid()").result or 0)
        result = s.run_code(_on_go("os.killpg(0, signal.SIGKILL)"), on_stdout=_go_on(pid))
        assert result.error is not None and result.error.kind == "kernel_died"
        assert "SIGKILL" in result.error.evalue
        assert s.run_code("'back'").result == "'back'"


def _helpers() -> set[int]:
    """This process's namespace helpers (``kernelexec._sandbox._nshelper``, running as root)."""
    found = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # one ending as it is listed
            if child.name() == "kx-ns-helper":
                found.add(child.pid)
    return found


def test_nothing_is_left_running_once_the_last_executor_closed() -> None:
    """A process whose executors all closed has no child of kernelexec's left (the namespace
    helper outlived them: issue 36); a later executor starts its own."""
    from kernelexec._sandbox import _disk

    if _disk.support() is not None:
        pytest.skip(f"no capped working directories, so no namespace helper: {_disk.support()}")
    before = {c.pid for c in psutil.Process().children()}
    with kx.KernelExecutor(isolation="process") as ex:
        assert ex.session("a").run_code("6 * 7").result == "42"
        first = _helpers()
        assert len(first) == 1  # the capped working directory was shown to the kernel
        with kx.KernelExecutor(isolation="process") as other:
            assert other.session("b").run_code("1").result == "1"
        assert _helpers() == first  # still held by the first executor
    assert gone(list(first)) == []
    assert not _helpers()
    assert {c.pid for c in psutil.Process().children()} - before == set()
    with kx.KernelExecutor(isolation="process") as ex:
        assert ex.session("c").run_code("2").result == "2"
        second = _helpers()
        assert len(second) == 1 and second != first
    assert not _helpers()
