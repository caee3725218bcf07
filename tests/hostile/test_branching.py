"""Hostile: branches of a session go after their parent and their siblings, and fork bombs
through ``fork``.

A branch runs as its parent's user (one agent's branches are one tenant), so what keeps them
apart is: no descriptor of the parent's channels survives into a branch, every kernel's
connection file and socket files are taken back by the host once it is up, and every kernel
is non-dumpable (no ``/proc/<pid>/mem``, no ptrace by the same user).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

import kernelexec as kx
from kernelexec._core._session import AsyncSession
from kernelexec._sandbox import _cgroups
from kernelexec.backends._local import LocalConnection
from tests.conftest import wait_exited
from tests.hostile.conftest import needs_root

pytestmark = pytest.mark.anyio

PROBE = r"""
import json, os, socket
def probe(others):
    inodes = {}
    for line in open('/proc/net/unix').read().splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7:
            inodes[fields[6]] = fields[7]
    held = []
    for fd in os.listdir('/proc/self/fd'):
        try:
            target = os.readlink('/proc/self/fd/' + fd)
        except OSError:
            continue
        if target.startswith('socket:['):
            held.append(inodes.get(target[8:-1], ''))
    report = {'held': held, 'files': {}, 'mem': {}, 'connect': {}}
    for name, other in others.items():
        try:
            json.load(open(os.path.join(other['dir'], 'kernel.json')))
            report['files'][name] = 'read'
        except OSError as exc:
            report['files'][name] = type(exc).__name__
        try:
            open('/proc/%d/mem' % other['pid'], 'rb').read(1)
            report['mem'][name] = 'read'
        except OSError as exc:
            report['mem'][name] = type(exc).__name__
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(os.path.join(other['dir'], 's-%d' % other['shell']))
            report['connect'][name] = 'connected'
        except OSError as exc:
            report['connect'][name] = type(exc).__name__
        finally:
            sock.close()
    print(json.dumps(report))
"""


def target(session: AsyncSession) -> dict[str, object]:
    conn = session.lease.connection
    assert isinstance(conn, LocalConnection)
    info = conn.connection_info()
    assert info is not None
    return {
        "dir": os.path.dirname(info["ip"]),
        "pid": conn.kernel_pid(),
        "shell": info["shell_port"],
    }


@needs_root
async def test_a_branch_cannot_reach_its_parent_or_sibling() -> None:
    async with kx.AsyncKernelExecutor(isolation="process") as ex:
        parent = await ex.session("victim")
        await parent.run_code("secret = 'parent-only'")
        first, second = await parent.fork(2)
        others = {"parent": target(parent), "sibling": target(second)}
        await first.run_code(PROBE)
        result = await first.run_code(f"probe({json.dumps(others)})")
        assert result.error is None, result.error
        report = json.loads(result.stdout)
        parent_dir = str(others["parent"]["dir"])
        sibling_dir = str(others["sibling"]["dir"])
        # No inherited descriptor leads to the parent's (or the sibling's) channels.
        assert not [p for p in report["held"] if p.startswith(parent_dir + "/s-")]
        assert not [p for p in report["held"] if p.startswith(sibling_dir + "/")]
        for name in ("parent", "sibling"):
            assert report["files"][name] == "PermissionError", report
            assert report["mem"][name] == "PermissionError", report
            assert report["connect"][name] == "PermissionError", report
        # Both are unharmed.
        assert (await parent.run_code("print(secret)")).stdout == "parent-only\n"
        assert (await second.run_code("print(secret)")).stdout == "parent-only\n"


async def test_fork_bomb_through_fork_is_bounded_by_max_kernels() -> None:
    pids: set[int] = set()
    async with kx.AsyncKernelExecutor(max_kernels=4) as ex:
        root = await ex.session("bomb")
        await root.run_code("x = 1")
        frontier = [root]
        refused = 0
        for _ in range(4):
            grown: list[AsyncSession] = []
            for session in frontier:
                try:
                    grown += await session.fork(2)
                except kx.PoolExhaustedError:
                    refused += 1
            frontier = grown or frontier
            assert ex.kernel_count <= 4
        assert refused > 0
        live = [s for s in ex.sessions.values() if s.has_kernel]
        assert len(live) <= 4
        for session in live:
            conn = session.lease.connection
            assert conn is not None
            pid = conn.kernel_pid()
            assert pid is not None
            pids |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    for pid in pids:
        assert wait_exited(pid), f"process {pid} survived the executor"


HOST = r"""
import asyncio, json, sys
import kernelexec as kx

