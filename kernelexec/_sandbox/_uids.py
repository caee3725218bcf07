"""Allocating kernels' own uids on a root host: one machine-wide record, so no uid is handed out
twice while anything it owns remains, across every host process.

The record (``/var/lib/kernelexec/uids.json``, in a directory only root can read, under a file
lock) holds the next uid to hand out and the uids in use, each with the host process that holds
it. Uids are handed out in order and wrap only after :data:`UID_SPAN` allocations, so a uid
comes back only after a hundred million other kernels; before a uid is reused (and whenever a
holder is found dead) :func:`sweep` removes what it owns in the places every user can write:
files, SysV IPC objects and processes.

A uid is released by its holder when its kernel (or a build) has ended and been swept, or by the
next allocation in any process once the holder process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import stat
import tempfile
from pathlib import Path

import filelock

from kernelexec import _trees
from kernelexec._tempdirs import KERNEL_UID_BASE as UID_BASE
from kernelexec._tempdirs import mount_points, process_alive, process_start_time

UID_SPAN = 100_000_000
"""Kernel uids are ``UID_BASE`` to ``UID_BASE + UID_SPAN - 1``: far above system, login and
subordinate-id ranges."""

RECORD_DIR = Path("/var/lib/kernelexec")
"""Where the record lives (persistent: files in ``/var/tmp`` outlive a reboot, and so must the
knowledge of which uids were handed out)."""

SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")
"""Directories every user can write, where a kernel's uid may leave things behind."""


def _record_dir() -> Path:
    return RECORD_DIR


def _locked() -> filelock.FileLock:
    where = _record_dir()
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(where, 0o700)
    return filelock.FileLock(str(where / "uids.lock"), thread_local=False)


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"next": 0, "live": {}}
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        # A torn record (the host died while writing it): every uid may have had a life.
        return {"next": 0, "wrapped": True, "live": {}}
    return data


def _write(path: Path, data: dict[str, object]) -> None:
    """Rewrite the record in place, under the lock. Not through a rename: ext4 flushes a file
    renamed over another at once (9 ms here, twice per kernel); a record torn by a crash is
    read as "every uid was used" (see :func:`_read`)."""
    text = json.dumps(data, separators=(",", ":")).encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, text, 0)
        os.ftruncate(fd, len(text))
    finally:
        os.close(fd)


def allocate() -> int:
    """A uid no one holds, recorded as held by this process.

    Holders found dead are swept (see :func:`sweep`) and released on the way; a uid that still
    runs processes is skipped.
    """
    pid = os.getpid()
    me = [pid, process_start_time(pid)]
    path = _record_dir() / "uids.json"
    with _locked():
        data = _read(path)
        live = data.get("live")
        live = dict(live) if isinstance(live, dict) else {}
        for key, holder in list(live.items()):
            valid = isinstance(holder, list) and len(holder) == 2
            if valid and (holder[0] == pid or process_alive(int(holder[0]), str(holder[1]))):
                continue
            sweep(int(key))  # a dead host's kernel: everything
            del live[key]
        start = data.get("next")
        n = start if isinstance(start, int) and 0 <= start < UID_SPAN else 0
        wrapped = data.get("wrapped") is True
        for _ in range(UID_SPAN):
            uid = UID_BASE + n
            n = (n + 1) % UID_SPAN
            # Running processes: a uid an older kernelexec derived from an inode, or one whose
            # first life has not ended. Skipped either way (one stat per process).
            if str(uid) in live or _processes_of(uid):
                continue
            if wrapped:  # a uid's second life: what its first left is swept
                sweep(uid)
            wrapped = wrapped or n == 0
            live[str(uid)] = me
            _write(path, {"next": n, "wrapped": wrapped, "live": live})
            return uid
    raise RuntimeError("every kernel uid is in use")


def release(uid: int, shared: bool = True) -> None:
    """Sweep what ``uid`` owns and hand it back (its kernel or build has ended). ``shared``:
    whether it could write the host's shared places (:data:`SHARED_PLACES`); a kernel with a
    private ``/tmp``, ``/var/tmp`` and ``/dev/shm`` could not, and only its processes and SysV
    objects are swept."""
    sweep(uid, files=shared)
    path = _record_dir() / "uids.json"
    with _locked():
        data = _read(path)
        live = data.get("live")
        if isinstance(live, dict):
            live.pop(str(uid), None)
            _write(path, data)


