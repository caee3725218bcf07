"""Hostile: ``max_disk_mb`` bounds what a kernel writes where it works, not only its scratch.

Seen before the fix: with ``max_file_mb=20`` a tenant wrote 600 MB to the temp dir and to its
working directory; with the private ``/tmp`` capped, the working directory and ``HOME`` (the
kernel's own directory) still took anything. Now each is a tmpfs of ``max_disk_mb`` on a root
host at ``"process"``, and what a working directory holds is copied back to the disk, holes,
links and all, without following what a tenant planted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from kernelexec import _trees
from kernelexec._sandbox import _cgroups, _disk, _uids
from kernelexec._tempdirs import (
    make_owned_dir,
    owner_of,
    process_start_time,
    remove_tree,
    sweep_stale,
)
from tests.hostile.conftest import host_groups, needs_bwrap, needs_root

pytestmark = [
    needs_root,
    pytest.mark.skipif(
        os.name != "posix" or _disk.support() is not None,
        reason=f"capped directories do not work here: {_disk.support()}",
    ),
]

FILL = r"""
import errno, os
def fill(path, mb):
    try:
        with open(path, 'wb') as fh:
            for _ in range(mb):
                fh.write(b'x' * (1 << 20))
        return 'fit'
    except OSError as exc:
        return errno.errorcode[exc.errno]
"""


@pytest.mark.parametrize("level", ["process", pytest.param("bwrap", marks=needs_bwrap)])
def test_working_directory_and_home_are_capped_and_kept_across_restarts(level: str) -> None:
    with kx.KernelExecutor(isolation=level, limits=kx.Limits(max_disk_mb=32)) as ex:
        s = ex.session("disk")
        assert (
            "the session directory it works in a 16 MiB tmpfs" in s.isolation.limits["max_disk_mb"]
        )
        r = s.run_code(
            FILL + "kept = 'x'\n"
            "(fill('small', 4), fill('big', 64), fill(os.path.expanduser('~/big'), 64),"
            " os.getcwd())"
        )
        assert r.ok, r.error
        small, big, home, cwd = eval(r.result)
        assert (small, big, home) == ("fit", "ENOSPC", "ENOSPC")
        # The host sees what the kernel wrote, where it expects it.
        assert Path(cwd, "small").stat().st_size == 4 << 20
        s.restart()
        again = s.run_code("import os\n(os.path.getsize('small'), 'kept' in globals())")
        assert again.result == f"({4 << 20}, False)", again
        mounts = [p for p in _disk.mounts() if p == os.path.realpath(cwd)]
        assert mounts, "the working directory is not a capped mount while the kernel works in it"
    # Gone with the kernel, and the files are back on the disk until the executor removes them.
    assert os.path.realpath(cwd) not in _disk.mounts()


TOTAL = r"""
import errno, os

def fill(path):
    written = 0
    try:
        with open(path, 'wb') as fh:
            while written < 256:
                fh.write(b'x' * (1 << 20))
                fh.flush()
                written += 1
    except OSError as exc:
        assert exc.errno in (errno.ENOSPC, errno.EFBIG), exc
    return written

places = ['full', os.path.expanduser('~/full'), '/tmp/full']
if os.path.isdir('/dev/shm') and os.access('/dev/shm', os.W_OK):
    places.append('/dev/shm/full')
