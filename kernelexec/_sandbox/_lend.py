"""Lending a host directory to a kernel that runs as its own user.

At ``"process"`` (and ``"bwrap"``) on a root host a kernel runs as a user of its own, with a
private ``/tmp`` and the directories other users cannot search hidden from it: a directory of
the host's user (Letta's ``sandbox_dir`` under ``/root``, a project under the host's ``/tmp``)
is out of its reach. Lending shows such a directory to one kernel, at the same path, in one of
two ways (the namespace helper does the mounting, :mod:`._nshelper`):

- **copy on write** (into a session's working directory): the kernel sees the directory's files
  as its own user's (an idmapped, read-only lower layer) and may change them, but every change
  goes to a folder of its session's (``.kx-lent/<digest>`` in the working directory, kept with
  the session): the host's directory is never written, and no other session sees the change.
  What a kernel makes there belongs to its own user, never to the host's (the overlay is
  ``nosuid,nodev``).
- **read-only**: the directory as it is, with its owners and modes, so the
  kernel reads what other users may (an import path).

Nothing is mounted on the host, and the mounts end with the kernel's namespace.

A directory that holds, or lies inside, kernelexec's own directories (the temp directory with
the kernels' directories, the sessions' working directories, saved state and recordings) is
refused: lent as its owner's, it would hand other tenants' files to this kernel.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable

from kernelexec._exceptions import ConfigError
from kernelexec._sandbox import _nshelper
from kernelexec._tempdirs import PREFIXES

LAYERS = ".kx-lent"
"""The folder of a session's working directory holding the layers of what is lent to it copy on
write (the namespace helper makes it by this name)."""


def check(
    path: str | os.PathLike[str], private: Iterable[str | os.PathLike[str] | None] = ()
) -> str:
    """The real path of ``path`` if it may be lent, given kernelexec's ``private`` directories.

    Raises:
        ConfigError: it is not a directory, or it is (or holds, or lies in) a directory of
            kernelexec's (the message names which).
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"a directory to lend must be a non-empty path, not {path!r}")
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise ConfigError(f"cannot lend {path} to a kernel: it is not a directory")
    temp = os.path.realpath(tempfile.gettempdir())
    if _within(temp, real):
        raise ConfigError(
            f"cannot lend {path} to a kernel: it holds {temp}, where kernelexec keeps every "
            "kernel's own directory; lend a directory of its own"
        )
    if _within(real, temp) and os.path.relpath(real, temp).split(os.sep)[0].startswith(PREFIXES):
        raise ConfigError(f"cannot lend {path} to a kernel: it lies in a directory of kernelexec's")
    for mine in private:
        if mine is None:
            continue
        own = os.path.realpath(mine)
        if _within(real, own) or _within(own, real):
            raise ConfigError(
                f"cannot lend {path} to a kernel: it overlaps {own}, one of the executor's own "
                "directories (working directories, saved state or recordings)"
            )
    return real


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def lend(pid: int, path: str, uid: int, workdir: str | None) -> None:
    """Show the host directory ``path`` to the kernel ``pid`` (running as ``uid``) at the same
    path: copy on write into ``workdir/.kx-lent/<digest of path>``, or read-only when
    ``workdir`` is None.

    Raises:
        OSError: the host could not do it (the message says why).
    """
    if workdir is None:
        _nshelper.request("lend", pid=pid, path=path, uid=uid)
        return
    name = hashlib.sha256(path.encode()).hexdigest()[:16]
    _nshelper.request("lend", pid=pid, path=path, uid=uid, workdir=workdir, name=name)
