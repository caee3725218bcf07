"""A local kernel's private directory: its connection file and ipc sockets, made fresh for each
kernel, sealed from the kernel's user once its branches may run as that user, and removed when
it is shut down (again later when the host was out of descriptors)."""

from __future__ import annotations

import contextlib
import os
import tempfile

from kernelexec._exceptions import KernelStartError
from kernelexec._tempdirs import make_owned_dir, remove_tree

# An ipc socket's path must fit in sun_path: 108 bytes with the terminating NUL. Ours are
# <tempdir>/kx-XXXXXXXX/s-<n>: jupyter-client numbers a kernel's ipc sockets 1 to 5.
_SUN_PATH_MAX = 107
_SOCKET_SUFFIX = "kx-XXXXXXXX/s-5"

_LEFT_DIRS: set[str] = set()
"""Kernel directories that could not be removed (the host was out of descriptors): tried again
at every later shutdown and when the backend is released."""


def make() -> str:
    """A fresh private directory for a kernel.

    Raises:
        KernelStartError: the temp directory is too long to hold a kernel's ipc sockets.
    """
    _check_socket_room()
    return make_owned_dir("kx-")


def remove(path: str) -> None:
    """Remove a kernel's directory (remembered to try again when it cannot be)."""
    remove_tree(path)
    if os.path.lexists(path):
        _LEFT_DIRS.add(path)


def remove_left() -> None:
    """Try again to remove the directories that could not be removed before."""
    for path in list(_LEFT_DIRS):
        remove_tree(path)
        if not os.path.lexists(path):
            _LEFT_DIRS.discard(path)


def _check_socket_room() -> None:
    """Refuse, with the fix, a temp directory too long to hold a kernel's ipc sockets (zmq
    would fail deep in jupyter-client with "File name too long")."""
    root = tempfile.gettempdir()
    needed = len(os.fsencode(os.path.join(root, _SOCKET_SUFFIX)))
    if needed > _SUN_PATH_MAX:
        raise KernelStartError(
            f"the temp directory {root!r} is too long for a kernel's ipc sockets: their paths "
            f"would be {needed} bytes, and a Unix socket path may have at most {_SUN_PATH_MAX}. "
            "Point TMPDIR at a shorter directory (for example TMPDIR=/tmp)."
        )


def seal(kdir: str, uid: int | None) -> None:
    """Take a running kernel's connection file and socket files in ``kdir`` back from its
    user (``uid``; nothing to do when None): its branches run as the same user, and must
    neither read its key nor connect to its channels. The host (root) still can."""
    if uid is None:
        return
    for entry in os.scandir(kdir):
        if entry.name == "kernel.json" or entry.name.startswith("s-"):
            with contextlib.suppress(OSError):
                os.chown(entry.path, os.geteuid(), os.getegid(), follow_symlinks=False)
                os.chmod(entry.path, 0o600, follow_symlinks=False)
