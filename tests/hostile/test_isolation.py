"""Hostile: a kernel under ``isolation="bwrap"`` looks for the host's files, network,
processes and other sessions. Each case asserts what it finds: nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from tests.conftest import kernel_children, our_temp_dirs
from tests.hostile.conftest import needs_bwrap

pytestmark = [needs_bwrap, pytest.mark.usefixtures("executor")]


@pytest.fixture(scope="module")
def executor() -> Iterator[kx.KernelExecutor]:
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(isolation="bwrap", default_timeout=30) as ex:
        yield ex
    assert not kernel_children() - before
    assert not our_temp_dirs() - before_dirs


def value(session: kx.Session, code: str) -> object:
    result = session.run_code(code)
    assert result.ok, result.error
    return eval(result.result or "None")


PROBE = (
    "def probe(path):\n"
    "    try:\n"
    "        with open(path) as fh:\n"
    "            return fh.read()\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
)


def test_host_files_outside_the_session_cannot_be_read(
    executor: kx.KernelExecutor, tmp_path: Path
) -> None:
    secret = uuid.uuid4().hex
    home_file = Path.home() / f".kx-hostile-{secret}"
    temp_file = Path(tempfile.gettempdir()) / secret
    home_file.write_text(secret)
    temp_file.write_text(secret)
    try:
        s = executor.session("files")
        s.run_code(PROBE)
        assert value(s, f"probe({str(home_file)!r})") == "FileNotFoundError"
        assert value(s, f"probe({str(temp_file)!r})") == "FileNotFoundError"
        assert value(s, f"probe({str(tmp_path / 'x')!r})") == "FileNotFoundError"
        assert value(s, "import os; os.path.exists(os.path.expanduser('~/.ssh'))") is False
        assert value(s, "probe('/etc/shadow')") == "PermissionError"
    finally:
        home_file.unlink()
        temp_file.unlink()


def test_nothing_can_be_written_outside_the_session_directory_and_tmp(
    executor: kx.KernelExecutor,
) -> None:
    s = executor.session("writes")
    s.run_code(
        "def write(path):\n"
        "    try:\n"
        "        with open(path, 'w') as fh:\n"
        "            fh.write('x')\n"
        "        return 'written'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
    )
    import sys

    venv_file = os.path.join(sys.prefix, "planted.py")
    assert value(s, "write('/etc/planted')") in ("OSError", "PermissionError")
    assert value(s, "write('/usr/lib/planted')") in ("OSError", "PermissionError")
    assert value(s, f"write({venv_file!r})") in ("OSError", "PermissionError")
    assert value(s, "write('/planted')") in ("OSError", "PermissionError")
    assert value(s, "write('inside.txt')") == "written"
    assert value(s, "write('/tmp/private.txt')") == "written"
    assert (s.workdir / "inside.txt").read_text() == "x"
    assert not os.path.exists(venv_file)
    assert not os.path.exists("/tmp/private.txt")
    assert value(s, "import errno; errno.errorcode[OSError(30, '').errno]") == "EROFS"


def test_a_listener_on_the_hosts_loopback_receives_no_connection(
    executor: kx.KernelExecutor,
) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []
    server.settimeout(0.5)

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        s = executor.session("net")
        outcome = value(
            s,
            "import socket\n"
            "def connect(host, port):\n"
            "    try:\n"
            "        socket.create_connection((host, port), timeout=2).close()\n"
            "        return 'connected'\n"
            "    except OSError as exc:\n"
            "        return type(exc).__name__\n"
            f"(connect('127.0.0.1', {port}), connect('1.1.1.1', 80), "
            "sorted(n for _, n in socket.if_nameindex()))",
        )
        assert outcome == ("ConnectionRefusedError", "OSError", ["lo"])
    finally:
        thread.join()
        server.close()
    assert accepted == []


def test_network_true_gives_the_host_network() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        with kx.KernelExecutor(isolation="bwrap", network=True) as ex:
            s = ex.session("net-on")
            code = f"import socket; socket.create_connection(('127.0.0.1', {port})).close(); 'ok'"
            assert s.run_code(code).result == "'ok'"
            conn, _ = server.accept()
            conn.close()
            assert ex.fingerprint != kx.KernelExecutor(isolation="bwrap").fingerprint
    finally:
        server.close()


def test_proc_shows_only_the_kernels_own_processes(executor: kx.KernelExecutor) -> None:
    s = executor.session("proc")
    pids = value(s, "import os; sorted(int(p) for p in os.listdir('/proc') if p.isdigit())")
    assert pids == [1, 2]  # bubblewrap's init and the kernel
    assert value(s, "import os; (os.getpid(), os.getppid())") == (2, 1)
    host_cmd = value(s, "open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode()")
    assert host_cmd.endswith("bwrap")


def test_runs_as_its_own_unprivileged_user(executor: kx.KernelExecutor) -> None:
    s = executor.session("uid")
    uid, caps, nnp = value(
        s,
        "import os\n"
        "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "(os.getuid(), status['CapEff'].strip(), status['NoNewPrivs'].strip())",
    )
    assert isinstance(uid, int)
    if os.geteuid() == 0:
        assert uid >= 2_000_000_000
    assert (caps, nnp) == ("0000000000000000", "1")


def test_isolation_says_what_enforces_what(executor: kx.KernelExecutor) -> None:
    iso = executor.session("iso").isolation
    assert iso.level == "bwrap"
    assert iso.boundaries["network"] == "bwrap: own network namespace, loopback only"
    assert iso.boundaries["processes"].startswith("bwrap: own PID, IPC and UTS namespaces; ")
    assert set(iso.limits) >= {"memory_mb", "max_processes", "max_open_files"}


def test_interrupt_timeout_restart_and_recording_work_under_bwrap(tmp_path: Path) -> None:
    with kx.KernelExecutor(isolation="bwrap", record_dir=tmp_path) as ex:
        s = ex.session("life")
        s.run_code("kept = 7")
        result = s.run_code("import time; time.sleep(30)", timeout=0.5)
        assert result.error is not None and result.error.kind == "timeout"
        assert "state kept" in result.error.evalue
        assert s.run_code("kept").result == "7"
        s.restart()
        after = s.run_code("'fresh'")
        assert after.ok and after.lost_variables == ["kept", "time"]
        assert s.notebook is not None and len(s.notebook.cells) == 4
        assert (tmp_path / "life.ipynb").exists()
