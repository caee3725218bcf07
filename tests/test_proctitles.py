"""Every process kernelexec starts names itself in ``ps``: ``kernelexec fork server``,
``kernelexec launcher``, ``kernelexec kernel <agent id> [<isolation>]``, with no source code
on its command line (read back with ``ps`` itself)."""

from __future__ import annotations

import os
import subprocess

import psutil
import pytest

import kernelexec as kx
from kernelexec.backends._forkservers import enabled
from tests.support.procs import running


def ps(pid: int, field: str = "args", *, gone_ok: bool = False) -> str:
    """What ``ps -o <field>`` shows for ``pid`` ("" with ``gone_ok`` when it has exited)."""
    done = subprocess.run(
        ["ps", "-ww", "-o", f"{field}=", "-p", str(pid)],
        capture_output=True,
        text=True,
        check=not gone_ok,
    )
    return done.stdout.strip()


def kernel_pid(session: kx.Session) -> int:
    return int(session.run_code("import os; os.getpid()").result or 0)


@pytest.mark.parametrize("level", ["process", "none"])
def test_ps_names_every_process_kernelexec_starts(level: str) -> None:
    forked = enabled(True)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with kx.KernelExecutor(isolation=level, max_kernels=3) as ex:
        first, odd = ex.session("agent-7"), ex.session("odd\nname\tlong-" + "x" * 40)
        pid, odd_pid = kernel_pid(first), kernel_pid(odd)
        assert ps(pid) == f"kernelexec kernel agent-7 [{level}]"
        assert ps(pid, "comm") == "kx-kernel"
        # Control characters are shown as "?", never as a line of their own.
        assert ps(odd_pid) == f"kernelexec kernel odd?name?long-{'x' * 40} [{level}]"
        mine = {
            p.pid
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and running(p)
        }
        parent = psutil.Process(pid).parent()
        assert parent is not None
        if level == "process":
            assert ps(parent.pid) == "kernelexec launcher"
            assert ps(parent.pid, "comm") == "kx-launcher"
            parent = parent.parent()
            assert parent is not None
        if forked:
            assert ps(parent.pid) == "kernelexec fork server"
            assert ps(parent.pid, "comm") == "kx-forkserver"
        else:
            assert parent.pid == os.getpid()
        # Every process below this one is one of kernelexec's, and none shows source code.
        shown = {p: text for p in mine if (text := ps(p, gone_ok=True))}
        assert {pid, odd_pid} <= shown.keys(), shown
        assert all(text.startswith("kernelexec ") for text in shown.values()), shown
        assert not [t for t in shown.values() if "import" in t or "\n" in t], shown