async def main():
    ex = kx.AsyncKernelExecutor(isolation=sys.argv[1])
    await ex.start()
    parent = await ex.session("doomed")
    await parent.run_code("x = 1")
    children = await parent.fork(2)
    snap = await parent.snapshot()
    pids = [s.lease.connection.kernel_pid() for s in (parent, *children)]
    print(json.dumps(pids + [snap.template.pid]), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_a_killed_host_takes_every_branch_with_it(isolation: str) -> None:
    """No branch, snapshot or kernel outlives a host killed with SIGKILL (none is left to
    PID 1 at ``"none"``)."""
    short_tmp = tempfile.mkdtemp(prefix="kxb")  # in the suite's temp root
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, isolation],
        stdout=subprocess.PIPE,
        text=True,
        # What the killed host leaves goes with the test's directory; a short one, since under
        # xdist tmp_path is too long for a branch's ipc sockets.
        env={**os.environ, "TMPDIR": str(short_tmp)},
    )
    try:
        assert host.stdout is not None
        pids = json.loads(host.stdout.readline())
        assert len(pids) == 4 and all(isinstance(p, int) for p in pids)
        host.send_signal(signal.SIGKILL)
        host.wait()
        for pid in pids:
            assert wait_exited(pid, 30), f"process {pid} outlived its host"
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
        _cgroups.sweep_stale()  # the killed host's empty groups
        shutil.rmtree(short_tmp, ignore_errors=True)


@needs_root
def test_a_branch_can_end_its_familys_kernels_and_nothing_outside_the_family() -> None:
    # One agent's branches are one tenant (docs/security.md, "Branches"): a branch runs as its
    # parent's user, so it can signal the kernels of its family and write their working
    # directories; it cannot reach another agent's kernel or files.
    with kx.KernelExecutor(max_kernels=6) as ex:
        parent = ex.session("family")
        other = ex.session("stranger")
        parent.run_code("import os\nopen('mine.txt', 'w').write('p')\nkept = 1").raise_for_error()
        other.run_code("import os\nopen('theirs.txt', 'w').write('o')\nx = 1").raise_for_error()
        parent_pid = int(parent.run_code("print(os.getpid())").stdout)
        other_pid = int(other.run_code("print(os.getpid())").stdout)
        probe = (
            "import os, signal\n"
            "def reach(path):\n"
            "    try:\n"
            "        open(path, 'a').write('branch')\n"
            "        return 'wrote'\n"
            "    except OSError as exc:\n"
            "        return type(exc).__name__\n"
            "def hit(pid):\n"
            "    try:\n"
            "        os.kill(pid, 0)\n"
            "        return 'can signal'\n"
            "    except OSError as exc:\n"
            "        return type(exc).__name__\n"
            f"print(reach({str(parent.workdir / 'mine.txt')!r}), "
            f"reach({str(other.workdir / 'theirs.txt')!r}), hit({parent_pid}), hit({other_pid}),"
            " sep='|')"
        )
        [child] = parent.fork(1)
        try:
            seen = child.run_code(probe).stdout.strip().split("|")
            assert seen[1] in ("PermissionError", "FileNotFoundError")  # another agent's files
            assert seen[3] == "PermissionError"  # another agent's kernel
            assert seen[2] == "can signal"  # its family's kernel: the same user
            assert seen[0] == "wrote"  # its family's files: the same user
            # The branches of a kernel end with it (their template is its fork): the branch
            # that killed it too, and its call says so at once, never by waiting out its
            # deadline (it may also end before it answered: then the run is sent again to a
            # fresh kernel, which says what it lost).
            killed = child.run_code(f"os.kill({parent_pid}, signal.SIGKILL)")
            assert killed.error is None or killed.error.kind != "timeout", killed
            after = parent.run_code("print(kept)")
            assert after.kernel_restarted is True and "kept" in after.lost_variables
            assert child.run_code("print('back')").stdout == "back\n"
            assert (parent.workdir / "mine.txt").read_text() == "pbranch"
        finally:
            child.close()
