"""Hostile (issue 41 items 1 and 2): what a lent directory may hand a kernel. Only an ordinary
directory is lent, never the host's ``/proc``, ``/sys``, ``/dev``, ``/run`` or a
pseudo-filesystem mounted elsewhere; and no host socket, FIFO or device in a lent directory is
reachable through it, in any mode, at ``"process"`` and at ``"bwrap"`` (no network: a unix
socket would be its way to host services).

Seen before the fix: ``PYTHONPATH=/proc`` in a Letta sandbox env gave a ``"bwrap"`` kernel the
host's ``/proc`` over its own (every host process and its arguments), and a read-only loan of a
directory holding a listening unix socket let the kernel connect to the host's listener.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import kernelexec as kx
from kernelexec._sandbox import _disk
from tests.hostile.conftest import HAVE_BWRAP, needs_root

pytestmark = [
    pytest.mark.anyio,
    needs_root,
    pytest.mark.skipif(
        _disk.support() is not None, reason=f"no mount namespaces here: {_disk.support()}"
    ),
]

LEVELS = [
    "process",
    pytest.param("bwrap", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="no bwrap")),
]


@pytest.fixture(params=LEVELS)
async def executor(request: pytest.FixtureRequest) -> AsyncIterator[kx.AsyncKernelExecutor]:
    async with kx.AsyncKernelExecutor(isolation=request.param) as ex:
        yield ex


@pytest.fixture
def services() -> Iterator[tuple[Path, socket.socket]]:
    """A directory any local user may reach (outside /tmp) holding Python code, a unix socket
    a host service listens on (any user may connect), a FIFO any user may open, and a device
    (``/dev/null``'s numbers) any user may open."""
    path = Path(tempfile.mkdtemp(prefix="kxlend-svc-", dir="/run"))
    path.chmod(0o755)
    (path / "mod.py").write_text("X = 1\n")
    (path / "mod.py").chmod(0o644)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path / "svc.sock"))
        os.chmod(path / "svc.sock", 0o777)
        listener.listen(8)
        listener.setblocking(False)
        os.mkfifo(path / "pipe", 0o666)
        os.chmod(path / "pipe", 0o666)
        os.mknod(path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.chmod(path / "null", 0o666)
        yield path, listener
    finally:
        listener.close()
        shutil.rmtree(path)


PROBE = (
    "import errno, os, socket\n"
    "def attempt(f):\n"
    "    try:\n"
    "        return f()\n"
    "    except OSError as exc:\n"
    "        return errno.errorcode[exc.errno]\n"
    "def connect(path):\n"
    "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "    s.settimeout(5)\n"
    "    try:\n"
    "        s.connect(path)\n"
    "        return 'connected'\n"
    "    finally:\n"
    "        s.close()\n"
)


async def run(session: Any, code: str) -> str:
    result = await session.run_code(code)
    assert result.ok, result.error
    return result.result or ""


@pytest.mark.parametrize("mode", ["read", "copy", "own"])
async def test_no_host_socket_fifo_or_device_is_reached_through_a_loan(
    executor: kx.AsyncKernelExecutor, services: tuple[Path, socket.socket], mode: str
) -> None:
    where, listener = services
    session = await executor.session(f"svc-{mode}")
    await session.lease.lend(str(where), mode=mode)  # type: ignore[arg-type]
    # The kernel holds the FIFO open for reading: a host writer would find it.
    code = PROBE + (
        f"fifo = attempt(lambda: os.open({str(where / 'pipe')!r}, os.O_RDONLY | os.O_NONBLOCK))\n"
        f"(open({str(where / 'mod.py')!r}).read(),"
        f" attempt(lambda: connect({str(where / 'svc.sock')!r})),"
        f" isinstance(fifo, int), attempt(lambda: open({str(where / 'null')!r}, 'rb').read()))"
    )
    text, connected, fifo_open, device = eval(await run(session, code))
    assert text == "X = 1\n"  # the code in it is lent
    assert connected == "ECONNREFUSED"  # not the host's listener
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody came
    assert fifo_open is True
    with pytest.raises(OSError) as caught:  # no reader on the host's FIFO: the kernel's is another
        fd = os.open(where / "pipe", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    assert caught.value.errno == errno.ENXIO
    assert device == "EACCES"  # nodev


@pytest.mark.parametrize(
    "path, why",
    [
        ("/proc", "lies in /proc"),
        ("/proc/self", "lies in /proc"),
        ("/proc/1", "lies in /proc"),
        ("/sys", "lies in /sys"),
        ("/sys/fs/cgroup", "lies in /sys"),
        ("/dev", "lies in /dev"),
        ("/dev/shm", "lies in /dev"),
        ("/dev/pts", "lies in /dev"),
        ("/run", "provides /run itself"),
        ("/var/tmp", "provides /var/tmp itself"),
    ],
)
async def test_the_sandboxs_own_trees_are_never_lent(
    executor: kx.AsyncKernelExecutor, path: str, why: str
) -> None:
    if not await asyncio.to_thread(os.path.isdir, path):
        pytest.skip(f"{path} is not a directory here")
    session = await executor.session("system")
    for mode in ("read", "copy", "own"):
        with pytest.raises(kx.ConfigError, match=why):
            await session.lease.lend(path, mode=mode)  # type: ignore[arg-type]


@pytest.fixture
def pseudo() -> Iterator[Path]:
    """A proc filesystem mounted on the host outside /proc (as a container runtime might),
    any local user may reach."""
    path = Path(tempfile.mkdtemp(prefix="kxlend-proc-", dir="/run"))
    path.chmod(0o755)
    subprocess.run(["mount", "-t", "proc", "proc", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        path.rmdir()


async def test_a_pseudo_filesystem_elsewhere_is_never_lent(
    executor: kx.AsyncKernelExecutor, pseudo: Path
) -> None:
    session = await executor.session("pseudo")
    for target in (pseudo, pseudo / "self"):
        with pytest.raises(kx.ConfigError, match="on a proc filesystem"):
            await session.lease.lend(str(target), mode="read")


@pytest.fixture
def letta_bwrap(services: tuple[Path, socket.socket]) -> Iterator[str]:
    """Letta on ``"bwrap"`` kernels; the ``PYTHONPATH`` a sandbox env gives a tool: the host's
    ``/proc``, ``/sys``, ``/dev`` and ``/run``, and a directory holding a host service's
    socket."""
    from kernelexec.compat import letta

    where, _ = services
    letta.configure(isolation="bwrap")
    try:
        yield os.pathsep.join(["/proc", "/sys", "/dev", "/run", str(where)])
    finally:
        letta.shutdown()
        letta.configure()


def host_view() -> tuple[list[str], str]:
    """What a Letta tool sees: every process's command line, and its try at the socket."""
    import os
    import socket

    lines = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    lines.append(fh.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    where = next(p for p in os.environ["PYTHONPATH"].split(":") if "kxlend-svc-" in p)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(where + "/svc.sock")
        reached = "connected"
    except OSError as exc:
        reached = type(exc).__name__
    finally:
        s.close()
    return lines, reached


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_BWRAP, reason="no bwrap")
async def test_a_letta_pythonpath_naming_proc_gives_a_bwrap_kernel_nothing_of_the_hosts(
    letta_bwrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    from kernelexec.compat.letta import AsyncToolSandboxKernel
    from tests.support.letta_models import (
        LocalSandboxConfig,
        SandboxConfig,
        User,
        create_tool_from_func,
    )

    where = Path(tempfile.mkdtemp(prefix="kxletta-", dir="/run"))
    await asyncio.to_thread(where.chmod, 0o755)
    try:
        config = SandboxConfig(
            config=LocalSandboxConfig(sandbox_dir=str(where), use_venv=False).model_dump(
                exclude_none=True
            )
        )
        tool = create_tool_from_func(host_view)
        sandbox = AsyncToolSandboxKernel(
            tool.name,
            {},
            User(),
            tool_id=tool.id,
            tool_object=tool,
            sandbox_config=config,
            sandbox_env_vars={"PYTHONPATH": letta_bwrap},
        )
        with caplog.at_level(logging.WARNING, logger="kernelexec"):
            result = await sandbox.run()
    finally:
        shutil.rmtree(where)
    assert result.status == "success", result.stderr
    lines, reached = (
        eval(result.func_return) if isinstance(result.func_return, str) else result.func_return
    )
    # Its own pid namespace: the launcher, the kernel and what it started; no host process.
    assert lines and not any("pytest" in line or "kx-ns-helper" in line for line in lines), lines
    assert len(lines) < 10, lines
    assert reached == "ConnectionRefusedError"
    said = " ".join(r.getMessage() for r in caplog.records)
    for refused in ("/proc", "/sys", "/dev", "/run"):
        assert f"PYTHONPATH entry {refused} not lent" in said, said
