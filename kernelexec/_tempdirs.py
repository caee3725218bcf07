"""Private temporary directories that carry their owner, so a killed host's leftovers are swept.

A host killed with SIGKILL cannot clean up; its kernels exit on their own (ipykernel polls its
parent) but their directories stay. Every directory kernelexec creates under the temp dir holds
an ``.owner`` file (pid and process start time); the first executor started in a process removes
the directories whose owner is gone.

A directory is kernelexec's by that marker, never by its name alone (:func:`owner_of`): a user's
``/tmp/kx-work`` is the user's, to lend to a kernel, and never swept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import tempfile
from pathlib import Path

import psutil

from kernelexec import _trees

ASIDE_PREFIX = ".kx-in-"
"""A directory's contents moved aside while it becomes a tmpfs (``_sandbox._disk.cap``): it
keeps the directory's ``.owner``, so a host killed in between leaves it to the sweep too."""
PREFIXES = ("kx-", "kernelexec-", ASIDE_PREFIX)
KERNEL_UID_BASE = 2_000_000_000
"""Kernels that run as users of their own (a root host) get uids from here up; their
directories are swept like the host's own."""
OWNER_FILE = ".owner"
_swept = False


def _start_time(pid: int) -> str:
    """A token for when the process started, or '' if it is gone.

    On Linux it is the start time in clock ticks since boot: the token earlier kernelexec
    versions wrote (from ``/proc``), so that two versions on one machine agree on which owners
    are alive and never sweep each other's live directories.
    """
    try:
        created = psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return ""
    if sys.platform.startswith("linux"):
        return str(round((created - psutil.boot_time()) * os.sysconf("SC_CLK_TCK")))
    return repr(created)


def _alive(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a reused pid has
    another start time)."""
    if not psutil.pid_exists(pid):
        return False
    return not start or _start_time(pid) in ("", start)


def make_owned_dir(prefix: str) -> str:
    """``tempfile.mkdtemp(prefix=...)`` (mode 0700) with an ``.owner`` file naming this process."""
    path = tempfile.mkdtemp(prefix=prefix)
    pid = os.getpid()
    try:
        Path(path, OWNER_FILE).write_text(f"{pid} {_start_time(pid)}\n")
    except BaseException:  # out of descriptors, say: no directory left without its owner
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, OWNER_FILE))
        with contextlib.suppress(OSError):
            os.rmdir(path)  # needs no descriptor, as rmtree would
        raise
    return path


def mount_points() -> list[tuple[str, str, str]]:
    """This process's mounts as (mount point, file system type, source), from
    ``/proc/self/mountinfo``; empty where that cannot be read."""
    found: list[tuple[str, str, str]] = []
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) > sep + 2:
            found.append((_unescape(fields[4]), fields[sep + 1], fields[sep + 2]))
    return found


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def remove_tree(path: str) -> None:
    """Remove the tree at ``path`` (:func:`kernelexec._trees.remove`: however deep or wide,
    nothing followed), first detaching what is mounted at or under it (a capped directory,
    :mod:`kernelexec._sandbox._disk`); errors are logged, never raised (a sweep goes on)."""
    # The last name is not resolved: a tenant that owns it may have made it a link (to /dev,
    # say), and what is mounted there is not this tree's.
    real = os.path.join(os.path.realpath(os.path.dirname(path) or "."), os.path.basename(path))
    try:
        is_dir = stat.S_ISDIR(os.lstat(real).st_mode)
    except OSError:
        is_dir = False
    if is_dir:
        below = [p for p, _, _ in mount_points() if p == real or p.startswith(real + "/")]
        for point in sorted(below, key=len, reverse=True):
            detach(point)
    try:
        _trees.remove(path)
    except OSError as exc:
        logging.getLogger("kernelexec").warning("removing %s failed: %r", path, exc)


def detach(point: str) -> int:
    """Detach the mount at ``point`` (``umount2`` with ``MNT_DETACH``, never following a link
    at its last name: ``UMOUNT_NOFOLLOW``); 0, or the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
    return 0 if libc.umount2(point.encode(), 2 | 8) == 0 else ctypes.get_errno()


def owner_of(path: str) -> tuple[int, str] | None:
    """The process (pid, start token) that made the directory at ``path``, when kernelexec
    made it; else None.

    kernelexec's own is a directory (not a link) of the host's user, or for a root host of a
    kernel's user, holding an ``.owner`` that is a plain file with one link, of the host's user
    (who wrote it) or the directory's, naming a process. Nothing is followed: a planted link,
    a file of another user or a name alone never makes a directory kernelexec's.
    """
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(dir_fd)
        host = os.geteuid()
        if st.st_uid != host and not (host == 0 and st.st_uid >= KERNEL_UID_BASE):
            return None
        fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        try:
            marker = os.fstat(fd)
            if not stat.S_ISREG(marker.st_mode) or marker.st_nlink != 1:
                return None
            if marker.st_uid not in (host, st.st_uid):
                return None
            parts = os.read(fd, 256).decode("ascii").split()
        finally:
            os.close(fd)
        return int(parts[0]), (parts[1] if len(parts) > 1 else "")
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(dir_fd)


def sweep_stale(root: str | None = None) -> list[str]:
    """Remove kernelexec directories under ``root`` (default: the temp dir) whose owner process
    is gone. Only a directory with kernelexec's marker (:func:`owner_of`) is considered; the
    name prefix only spares reading every other directory's."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIXES):
            continue
        owner = owner_of(entry.path)
        if owner is not None and not _alive(*owner):
            remove_tree(entry.path)
            removed.append(entry.path)
    return removed


def sweep_once() -> list[str]:
    """:func:`sweep_stale` the first time it is called in this process."""
    global _swept
    if _swept:
        return []
    _swept = True
    return sweep_stale()


def process_start_time(pid: int) -> str:
    """The start token of process ``pid`` (as written in owner files), or ''."""
    return _start_time(pid)


def process_alive(pid: int, start: str) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start`` (if given)."""
    return _alive(pid, start)