(sum(fill(p) for p in places), places)
"""


@pytest.mark.parametrize("level", ["process", pytest.param("bwrap", marks=needs_bwrap)])
def test_max_disk_mb_is_one_total_for_a_session(level: str) -> None:
    # Every writable place of the kernel filled at once: together no more than max_disk_mb.
    with kx.KernelExecutor(isolation=level, limits=kx.Limits(max_disk_mb=64)) as ex:
        s = ex.session("total")
        r = s.run_code(TOTAL)
        assert r.ok, r.error
        total, places = eval(r.result or "")
        assert len(places) >= 3
        assert 32 <= total <= 64, (total, places)


def test_what_the_directory_held_is_moved_in_and_too_much_is_a_clear_error(
    tmp_path: Path,
) -> None:
    # A working directory is not empty when a kernel enters it after a restart or a restore.
    some, full = tmp_path / "some", tmp_path / "full"
    some.mkdir()
    (some / "note.txt").write_text("kept")
    (some / "pair-a").write_text("both inside")
    os.link(some / "pair-a", some / "pair-b")
    (tmp_path / "host-file").write_text("the host's")
    os.link(tmp_path / "host-file", some / "planted")  # a link to a file outside the tree
    full.mkdir()
    (full / "data").write_bytes(b"y" * (40 << 20))
    uid = 2_000_000_000 - 7  # any uid: nothing runs as it here
    _disk.cap(str(some), 32, uid)
    try:
        assert str(some) in _disk.mounts()
        assert (some / "note.txt").read_text() == "kept"
        assert some.stat().st_uid == uid
        assert not (some / "planted").exists()  # left out: its content never reaches the kernel
        assert os.stat(some / "pair-a").st_ino == os.stat(some / "pair-b").st_ino
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kx-")]
    finally:
        _disk.uncap(str(some))
    assert (some / "note.txt").read_text() == "kept"
    with pytest.raises(_disk.DiskError, match=r"holds more than max_disk_mb=32 MiB"):
        _disk.cap(str(full), 32, uid)
    assert str(full) not in _disk.mounts()
    assert (full / "data").stat().st_size == 40 << 20  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "host-file", "some"]
    assert (tmp_path / "host-file").read_text() == "the host's"


def test_copy_back_keeps_holes_and_links_and_follows_nothing(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    with open(src / "sparse", "wb") as fh:  # 1 TiB apparent, 4 KiB of data
        fh.seek(1 << 40)
        fh.write(b"end")
    (src / "one").write_bytes(b"z" * (1 << 20))
    for n in range(50):
        os.link(src / "one", src / f"link{n}")
    os.symlink("/etc/shadow", src / "secret")
    os.mkfifo(src / "fifo")
    deep = src
    for n in range(120):
        deep = deep / f"d{n}"
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("deep")
    too_deep = src / "t"
    for _ in range(_trees.MAX_DEPTH + 2):
        too_deep = too_deep / "t"
    too_deep.mkdir(parents=True)
    skipped = _disk.copy_tree(str(src), str(dst))
    past = "/".join(["t"] * (_trees.MAX_DEPTH + 1)) + "/"
    assert skipped == ["fifo", past]  # what lies past the depth bound is named, not copied
    st = (dst / "sparse").stat()
    assert st.st_size == (1 << 40) + 3 and st.st_blocks * 512 < (1 << 20)
    with open(dst / "sparse", "rb") as fh:
        assert fh.read(3) == b"\0\0\0"
        fh.seek(1 << 40)
        assert fh.read() == b"end"
    assert (
        os.stat(dst / "one").st_nlink == 51
        and os.stat(dst / "link7").st_ino == os.stat(dst / "one").st_ino
    )
    assert os.readlink(dst / "secret") == "/etc/shadow"
    assert (dst / deep.relative_to(src) / "leaf").read_text() == "deep"


KILLED_HOST = textwrap.dedent(
    """
    import sys, kernelexec as kx
    ex = kx.KernelExecutor(workdir=sys.argv[1], limits=kx.Limits(max_disk_mb=32))
    s = ex.session("victim")
    r = s.run_code("open('result.txt', 'w').write('made before the host died')")
    assert r.ok, r.error
    print(s.workdir, flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.slow
def test_a_killed_hosts_capped_directory_is_copied_back_and_unmounted(tmp_path: Path) -> None:
    workdir = tmp_path / "sessions"
    workdir.mkdir()
    # The host's own temp dir, like /tmp (every user may write it) but short (its kernel's
    # sockets are made there): what it leaves is looked for there, not among every host's.
    tmp = tempfile.mkdtemp(prefix="kxh-")
    os.chmod(tmp, 0o1777)
    with subprocess.Popen(
        [sys.executable, "-c", KILLED_HOST, str(workdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": tmp},
    ) as host:
        assert host.stdout is not None
        where = os.path.realpath(host.stdout.readline().strip())
        assert where in _disk.mounts()
        (kdir,) = [e.path for e in os.scandir(tmp) if e.name.startswith("kx-")]
        assert kdir in _disk.mounts()  # the kernel's own directory (its HOME) is capped too
        uid = os.stat(kdir).st_uid  # the kernel's own user
        family = psutil.Process(host.pid).children(recursive=True)
        host.send_signal(signal.SIGKILL)
        host.wait()
    _, alive = psutil.wait_procs(family, timeout=60)  # its kernels die with it (PDEATHSIG)
    assert not alive
    # What the next uid allocation in any process does for the dead holder, before any disk
    # sweep: it emptied the kernel's capped directory, which the copy back then made a
    # directory without its owner file, left forever (about 19 in /tmp per CI run).
    _uids.release(uid)
    _disk.sweep()  # (another test process's executor may have swept it already)
    assert not [p for p, src in _disk.mounts().items() if src.startswith(f"kx-work:{host.pid}:")]
    assert Path(where, "result.txt").read_text() == "made before the host died"
    # What the next executor does: the killed host's own directories and cgroups go.
    sweep_stale(tmp)
    assert os.listdir(tmp) == []
    os.rmdir(tmp)
    _cgroups.sweep_stale()
    assert host_groups(host.pid) == []


def test_a_uid_sweep_leaves_a_capped_directory_whole_for_its_copy_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel's own directory, capped (a tmpfs its user owns), in a place every user can
    # write; its host killed. Before the fix the sweep of the kernel's uid emptied the tmpfs,
    # owner file too, and could not remove the mount point; the copy back then made an empty
    # directory that no sweep takes for kernelexec's.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))  # a place the uid sweep searches
    uid = _uids.allocate()
    kdir = make_owned_dir("kx-")
    try:
        _disk.cap(kdir, 1, uid)
        assert kdir in _disk.mounts() and os.stat(kdir).st_uid == uid
        _uids.sweep(uid)  # what the next allocation does once the holder is dead
        _disk.uncap(kdir)  # what the disk sweep does for a killed host
        assert owner_of(kdir) == (os.getpid(), process_start_time(os.getpid()))
    finally:
        remove_tree(kdir)
        _uids.release(uid)


def test_a_copy_back_warns_of_what_held_data_and_not_of_sockets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A killed host's kernel directory (capped: HOME) still holds its kernel's ipc sockets; the
    # next host's sweep copied it back and warned of them, and a notebook whose executor ran
    # that sweep showed the warning on stderr (pair 1, 2026-12-05). A FIFO is still named.
    caplog.set_level("DEBUG", logger="kernelexec")
    kdir = tmp_path / "kx-home"
    kdir.mkdir()
    _disk.cap(str(kdir), 8, os.getuid())
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(kdir / "s-1"))
        os.mkfifo(kdir / "pipe")
        (kdir / "kept").write_text("data")
    finally:
        _disk.uncap(str(kdir))
    assert (kdir / "kept").read_text() == "data"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"left out of the copy back of {kdir}: ['pipe']"], warned
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert f"sockets left out of the copy back of {kdir}: ['s-1']" in debug, debug
