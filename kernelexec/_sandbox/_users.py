"""Per-kernel unprivileged users on a root host: picking a uid, checking that a user other than
the host's can reach a path, and handing a directory over to a kernel's user.

No account is created: the uid exists only as the owner of the kernel's processes and files.
Uids are handed out by :mod:`kernelexec._sandbox._uids` (one record for the whole machine).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from kernelexec import _trees
from kernelexec._exceptions import TreeLimitError
from kernelexec._paths import within as within  # the loans' rule, re-exported
from kernelexec._tempdirs import KERNEL_UID_BASE as UID_BASE
from kernelexec._workdirs import LAYERS


def is_root() -> bool:
    """Whether the host runs as root (kernels can then run as users of their own)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def blocked(path: str) -> str | None:
    """The first directory on the way to ``path`` that users other than its owner cannot
    search (``"/root (mode 0700)"``), or None when any user can reach ``path``."""
    current = Path("/")
    parts = Path(os.path.realpath(path)).parts[1:]
    for part in ("", *parts):
        if part:
            current = current / part
        try:
            st = current.stat()
        except OSError:
            return None  # not there yet: whoever creates it decides
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return f"{current} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def allow_search(path: str) -> None:
    """Add search permission for everyone (not read) to the directory ``path``."""
    if os.path.isdir(path):
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o011)


_OWNERSHIP = _trees.Bounds(entries=10_000_000)
"""An ownership walk moves no data: it takes any honest directory (a ``node_modules``, a
dataset), and a capped one's inode cap is far below."""


def hand_back(path: str, uid: int) -> None:
    """Give what ``uid`` owns in ``path`` back to the host's user (the kernel has ended).

    The uid is released once its kernel has ended, and nothing a kernel made may stay owned
    by a uid that a much later kernel could get again. Walked as every tenant tree is
    (:mod:`kernelexec._trees`); what lies past the walk's bounds stays the uid's.
    """
    host = os.geteuid()
    try:
        top = _trees.open_top(path)
    except FileNotFoundError:
        return
    try:
        if os.fstat(top).st_uid == uid:
            os.fchown(top, host, host)
        with contextlib.suppress(TreeLimitError):
            _trees.change_owners(
                top, host, _OWNERSHIP, which=lambda st: st.st_uid == uid, where=path
            )
    finally:
        os.close(top)


def hand_over(path: str, uid: int) -> None:
    """Give ``path`` and everything under it to ``uid`` (group too), the top mode 0700.

    Walked as every tenant tree is (:mod:`kernelexec._trees`: the tree may hold what an
    earlier kernel planted; links are changed themselves, never followed). Only what belongs
    to the host or to a kernel user changes hands, and never a file with a second hard link
    (a planted link to a host file would hand that file over). The host's own :data:`LAYERS`
    folder at the top stays the host's, but for the upper layers in it (what the kernel wrote,
    which it sees through the mount only).

    Raises:
        TreeLimitError: the tree passes a bound of the walk.
    """
    host = os.geteuid()

    def ours(st: os.stat_result) -> bool:
        return st.st_uid == host or st.st_uid >= UID_BASE

    top = _trees.open_top(path)
    try:
        os.fchown(top, uid, uid)
        os.fchmod(top, 0o700)
        skip: frozenset[str] = frozenset()
        if _hosts_alone(top, LAYERS):
            skip = frozenset({LAYERS})
            _hand_over_uppers(top, uid, ours)
        _trees.change_owners(top, uid, _OWNERSHIP, which=ours, where=path, skip_top=skip)
    finally:
        os.close(top)


def _hosts_alone(parent: int, name: str) -> bool:
    """Whether ``name`` in ``parent`` is a directory (not a link) of the host's that no one
    else may enter."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _hand_over_uppers(top: int, uid: int, ours: Callable[[os.stat_result], bool]) -> None:
    """Give the upper layers in the host's :data:`LAYERS` folder of ``top`` to ``uid``."""
    layers = _trees.open_dir(top, LAYERS)
    try:
        for name in os.listdir(layers):
            if not _hosts_alone(layers, name):
                continue
            folder = _trees.open_dir(layers, name)
            try:
                upper = _trees.open_dir(folder, "upper")
            except OSError:
                continue
            finally:
                os.close(folder)
            try:
                os.fchown(upper, uid, uid)
                _trees.change_owners(
                    upper, uid, _OWNERSHIP, which=ours, where=f"{LAYERS}/{name}/upper"
                )
            finally:
                os.close(upper)
    finally:
        os.close(layers)


def kernel_path(python: str, path: str | None, *, own_user: bool) -> str:
    """The ``PATH`` of a local kernel: its interpreter's directory first, so ``python`` in
    a subprocess is the kernel's own interpreter, then the host's entries, less those a
    kernel's own user could not reach (a pyenv shim under ``/root`` would shadow the rest
    with "permission denied" or "not found").

    The interpreter's directory is taken as given, not resolved: a virtual environment's
    ``bin`` is the directory whose ``python`` has the environment's packages.
    """
    entries = [os.path.dirname(os.path.abspath(python))]
    for entry in (path or os.defpath).split(os.pathsep):
        if not entry or entry in entries:
            continue
        if own_user and blocked(entry) is not None:
            continue
        entries.append(entry)
    return os.pathsep.join(entries)
