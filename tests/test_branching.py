"""Branching live sessions: fork, snapshot and restore, on real kernels.

Every executor here is made and closed inside its test, and each test checks afterwards that
every process of the family (kernels, templates, kept parents), directory and cgroup is gone:
branch processes are grandchildren of kernels, which the autouse leak check does not see.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

import kernelexec as kx
from kernelexec._core._session import AsyncSession
from kernelexec.backends import KernelBackend
from kernelexec.backends._base import KernelConnection, KernelLaunch
from kernelexec.backends._local import LocalBackend, LocalConnection

from .conftest import wait_exited

pytestmark = pytest.mark.anyio


def kernel_pid(session: AsyncSession) -> int:
    conn = session.lease.connection
    assert conn is not None
    pid = conn.kernel_pid()
    assert pid is not None
    return pid


def family(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    proc = psutil.Process(pid)
    return {pid, *(p.pid for p in proc.children(recursive=True))}


def cgroups_of(pid: int) -> set[str]:
    with open(f"/proc/{pid}/cgroup") as fh:
        return {line.strip() for line in fh if line.strip() and "name=" not in line}


async def out(session: AsyncSession, code: str) -> str:
    result = await session.run_code(code)
    assert result.error is None, result.error
    return result.stdout


def assert_gone(pids: set[int], paths: list[str]) -> None:
    for pid in pids:
        assert wait_exited(pid), f"process {pid} still runs"
    for path in paths:
        assert not os.path.exists(path), f"{path} left behind"


async def test_children_start_from_parent_state_diverge_and_nothing_flows_back() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        parent = await ex.session("a")
        await out(
            parent,
            "import json\nx = 1\ndef f(v):\n    return v * 3\n"
            "open('shared.txt', 'w').write('from parent')",
        )
        children = await parent.fork(2)
        assert [c.agent_id for c in children] == ["a~1", "a~2"]
        assert {"a", "a~1", "a~2"} <= set(ex.sessions)
        for n, child in enumerate(children, start=1):
            text = await out(child, "print(x, f(x), json.dumps([x]), open('shared.txt').read())")
            assert text == "1 3 [1] from parent\n"
            await out(child, f"x = {n * 10}\nopen('mine.txt', 'w').write('{n}')")
        assert await out(children[0], "print(x)") == "10\n"
        assert await out(children[1], "print(x)") == "20\n"
        assert await out(parent, "import os\nprint(x, os.path.exists('mine.txt'))") == "1 False\n"
        assert Path(children[0].workdir) != Path(parent.workdir)
        await out(parent, "x = 99")
        assert await out(children[0], "print(x)") == "10\n"
        # A child forks too: grandchildren carry its state, not the root's.
        grandchildren = await children[1].fork()
        assert grandchildren[0].agent_id == "a~2~1"
        assert await out(grandchildren[0], "print(x)") == "20\n"


async def test_fork_waits_for_a_running_call_never_copies_half_a_cell() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        parent = await ex.session("w")
        await out(parent, "x = 0")
        gate = Path(parent.workdir) / "go"
        started = asyncio.Event()
        code = (
            "import os, time\nx = 1\nprint('waiting', flush=True)\n"
            "while not os.path.exists('go'):\n    time.sleep(0.01)\nx = 2\n"
        )
        call = asyncio.create_task(parent.run_code(code, on_stdout=lambda _: started.set()))
        await started.wait()
        fork = asyncio.create_task(parent.fork())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not fork.done(), "the fork did not wait for the running call"
        gate.touch()
        assert (await call).error is None
        (child,) = await fork
        assert await out(child, "print(x)") == "2\n"


async def test_a_child_is_interrupted_and_replaced_like_any_kernel() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        parent = await ex.session("i")
        await out(parent, "x = 7")
        (child,) = await parent.fork()
        slow = await child.run_code("import time\ntime.sleep(60)", timeout=1)
        assert slow.error is not None and slow.error.kind == "timeout"
        assert "state kept" in slow.error.evalue
        assert await out(child, "print(x)") == "7\n"
        died = await child.run_code("import os\nos._exit(3)")
        assert died.error is not None and died.error.kind == "kernel_died"
        fresh = await child.run_code("print('x' in globals())")
        assert fresh.stdout == "False\n"
        assert "x" in fresh.lost_variables or "x" in died.lost_variables
        assert await out(parent, "print(x)") == "7\n"


async def test_snapshot_and_restore_undo_any_number_of_times() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("undo")
        await out(s, "x = [1, 2]\nopen('f.txt', 'w').write('one')")
        snap = await s.snapshot()
        pids = {snap.template.pid}
        for round_ in range(3):
            await out(
                s,
                f"x.append({round_})\nopen('f.txt', 'w').write('two')\n"
                "open('g.txt', 'w').write('new')\ny = 5",
            )
            await s.restore(snap)
            pids.add(kernel_pid(s))
            text = await out(
                s,
                "import os\nprint(x, open('f.txt').read(), os.path.exists('g.txt'), "
                "'y' in globals())",
            )
            assert text == "[1, 2] one False False\n"
        assert not snap.closed
        await snap.aclose()
        assert snap.closed
        with pytest.raises(kx.BranchError):
            await s.restore(snap)
        assert await out(s, "print(x)") == "[1, 2]\n"  # the session goes on
        # The session's kernel is a fork of the snapshot, which it keeps until replaced.
        assert psutil.pid_exists(snap.template.pid)
        await s.restart()
        assert wait_exited(snap.template.pid)
        other = await ex.session("other")
        with pytest.raises(ValueError, match="undo"):
            await other.restore(await s.snapshot())


async def test_a_dead_kernels_closed_snapshot_leaves_the_directory_to_its_successor() -> None:
    # The kernel a snapshot was taken of dies (the snapshot with it) and the session's next
    # kernel takes the working directory; the dead kernel is kept for the snapshot until it is
    # closed. Shutting it down then must not give the directory back from under its successor
    # (by default a capped tmpfs, copied to the disk and unmounted: the successor would write
    # where the host no longer looks).
    async with kx.AsyncKernelExecutor(default_timeout=60) as ex:
        s = await ex.session("successor")
        await out(s, "x = 1")
        snap = await s.snapshot()
        died = await s.run_code("import os\nos._exit(3)")
        assert died.error is not None and died.error.kind == "kernel_died"
        await out(s, "open('before.txt', 'w').write('mine')")
        with pytest.raises(kx.BranchError, match="closed or its process is gone"):
            await s.restore(snap)  # it ended with its kernel
        await snap.aclose()  # the dead kernel, kept for it until now, is shut down
        seen = await out(
            s, "open('after.txt', 'w').write('still mine')\nprint(open('before.txt').read())"
        )
        assert seen == "mine\n"
        assert Path(s.workdir, "after.txt").read_text() == "still mine"  # noqa: ASYNC240
        owner = json.loads(await out(s, "import os\nprint(os.getuid())"))
        assert os.stat(s.workdir).st_uid == owner


async def test_setup_code_is_not_run_again_over_a_fork_or_a_restore() -> None:
    async with kx.AsyncKernelExecutor(setup_code="runs = globals().get('runs', 0) + 1") as ex:
        s = await ex.session("setup", setup_code="mine = 1")
        assert await out(s, "print(runs, mine)") == "1 1\n"
        (child,) = await s.fork()
        assert child.setup_code == s.setup_code  # its own fresh kernels get the same setup
        assert await out(child, "print(runs, mine)") == "1 1\n"
        snap = await s.snapshot()
        await out(s, "mine = 5")
        await s.restore(snap)
        assert await out(s, "print(runs, mine)") == "1 1\n"


async def test_large_state_forks_sharing_memory() -> None:
    size = 256 << 20
    async with kx.AsyncKernelExecutor() as ex:
        parent = await ex.session("big")
        await out(parent, f"blob = b'x' * {size}\nimport gc; gc.collect()")
        (child,) = await parent.fork()
        assert await out(child, "print(len(blob), blob[-1:])") == f"{size} b'x'\n"
        parent_mem = psutil.Process(kernel_pid(parent)).memory_full_info()
        child_mem = psutil.Process(kernel_pid(child)).memory_full_info()
        assert parent_mem.rss > size
        assert child_mem.rss > size  # the blob is mapped in the child ...
        assert child_mem.uss < size // 8, child_mem  # ... but its pages are the parent's
        assert child_mem.pss < parent_mem.rss * 0.75


async def test_parent_close_leaves_children_and_close_frees_everything() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        parent = await ex.session("p")
        await out(parent, "x = 'kept'")
        parent_pid = kernel_pid(parent)
        (child,) = await parent.fork()
        snap = await child.snapshot()
        pids = family(parent_pid) | family(kernel_pid(child)) | {snap.template.pid}
        child_conn = child.lease.connection
        assert isinstance(child_conn, LocalConnection)
        dirs = [child_conn.family().directory, snap.template.tdir, *snap.template.extra_dirs]
        await parent.aclose()
        assert psutil.pid_exists(parent_pid)  # kept: its branch lives
        assert await out(child, "print(x)") == "kept\n"
        await child.aclose()
        assert psutil.pid_exists(parent_pid)  # the child's snapshot still holds the family
        await snap.aclose()
        assert wait_exited(parent_pid), "the kept parent did not end with its last branch"
        workdir = ex._core.workdir
    assert_gone(pids, [*dirs, str(workdir)])


async def test_close_frees_processes_dirs_and_cgroups() -> None:
    async with kx.AsyncKernelExecutor(limits=kx.Limits(memory_mb=512)) as ex:
        parent = await ex.session("c")
        await out(parent, "x = 1")
        children = await parent.fork(2)
        snap = await parent.snapshot()
        pids = family(kernel_pid(parent)) | {snap.template.pid}
        dirs = [snap.template.tdir]
        groups: set[str] = set()
        for child in children:
            conn = child.lease.connection
            assert isinstance(conn, LocalConnection)
            pids |= family(kernel_pid(child))
            dirs += [conn.family().directory, str(child.workdir)]
            groups |= (
                {str(p) for p in conn._confinement.cgroup.paths}
                if conn._confinement.cgroup
                else set()
            )
    assert_gone(pids, [*dirs, *groups])


async def test_default_isolation_gives_children_the_parent_user_and_limits() -> None:
    async with kx.AsyncKernelExecutor(limits=kx.Limits(memory_mb=512)) as ex:
        parent = await ex.session("iso")
        assert parent.isolation.level == ex.isolation_of(ex.env).level
        await out(parent, "import os")
        (child,) = await parent.fork()
        uid = json.loads(await out(parent, "print(os.getuid())"))
        assert json.loads(await out(child, "print(os.getuid())")) == uid
        child_pid, parent_pid = kernel_pid(child), kernel_pid(parent)
        if parent.isolation.level == "process" and os.geteuid() == 0:
            assert uid != 0
            assert cgroups_of(child_pid) != cgroups_of(parent_pid)
            conn = child.lease.connection
            assert isinstance(conn, LocalConnection) and conn._confinement.cgroup is not None
            limits = [p / "memory.limit_in_bytes" for p in conn._confinement.cgroup.paths]
            limits += [p / "memory.max" for p in conn._confinement.cgroup.paths]
            found = {p.read_text().strip() for p in limits if p.exists()}
            assert str(512 << 20) in found
        # Another key and connection file than the parent's.
        parent_info = parent.lease.connection.connection_info()  # type: ignore[union-attr]
        child_info = child.lease.connection.connection_info()  # type: ignore[union-attr]
        assert parent_info and child_info and parent_info["key"] != child_info["key"]


async def test_threads_of_the_parent_are_named_in_the_child_first_result() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        parent = await ex.session("t")
        await out(
            parent,
            "import threading\nstop = threading.Event()\n"
            "threading.Thread(target=stop.wait, name='poller-7', daemon=True).start()",
        )
        (child,) = await parent.fork()
        first = await child.run_code("1 + 1")
        assert "poller-7" in first.stderr and "do not run here" in first.stderr
        second = await child.run_code("print(len([t for t in threading.enumerate()]))")
        assert second.stderr == ""
        await out(parent, "stop.set()")


async def test_children_count_against_max_kernels() -> None:
    async with kx.AsyncKernelExecutor(max_kernels=3) as ex:
        parent = await ex.session("m")
        await out(parent, "x = 1")
        with pytest.raises(kx.PoolExhaustedError, match="nothing was forked"):
            await parent.fork(3)
        assert set(ex.sessions) == {"m"}
        assert ex.kernel_count == 1
        children = await parent.fork(2)
        assert ex.kernel_count == 3
        with pytest.raises(kx.PoolExhaustedError):
            await children[0].fork()
        await children[0].aclose()
        assert ex.kernel_count == 2
        assert len(await children[1].fork()) == 1


async def test_recording_of_a_child_starts_with_where_it_branched(tmp_path: Path) -> None:
    async with kx.AsyncKernelExecutor(record=True, record_dir=tmp_path) as ex:
        parent = await ex.session("r")
        await out(parent, "x = 1")
        await out(parent, "y = 2")
        (child,) = await parent.fork()
        await out(child, "z = x + y")
        nb = child.notebook
        assert nb is not None
        first = nb.cells[0]
        assert first.cell_type == "markdown"
        assert "`r`" in first.source and "cell 2" in first.source
        assert nb.cells[1].source == "z = x + y"
        (text,) = await asyncio.to_thread(
            lambda: [p.read_text() for p in tmp_path.glob("r_1-*.ipynb")]
        )
        saved = json.loads(text)
        assert saved["cells"][0]["metadata"]["kernelexec"]["parent"] == "r"


class _Wrapped(KernelConnection):
    """A local kernel behind a connection of another type (as a remote backend's is)."""

    def __init__(self, inner: KernelConnection) -> None:
        self.inner = inner

    async def send(self, *args: Any, **kwargs: Any) -> str:
        return await self.inner.send(*args, **kwargs)

    async def receive(self, timeout: float) -> Any:
        return await self.inner.receive(timeout)

    async def interrupt(self) -> None:
        await self.inner.interrupt()

    async def restart(self) -> None:
        await self.inner.restart()

    async def shutdown(self) -> None:
        await self.inner.shutdown()


class _OtherBackend(KernelBackend):
    name = "other"

    def __init__(self) -> None:
        self.local = LocalBackend()

    async def start(self, launch: KernelLaunch, *, timeout: float) -> KernelConnection:
        return _Wrapped(await self.local.start(launch, timeout=timeout))

    async def release(self) -> None:
        await self.local.release()


async def test_other_backends_refuse_with_a_typed_error() -> None:
    async with kx.AsyncKernelExecutor(backend=_OtherBackend()) as ex:
        s = await ex.session("g")
        await out(s, "x = 1")
        with pytest.raises(kx.BranchingNotSupportedError, match="'other' backend"):
            await s.fork()
        with pytest.raises(NotImplementedError):
            await s.snapshot()
        assert await out(s, "print(x)") == "1\n"


async def test_bwrap_refuses_with_a_typed_error() -> None:
    try:
        bwrap = kx.AsyncKernelExecutor(isolation="bwrap")
    except kx.ConfigError as exc:
        pytest.skip(f"isolation='bwrap' cannot be asked for on this host: {exc}")
    async with bwrap as ex:
        s = await ex.session("b")
        with pytest.raises(kx.BranchingNotSupportedError, match="isolation='bwrap'"):
            await s.fork()
        assert ex.kernel_count == 0  # refused before a kernel was started


def test_blocking_facade() -> None:
    with kx.KernelExecutor() as ex:
        s = ex.session("sync")
        s.run_code("x = 5")
        (child,) = s.fork()
        assert isinstance(child, kx.Session)
        assert child.agent_id == "sync~1"
        assert child.run_code("x += 1; print(x)").stdout == "6\n"
        snap = s.snapshot()
        assert isinstance(snap, kx.Snapshot)
        s.run_code("x = 0")
        s.restore(snap)
        s.restore(snap)
        assert s.run_code("print(x)").stdout == "5\n"
        snap.close()
        assert snap.closed


def test_a_branch_does_not_mistake_kernelexecs_own_threads_for_the_users() -> None:
    # Launched without the fork server, ipykernel captures the kernel's fds and kernelexec's
    # kernel side reads them on threads of its own: a branch has its own, and must not warn.
    with kx.KernelExecutor(backend=LocalBackend(fork_server=False)) as ex:
        s = ex.session("fds")
        s.run_code("x = 1")
        (child,) = s.fork()
        first = child.run_code("print(x)")
        assert first.stdout == "1\n" and first.stderr == "", first.stderr
