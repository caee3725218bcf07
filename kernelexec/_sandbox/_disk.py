"""A working directory with a size cap: ``max_disk_mb`` for what a kernel writes where it works.

At ``"process"`` on a root host a kernel's ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are one
size-capped tmpfs in its own mount namespace (:mod:`kernelexec._sandbox._mounts`). Its session's
working directory is a host directory the host reads and writes too (files, durable state,
branches), so it cannot live in the kernel's namespace alone. While a kernel works in it, the
directory is a tmpfs of ``max_disk_mb`` mounted on the host (:func:`cap`), and that mount is put
into the kernel's namespace at the same path (:func:`show_to`: ``open_tree`` on the host,
``setns`` into the kernel's namespace, ``move_mount``; kernels started ahead of need have their
namespace before their session exists, and a mount made later on the host does not reach it).
When the kernel ends, what it left is copied back to the host's disk and the tmpfs goes
(:func:`uncap`): outside a live kernel the working directory is a plain directory again.

A tmpfs is memory (then swap): the pages a kernel writes count against its ``memory_mb`` too.

The copy back is of a tree a tenant made: it is walked through directory descriptors without
following links; plain files are copied with their holes (a sparse file stays sparse), a file
with several links is copied once and linked, links are recreated as links, anything else
(FIFOs, sockets, devices) is left out, except overlayfs's whiteouts (the character device 0:0,
which no driver answers): they keep a file the kernel removed from a directory lent to it copy
on write (:mod:`._lend`) removed. The tmpfs's inode cap bounds how many entries there are.

Each mount's source names its host process (``kx-work:<pid>:<start>``): :func:`sweep` copies
back and removes the mounts of hosts that were killed before they could.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

from kernelexec import _proctitle, _trees, _workdirs
from kernelexec._exceptions import TreeLimitError
from kernelexec._sandbox import _nshelper
from kernelexec._tempdirs import (
    ASIDE_PREFIX,
    detach,
    mount_points,
    process_alive,
    process_start_time,
)

log = logging.getLogger("kernelexec")

_MS_NOSUID, _MS_NODEV = 2, 4
_SOURCE_PREFIX = "kx-work:"
_INODES_PER_MB = 256  # one per 4 KiB written, on average: a cap on entries the copy back walks


class DiskError(OSError):
    """The working directory could not be capped or given back (the message says why)."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    )
    return libc


def _source() -> str:
    pid = os.getpid()
    return f"{_SOURCE_PREFIX}{pid}:{process_start_time(pid)}"


def _inodes(size_mb: int) -> int:
    """The inode cap of a capped directory: what the copy back may walk (entries)."""
    return min(_trees.MAX_ENTRIES, max(4096, size_mb * _INODES_PER_MB))


def _mount(path: str, size_mb: int, uid: int) -> None:
    options = f"size={size_mb}m,nr_inodes={_inodes(size_mb)},mode=0700,uid={uid},gid={uid}"
    libc = _libc()
    if libc.mount(_source().encode(), path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                  options.encode()) != 0:  # fmt: skip
        err = ctypes.get_errno()
        raise DiskError(err, f"mounting a {size_mb} MiB tmpfs on {path}: {os.strerror(err)}")


def _unmount(path: str) -> None:
    err = detach(path)
    if err:
        raise DiskError(err, f"unmounting {path}: {os.strerror(err)}")


def mounts() -> dict[str, str]:
    """The capped directories of this machine's kernelexec hosts: path -> source."""
    return {
        path: source
        for path, kind, source in mount_points()
        if kind == "tmpfs" and source.startswith(_SOURCE_PREFIX)
    }


def cap(path: str, size_mb: int, uid: int) -> None:
    """Make the directory ``path`` a tmpfs of ``size_mb`` MiB owned by ``uid``, with what it
    held moved in (nothing when it is one already).

    Raises:
        DiskError: the mount failed, or what the directory holds does not fit in ``size_mb``
            (then the directory is left as it was).
    """
    path = os.path.realpath(path)
    if path in mounts():
        return
    os.makedirs(path, exist_ok=True)
    held = os.listdir(path)
    aside = ""
    if held:
        aside = tempfile.mkdtemp(prefix=ASIDE_PREFIX, dir=os.path.dirname(path))
        os.rmdir(aside)
        os.rename(path, aside)
        os.mkdir(path, 0o700)
    try:
        _mount(path, size_mb, uid)
    except BaseException:
        if aside:
            os.rmdir(path)
            os.rename(aside, path)
        raise
    if not aside:
        return
    try:
        left_out = copy_tree(aside, path, outside_links=False)
    except OSError as exc:
        _unmount(path)
        os.rmdir(path)
        os.rename(aside, path)
        if exc.errno == errno.ENOSPC:
            raise DiskError(
                errno.ENOSPC,
                f"the working directory {path} holds more than max_disk_mb={size_mb} MiB",
            ) from None
        raise
    _trees.remove(aside)
    if left_out:
        log.warning("left out of the capped directory %s: %r", path, left_out)


