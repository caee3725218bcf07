"""Hostile: one agent's kernel goes after another agent's kernel and the host's secrets.

At ``"process"`` on a root host (kernels as their own users) and at ``"bwrap"``, a tool that
searches the machine for connection files and connects to what it finds reaches no other
kernel, and no ``/proc/*/environ`` holds the host's secret.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from kernelexec.backends import LocalBackend
from tests.hostile.conftest import needs_bwrap, needs_root

HUNT = r"""
import glob, json, os
def hunt(secret):
    found, read, reached = [], [], []
    for pattern in ('/tmp/**/kernel.json', '/tmp/**/kernel-*.json', '/run/**/kernel*.json',
                    os.path.expanduser('~') + '/**/kernel*.json'):
        found += glob.glob(pattern, recursive=True)
    mine = os.path.realpath(get_ipython().kernel.config['IPKernelApp']['connection_file'])
    for path in sorted(set(found)):
        if os.path.realpath(path) == mine:
            continue
        try:
            info = json.load(open(path))
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or 'key' not in info:
            continue  # a kernelspec, not a connection file
        read.append(path)
        from jupyter_client import BlockingKernelClient
        kc = BlockingKernelClient()
        kc.load_connection_info(info)
        kc.start_channels()
        try:
            kc.kernel_info(reply=False)
            if kc.get_shell_msg(timeout=2):
                reached.append(path)
        except Exception:
            pass
        finally:
            kc.stop_channels()
    environ = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            if secret.encode() in open('/proc/' + pid + '/environ', 'rb').read():
                environ.append(int(pid))
        except OSError:
            pass
    return {'read': read, 'reached': reached, 'environ': environ,
            'own_env': secret in str(os.environ)}
