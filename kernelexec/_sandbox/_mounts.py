"""Bridging: how a kernel running as its own user reaches the few paths it needs under a
directory other users cannot search (``/root`` holding the interpreter, a 0700 temp root
holding the working directories), with the rest of that directory hidden from it.

On a root host at ``isolation="process"``, the kernel's process (still root, before it drops to
its uid) takes a private mount namespace, and for each blocked directory ``D``: opens each
needed path under ``D``, mounts a small read-only tmpfs (0755) over ``D``, recreates the path
chain inside it and binds each needed path back from the descriptor it opened. The kernel then
sees ``D`` holding only those paths, which keep their own owners and modes; everything else
under ``D`` is gone from its view. Nothing changes for the host: ``/`` is made private first, so
no mount propagates back, and the namespace ends with the last process of the kernel.

The same namespace holds the kernel's private scratch space: one size-capped tmpfs over
``/tmp`` (``max_disk_mb``) with ``/var/tmp`` and ``/dev/shm`` bound from directories in it, the
paths the kernel needs under ``/tmp`` bound back, and (with it) an IPC namespace of its own, so
nothing a tenant plants there reaches another and nothing outlives the kernel. A needed path may
also be a single file (a build's local wheel in a private directory): it is bound onto an empty
file.

:data:`SOURCE` is standard-library code the launcher runs as text (``bridge(bridges, scratch)``);
:func:`plan` decides on the host which directories to bridge and what to bring back into each;
:func:`support` tries the mechanism once per host process.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from kernelexec._sandbox import _users

# jupyter-client substitutes "{name}" in every argument of a kernel's command line: this text
# (part of the launcher's) must contain none.
SOURCE = r"""
def bridge(bridges, scratch=None):
    # Private mount namespace; each [blocked dir, [needed paths]] bridged. With scratch (size
    # in bytes, keep: paths under /tmp, ipc: bool) a private /tmp, /var/tmp and /dev/shm on one
    # size-capped tmpfs, the kept paths bound back. Root only.
    if not bridges and not scratch:
        return
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p)
    nosuid, nodev, noexec, remount, bind, rec, private = 2, 4, 8, 32, 4096, 16384, 1 << 18

    def mount(source, target, fstype, flags, data, what):
        if libc.mount(source, target.encode(), fstype, flags, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, what + " " + target + ": " + os.strerror(err))

    flags = 0x00020000
    if scratch and scratch["ipc"]:
        flags |= 0x08000000  # CLONE_NEWIPC: SysV objects die with the kernel
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "unshare(CLONE_NEWNS): " + os.strerror(err))
    mount(b"none", "/", None, rec | private, None, "making private")
    cwd = os.getcwd()
    mask = os.umask(0o022)
    # Descriptors first: once a tmpfs is over a directory, its paths are only reachable
    # through them.
    def grab(path):
        return os.open(path, os.O_PATH), path, os.path.isdir(path)

    opened = [[grab(p) for p in paths] for _, paths in bridges]
    kept = [grab(p) for p in scratch["keep"]] if scratch else []

    def bind_back(fds):
        for fd, path, is_dir in fds:
            if is_dir:
                os.makedirs(path, 0o755, exist_ok=True)
            else:  # a single file (a build's local wheel): bound onto an empty one
                os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
            mount(("/proc/self/fd/" + str(fd)).encode(), path, None, bind | rec, None,
                  "binding")
            os.close(fd)

    if scratch:
        size = ("mode=1777,size=" + str(scratch["size"])).encode()
        mount(b"kernelexec", "/tmp", b"tmpfs", nosuid | nodev, size, "mounting a tmpfs over")
        for place, name in (("/dev/shm", ".shm"), ("/var/tmp", ".var-tmp")):
            if os.path.isdir(place) and not os.path.islink(place):
                inner = "/tmp/" + name
                os.mkdir(inner)
                os.chmod(inner, 0o1777)
                mount(inner.encode(), place, None, bind, None, "binding scratch over")
        bind_back(kept)
        # A /proc of its own that shows other users' processes to no one (hidepid, per mount
        # since Linux 5.8): a kernel, its own user, sees its own processes only, never another
        # process's command line. An older kernel refuses "invisible" (its proc options are
        # the pid namespace's, the host's): the host's /proc then stays as it is.
        libc.mount(b"proc", b"/proc", b"proc", nosuid | nodev | noexec, b"hidepid=invisible")
    for (top, _), fds in zip(bridges, opened):
        flags = nosuid | nodev | noexec
        mount(b"kernelexec", top, b"tmpfs", flags, b"mode=0755,size=64k,nr_inodes=4096",
              "mounting a tmpfs over")
        bind_back(fds)
        mount(None, top, None, remount | flags | 1, None, "making read-only")
    os.umask(mask)
    os.chdir(cwd)