def uncap(path: str) -> None:
    """Copy what the tmpfs at ``path`` holds back onto the host's disk at ``path`` and remove
    the mount (nothing when ``path`` is not capped)."""
    path = os.path.realpath(path)
    if path not in mounts():
        return
    out = tempfile.mkdtemp(prefix=".kx-out-", dir=os.path.dirname(path))
    try:
        left_out = _copy(path, out)
    except TreeLimitError as exc:
        # The tenant's own doing (a tree past the walk's bounds): what was copied is kept and
        # the mount goes, or it would outlive every host.
        left_out = {f"(the copy stopped: {exc})": str(exc)}
    except BaseException:
        # The host's trouble (out of space or descriptors): the mount stays, with every file,
        # for a later try (this host's next start of the session, or the next host's sweep).
        _trees.remove(out)
        raise
    _tell_left_out(path, left_out)
    _unmount(path)
    with contextlib.suppress(OSError):  # emptied when it was capped; a stale mount may hide more
        os.rmdir(path)
    if os.path.lexists(path):
        _trees.remove(path)
    os.rename(out, path)


def show_to(pid: int, path: str) -> None:
    """Put the host's mount at ``path`` into the mount namespace of process ``pid``, at the same
    path (see the module's docstring); about a millisecond, through the namespace helper.

    Raises:
        DiskError: it did not work (the message has the helper's reason).
    """
    try:
        _nshelper.request("show", pid=pid, path=os.path.realpath(path))
    except _nshelper.HelperError as exc:
        why = exc.strerror
        raise DiskError(errno.EIO, f"giving the kernel its capped directory: {why}") from None


_swept = False


def sweep_once() -> list[str]:
    """:func:`sweep` the first time it is called in this process (before the temp dir's own
    sweep, which cannot remove a directory that is still a mount point)."""
    global _swept
    if _swept:
        return []
    _swept = True
    return sweep()


def sweep() -> list[str]:
    """Copy back and remove the capped directories of hosts that are gone; one host at a time
    (two hosts starting together would copy the same directory back twice)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return []
    lock = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _sweep()
    finally:
        os.close(lock)


_LOCK = os.path.join(
    "/run" if os.path.isdir("/run") else tempfile.gettempdir(), "kernelexec-disk.lock"
)


def _sweep() -> list[str]:
    done: list[str] = []
    for path, source in mounts().items():
        pid_text, _, start = source[len(_SOURCE_PREFIX) :].partition(":")
        try:
            pid = int(pid_text)
        except ValueError:
            continue
        if process_alive(pid, start):
            continue
        with contextlib.suppress(OSError):
            uncap(path)
            done.append(path)
    return done


def probe_command(target: str) -> list[str]:
    """The command line of the disk helper (:mod:`._helper_disk`) probing ``target``."""
    return _proctitle.helper_command(_proctitle.DISK_HELPER, _PROBE, target)


_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_helper_disk.py")


@lru_cache(maxsize=1)
def support() -> str | None:
    """Whether capped working directories work on this host: None when they do, else why not.

    Tried once per host process: a 1 MiB tmpfs is mounted on a temporary directory and shown
    to a child in a mount namespace of its own, which must see the file written there.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the host is not root"
    probe = tempfile.mkdtemp(prefix="kxdisk-")
    target = os.path.join(probe, "w")
    os.mkdir(target)
    try:
        _mount(target, 1, os.geteuid())
        with open(os.path.join(target, "seen"), "w") as fh:
            fh.write("yes")
        with subprocess.Popen(
            probe_command(target),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd="/",
        ) as child:
            try:
                assert child.stdout is not None
                if child.stdout.readline().strip() != "ready":
                    return "the probe could not take a mount namespace of its own"
                show_to(child.pid, target)
                seen, _ = child.communicate("go\n", timeout=30)
            finally:
                if child.poll() is None:
                    child.kill()
        if seen.strip() != "yes":
            return f"the probe's namespace saw {seen.strip()!r}, not the host's mount"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the probe failed: {exc}"
    finally:
        with contextlib.suppress(OSError):
            _unmount(target)
        shutil.rmtree(probe, ignore_errors=True)


def copy_tree(src: str, dst: str, *, outside_links: bool = True) -> list[str]:
    """Copy the tree at ``src`` into the existing directory ``dst`` by the capped directory's
    copy rule (:data:`kernelexec._workdirs.CAPPED`, as the module's docstring describes); the
    paths left out (relative to ``src``).

    With ``outside_links=False`` a file that also has links outside the tree is left out: a
    link planted to a file elsewhere on the host never reaches a kernel's user (as
    ``_users.hand_over`` never hands such a file over).
    """
    return sorted(_copy(src, dst, outside_links=outside_links))


def _copy(src: str, dst: str, *, outside_links: bool = True) -> dict[str, str]:
    return _workdirs.copy(src, dst, _workdirs.CAPPED, outside_links=outside_links)


def _tell_left_out(path: str, left_out: dict[str, str]) -> None:
    """Log what a copy back left out: a warning for what held data, sockets only at debug
    level (a stopped kernel's ipc sockets, its host killed, are found by the next host's
    sweep; warned of, they reached a notebook's stderr)."""
    sockets = sorted(p for p, why in left_out.items() if why == _trees.SOCKET)
    rest = sorted(p for p in left_out if p not in sockets)
    if rest:
        log.warning("left out of the copy back of %s: %r", path, rest)
    if sockets:
        log.debug("sockets left out of the copy back of %s: %r", path, sockets)