def held() -> dict[int, int]:
    """The uids in use and the host process holding each (for reports and tests)."""
    data = _read(_record_dir() / "uids.json")
    live = data.get("live")
    if not isinstance(live, dict):
        return {}
    return {int(k): int(v[0]) for k, v in live.items() if isinstance(v, list) and v}


def _processes_of(uid: int) -> list[int]:
    """The processes running as ``uid`` (the owner of ``/proc/<pid>``: one stat each, a tenth
    of what reading every process's status costs)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        found.append(int(entry.name))
    return found


def sweep(uid: int, *, files: bool = True) -> list[str]:
    """Remove what ``uid`` owns: its processes (killed), SysV IPC objects, and (``files``)
    every file and directory it owns under the places every user can write
    (:data:`SHARED_PLACES`, the host's temp dir), except what another file system mounted
    there holds (a killed host's capped directory: :func:`kernelexec._sandbox._disk.sweep`
    copies it back). Returns what was removed."""
    removed: list[str] = []
    for pid in _processes_of(uid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid}")
    removed += _sweep_ipc(uid)
    if files:
        for place in sorted({*SHARED_PLACES, tempfile.gettempdir()}):
            removed += _sweep_tree(place, uid)
    return removed


def _sweep_tree(place: str, uid: int) -> list[str]:
    """Remove what ``uid`` owns under ``place`` (through descriptors, never following a link:
    a directory it owns goes whole, a host directory is searched, a few levels down)."""
    try:
        top = _trees.open_top(place)
    except OSError:
        return []
    try:
        return _sweep_dir(top, place, uid, 0)
    finally:
        os.close(top)


_SWEEP_DEPTH = 8


def _sweep_dir(fd: int, where: str, uid: int, depth: int) -> list[str]:
    removed: list[str] = []
    try:
        names = os.listdir(fd)
        here = os.fstat(fd).st_dev
    except OSError:
        return removed
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        path = os.path.join(where, name)
        if st.st_dev != here and _is_mount(path):
            # A host's mount, never a kernel's (a killed host's capped directory: a tmpfs the
            # kernel's user owns). Emptied, it could not be removed, and _disk.sweep would copy
            # it back as an empty directory without the owner file _tempdirs.sweep_stale goes
            # by: left forever. Left whole, it is copied back as the host's, owner file and all.
            continue
        if st.st_uid == uid:
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(st.st_mode):
                    child = _trees.open_dir(fd, name)
                    try:
                        _trees.clear(child)
                    finally:
                        os.close(child)
                    os.rmdir(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            removed.append(path)
        elif (
            stat.S_ISDIR(st.st_mode)
            and (st.st_uid >= UID_BASE or st.st_mode & 0o002)
            and depth < _SWEEP_DEPTH
        ):
            with contextlib.suppress(OSError):  # another kernel's, or everyone's
                child = _trees.open_dir(fd, name)
                try:
                    removed += _sweep_dir(child, path, uid, depth + 1)
                finally:
                    os.close(child)
    return removed


def _is_mount(path: str) -> bool:
    """Whether a file system is mounted at ``path`` (its last name not followed); not merely
    another device (a btrfs subvolume, which an unprivileged user can make, is swept)."""
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return any(point == real for point, _, _ in mount_points())


_IPC_RMID = 0
_IPC_KINDS = (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl"))


def _sweep_ipc(uid: int) -> list[str]:
    """Remove the SysV shared memory segments, message queues and semaphore sets ``uid`` owns
    (in the host's IPC namespace: a kernel in its own namespace leaves none here)."""
    removed: list[str] = []
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, call in _IPC_KINDS:
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        header = lines[0].split()
        if "id" not in header or "uid" not in header:
            continue
        at_id, at_uid = header.index("id"), header.index("uid")
        for line in lines[1:]:
            fields = line.split()
            if len(fields) <= max(at_id, at_uid) or int(fields[at_uid]) != uid:
                continue
            ident = int(fields[at_id])
            if kind == "sem":
                getattr(libc, call)(ident, 0, _IPC_RMID)
            else:
                getattr(libc, call)(ident, _IPC_RMID, None)
            removed.append(f"SysV {kind} {ident}")
    return removed