"""


class CannotBridge(Exception):
    """A needed path stays out of reach even with bridging (the message says why)."""


def _blockers(path: str) -> list[str]:
    """Every directory from ``/`` down to ``path`` (included) that users other than its owner
    cannot search; the walk stops where the path does not exist yet."""
    found = []
    current = Path("/")
    for part in ("", *Path(path).parts[1:]):
        if part:
            current = current / part
        try:
            st = current.stat()
        except OSError:
            break
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            found.append(str(current))
    return found


def _mode(path: str) -> str:
    return f"{path} (mode {stat.S_IMODE(os.stat(path).st_mode):04o})"


def plan(needed: Iterable[str], handed: Iterable[str] = ()) -> list[tuple[str, list[str]]]:
    """The directories to bridge for a kernel that needs ``needed``, each with the paths to
    bring back into it (``[("/root", ["/root/.pyenv/versions/3.11.7"])]``); empty when every
    path is reachable as it is.

    ``handed`` are needed paths whose own mode does not matter (the backend gives them to the
    kernel's user, or makes them searchable, before the kernel starts); they need not exist yet.

    Raises:
        CannotBridge: a needed path cannot be made reachable (``/`` itself is not searchable,
            or the path or a directory inside another needed path is not).
    """
    given = {os.path.realpath(p) for p in handed}
    paths = sorted({os.path.realpath(p) for p in [*needed, *given]})
    roots = [p for p in paths if not any(q != p and _users.within(p, q) for q in paths)]
    bridges: dict[str, list[str]] = {}
    for path in paths:
        root = next(r for r in roots if _users.within(path, r))
        blockers = [b for b in _blockers(path) if b not in given]
        inside = [b for b in blockers if _users.within(b, root)]
        if inside:
            raise CannotBridge(
                f"{path} is not reachable by other users: {_mode(inside[0])} blocks it"
            )
        if path == root and blockers:
            top = blockers[0]
            if top == "/":
                raise CannotBridge("/ is not searchable by other users")
            bridges.setdefault(top, []).append(root)
    return sorted(bridges.items())


def describe(bridges: list[tuple[str, list[str]]], names: dict[str, str] | None = None) -> str:
    """``"/root shows only /root/.pyenv/versions/3.11.7"``, for the isolation report; paths in
    ``names`` are shown by their name (``"the kernel's own directory"``)."""
    names = {os.path.realpath(k): v for k, v in (names or {}).items()}
    return "; ".join(
        f"{top} shows only {', '.join(names.get(p, p) for p in paths)}" for top, paths in bridges
    )


_PROBE = r"""
import json, os, sys
bridge(json.loads(sys.argv[1]))
top, need = sys.argv[2], sys.argv[3]
print(json.dumps([sorted(os.listdir(top)), sorted(os.listdir(need))]))
"""


@lru_cache(maxsize=1)
def support() -> str | None:
    """Whether bridging works on this host: None when it does, else why not.

    Tried once per host process, in a child (the namespace must not be the host's): a 0700
    directory with a hidden file and a needed directory is bridged, and the child must see the
    needed directory alone.
    """
    if not _users.is_root():
        return "the host is not root"
    probe = tempfile.mkdtemp(prefix="kxprobe-")
    try:
        need = os.path.join(probe, "a", "need")
        os.makedirs(need)
        Path(need, "here").touch()
        Path(probe, "hidden").touch()
        os.chmod(probe, 0o700)
        bridges = plan([need])
        out = subprocess.run(
            [sys.executable, "-I", "-S", "-c", SOURCE + _PROBE, json.dumps(bridges), probe, need],
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
        if out.returncode != 0:
            lines = out.stderr.strip().splitlines()
            return lines[-1] if lines else f"the probe exited with {out.returncode}"
        if json.loads(out.stdout) != [["a"], ["here"]]:
            return f"the probe saw {out.stdout.strip()}, not only the bridged path"
        return None
    except (OSError, subprocess.SubprocessError, ValueError, CannotBridge) as exc:
        return f"the probe failed: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
