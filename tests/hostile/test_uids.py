"""Hostile: a new tenant must never inherit an earlier or a concurrent tenant's uid.

Uids used to follow the inode of the kernel's private directory: on a journaled (ext4) temp dir
a new directory gets the freed inode, so the next tenant got the same uid and read what the
first one left; two host processes with temp dirs on two fresh tmpfs mounts handed out the same
uid at once. Both layouts are made here for real (a loop-mounted ext4, two tmpfs mounts).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._sandbox import _uids
from tests.hostile.conftest import needs_root

pytestmark = [needs_root, pytest.mark.slow]


def _mount(args: list[str], target: str) -> None:
    try:
        subprocess.run(["mount", *args, target], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount here: {exc}")


@contextlib.contextmanager
def _mounted(kind: str) -> Iterator[str]:
    """A fresh filesystem of ``kind`` (``"ext4"`` on a loop device, or ``"tmpfs"``) mounted at
    a new directory every user can write (mode 1777, like /tmp); unmounted afterwards."""
    where = tempfile.mkdtemp(prefix="kxmnt-", dir="/tmp")
    image = where + ".img"
    try:
        if kind == "ext4":
            with open(image, "wb") as fh:
                fh.truncate(64 * 1024 * 1024)
            subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True, timeout=60)
            _mount(["-o", "loop", image], where)
        else:
            _mount(["-t", "tmpfs", "-o", "size=64m", "tmpfs"], where)
        os.chmod(where, 0o1777)
        try:
            yield where
        finally:
            subprocess.run(["umount", "-l", where], check=False, timeout=60)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(where)
        with contextlib.suppress(OSError):
            os.unlink(image)


LEAVE = r"""
import os
left = []
for place in [os.environ['KX_SHARED'], os.environ['HOME'], os.getcwd()]:
    path = os.path.join(place, 'left-behind')
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b'tenant one only')
        os.close(fd)
        left.append(path)
    except OSError:
        pass
(os.getuid(), left)
"""


def test_a_new_tenant_on_a_journaled_temp_dir_gets_a_new_uid_and_nothing_left_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _mounted("ext4") as tmp:
        monkeypatch.setattr(tempfile, "tempdir", tmp)
        monkeypatch.setenv("KX_SHARED", tmp)
        with kx.KernelExecutor(env_vars={"KX_SHARED": tmp}) as ex:
            first = ex.session("one").run_code(LEAVE)
        assert first.ok, first.error
        uid_one, left = eval(first.result or "")
        with kx.KernelExecutor(env_vars={"KX_SHARED": tmp}) as ex:
            second = ex.session("two")
            uid_two = int(second.run_code("import os; os.getuid()").result or 0)
            reads = [second.run_code(f"open({p!r}).read()") for p in left]
        assert uid_two != uid_one
        assert [r.result for r in reads if r.ok] == []
        # Nothing the first tenant's uid owns outlives it in the temp dir.
        owned = [str(p) for p in Path(tmp).rglob("*") if p.lstat().st_uid == uid_one]
        assert owned == []


HOST = r"""
import json, os, sys
import kernelexec as kx
with kx.KernelExecutor() as ex:
    s = ex.session("tenant")
    info = s.run_code("import os; open(os.path.join(os.environ['HOME'], 'secret'), 'w')"
                      ".write('mine'); (os.getuid(), os.getpid(), os.environ['HOME'])")
    uid, pid, home = eval(info.result)
    print(json.dumps({"uid": uid, "pid": pid, "home": home}), flush=True)
    other = json.loads(sys.stdin.readline())
    path = "/proc/%d/root%s/secret" % (other["pid"], other["home"])
    got = s.run_code("open(%r).read()" % path)
    print(json.dumps({"read": got.result if got.ok else None}), flush=True)
    sys.stdin.readline()
"""


def test_two_host_processes_with_temp_dirs_on_two_tmpfs_never_share_a_uid() -> None:
    with _mounted("tmpfs") as tmp_a, _mounted("tmpfs") as tmp_b, contextlib.ExitStack() as stack:
        hosts = [
            stack.enter_context(
                subprocess.Popen(
                    [sys.executable, "-c", textwrap.dedent(HOST)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "TMPDIR": tmp},
                )
            )
            for tmp in (tmp_a, tmp_b)
        ]
        pipes = [(h.stdin, h.stdout) for h in hosts]
        infos = [json.loads(out.readline()) for _, out in pipes if out is not None]
        for (into, _), other in zip(pipes, reversed(infos), strict=True):
            assert into is not None
            into.write(json.dumps(other) + "\n")
            into.flush()
        reads = [json.loads(out.readline()) for _, out in pipes if out is not None]
        for into, _ in pipes:
            if into is not None:
                into.write("\n")
                into.flush()
        codes = [h.wait(timeout=60) for h in hosts]
    assert infos[0]["uid"] != infos[1]["uid"]
    assert reads == [{"read": None}, {"read": None}]
    assert codes == [0, 0]
    assert not set(_uids.held()) & {infos[0]["uid"], infos[1]["uid"]}