"""


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    value = uuid.uuid4().hex
    monkeypatch.setenv("KX_HOSTILE_SECRET", value)
    yield value


def _hunt(ex: kx.KernelExecutor, secret: str) -> dict[str, object]:
    victim = ex.session("tenant-b")
    assert victim.run_code("b_private = 'b'").ok
    attacker = ex.session("tenant-a")
    assert attacker.run_code(HUNT).ok
    result = attacker.run_code(f"hunt({secret!r})", timeout=60)
    assert result.ok, result.error
    assert victim.run_code("b_private").result == "'b'"  # B untouched
    return eval(result.result or "{}")  # type: ignore[no-any-return]


@needs_bwrap
def test_bwrap_tenants_cannot_reach_each_other_or_the_hosts_environment(secret: str) -> None:
    with kx.KernelExecutor(isolation="bwrap") as ex:
        found = _hunt(ex, secret)
    assert found == {"read": [], "reached": [], "environ": [], "own_env": False}


def _owned_by(uid: int, *roots: str) -> list[str]:
    """Paths under ``roots`` (the roots included) owned by ``uid``."""
    found = []
    for root in roots:
        for top, dirs, files in os.walk(root):
            for name in [".", *dirs, *files]:
                path = os.path.normpath(os.path.join(top, name))
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(path).st_uid == uid:
                        found.append(path)
    return found


def _tenant_processes(uids: tuple[int, ...], namespace: str) -> set[tuple[int, float]]:
    """The processes (pid, start time) running as one of ``uids`` or in mount ``namespace``."""
    found = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):  # pid 1 here: EACCES
            theirs = proc.uids().real in uids
            if theirs or os.readlink(f"/proc/{proc.pid}/ns/mnt") == namespace:
                found.add((proc.pid, proc.create_time()))
    return found


@needs_root
@pytest.mark.parametrize("host", ["bridged", "reachable"])
def test_process_tenants_on_a_root_host_run_as_separate_users(
    host: str, secret: str, request: pytest.FixtureRequest
) -> None:
    # "bridged": this machine as it is (the interpreter under the 0700 /root, the temp root
    # 0700); "reachable": laid out like a server, nothing in the way.
    if host == "reachable":
        backend = LocalBackend(python=request.getfixturevalue("reachable_host"))
    else:
        backend = LocalBackend()
    home = Path(os.path.expanduser("~"))
    planted = home / f".kx-hostile-{uuid.uuid4().hex}"
    planted.write_text(secret)
    try:
        with kx.KernelExecutor(backend=backend) as ex:
            session = ex.session("tenant-a")
            isolation = session.isolation
            assert isolation.level == "process"
            assert isolation.boundaries["user"].startswith("its own unprivileged user")
            # This suite's temp root is 0700: the bridged host always has something to bridge.
            bridged = "bridged" in isolation.boundaries["user"]
            assert bridged == (host == "bridged")
            home_hidden = f"{home} shows only" in isolation.boundaries["filesystem"]
            found = _hunt(ex, secret)
            a, b = ex.session("tenant-a"), ex.session("tenant-b")
            uid_a = int(a.run_code("import os; os.getuid()").result or 0)
            uid_b = int(b.run_code("import os; os.getuid()").result or 0)
            cwd = a.run_code("import os; st = os.stat(os.getcwd()); (oct(st.st_mode), st.st_uid)")
            home_file = a.run_code(f"open({str(planted)!r}).read()")
            pid = a.run_code("import os; os.getpid()").result
            namespace = os.readlink(f"/proc/{pid}/ns/mnt")
            workdir = str(a.workdir.parent)
            # What runs as the tenants or in the namespace before the close: once released,
            # their uids and the namespace's inode number may go to another suite's kernels.
            before = _tenant_processes((uid_a, uid_b), namespace)
            assert before  # the kernels, at least
        assert found == {"read": [], "reached": [], "environ": [], "own_env": False}
        assert uid_a != uid_b and min(uid_a, uid_b) >= 2_000_000_000
        assert cwd.result == f"('0o40700', {uid_a})"
        assert home_file.error is not None
        # Bridged, the rest of the home is not even there; else its 0700 keeps the kernel out.
        assert home_file.error.ename == ("FileNotFoundError" if home_hidden else "PermissionError")
        # The kernel had a mount namespace of its own (its private /tmp, and the bridges),
        # and nothing holds it once the kernel is gone.
        assert namespace != os.readlink("/proc/self/ns/mnt")
        assert _tenant_processes((uid_a, uid_b), namespace) & before == set()
        assert _owned_by(uid_a, tempfile.gettempdir()) == []
        assert not os.path.exists(workdir)  # the executor's own directory went with it
    finally:
        planted.unlink()


@needs_root
def test_process_tenants_cannot_read_each_others_session_files() -> None:
    with kx.KernelExecutor() as ex:
        a, b = ex.session("files-a"), ex.session("files-b")
        assert a.run_code("open('secret.txt', 'w').write('a only')").ok
        path = str(a.workdir / "secret.txt")
        result = b.run_code(f"open({path!r}).read()")
        assert result.error is not None and result.error.ename == "PermissionError"
        listing = b.run_code(f"import os; os.listdir({str(a.workdir.parent)!r})")
        assert listing.error is not None and listing.error.ename == "PermissionError"
        assert (a.workdir / "secret.txt").read_text() == "a only"  # the host reads it


@needs_bwrap
def test_bwrap_sessions_cannot_read_each_others_files() -> None:
    with kx.KernelExecutor(isolation="bwrap") as ex:
        a, b = ex.session("bf-a"), ex.session("bf-b")
        assert a.run_code("open('secret.txt', 'w').write('a only')").ok
        path = str(a.workdir / "secret.txt")
        result = b.run_code(f"open({path!r}).read()")
        assert result.error is not None
        expected = "PermissionError" if os.geteuid() == 0 else "FileNotFoundError"
        assert result.error.ename == expected


def test_the_default_process_level_scrubs_the_environment(secret: str) -> None:
    with kx.KernelExecutor() as ex:
        s = ex.session("env")
        assert s.isolation.level == "process"
        assert s.run_code(f"import os; {secret!r} in str(os.environ)").result == "False"
        home = s.run_code("import os; os.environ['HOME']").result
        assert home is not None and home.strip("'") != os.path.expanduser("~")


@needs_bwrap
@needs_root
def test_a_planted_hard_link_does_not_hand_a_host_file_over() -> None:
    outside = Path(tempfile.gettempdir()) / f"host-{uuid.uuid4().hex}"
    outside.write_text("the host's")
    try:
        with kx.KernelExecutor(isolation="bwrap") as ex:
            s = ex.session("link")
            assert s.run_code("open('mine.txt', 'w').write('k')").ok
            # Planted while no kernel works there (a capped directory is a tmpfs of its own:
            # no link to a host file can be made in it), as a kernel would, were links allowed.
            s.close()
            os.link(outside, s.workdir / "planted")
            s = ex.session("link")  # the same directory, a new kernel and user
            capped = "the session directory it works in" in s.isolation.limits["max_disk_mb"]
            assert s.run_code("open('mine.txt').read()").result == "'k'"
            assert (s.workdir / "mine.txt").stat().st_uid >= 2_000_000_000  # the new user's
            assert outside.stat().st_uid == 0  # the linked host file was not handed over
            if capped:  # left out of the copy into the tmpfs: neither the file nor its content
                assert s.run_code("import os; os.path.exists('planted')").result == "False"
            else:
                denied = s.run_code("open('planted', 'a').write('x')")
                assert denied.error is not None and denied.error.ename == "PermissionError"
            s.close()
            # A later kernel may get the same uid: nothing stays owned by the ended kernel's.
            owners = {p.stat().st_uid for p in [s.workdir, *s.workdir.iterdir()]}
            assert owners == {0}
    finally:
        outside.unlink()
