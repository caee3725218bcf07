"""Lending a host directory to a kernel that runs as its own user.

At ``"process"`` (and ``"bwrap"``) on a root host a kernel runs as a user of its own, with a
private ``/tmp`` and the directories other users cannot search hidden from it: a directory of
the host's user (Letta's ``sandbox_dir`` under ``/root``, a project under the host's ``/tmp``)
is out of its reach. Lending shows such a directory to one session's kernels, at the same path
(the namespace helper does the mounting, :mod:`._nshelper`), in one of three modes:

- ``"own"``, for a directory the operator means for kernels (Letta's ``tool_execution_dir``):
  copy on write, the kernel seeing the directory's files as its own user's (an idmapped,
  read-only lower layer), so it may read, change and remove them as Letta's tools do;
- ``"copy"``, for any other directory: copy on write with owners and modes kept, so the kernel
  reads what any local user may, and only a directory that any local user can reach;
- ``"read"``, for import paths: read-only, owners and modes kept, reachable by any local user.

Copy on write, every change goes to a folder of the session's (``.kx-lent/<digest>/upper`` in
its working directory, kept with the session): the host's directory is never written, and no
other session sees the change. What a kernel makes there belongs to its own user, never to the
host's (the overlay is ``nosuid,nodev``). ``.kx-lent`` itself stays the host's (0700; see
``_users.hand_over``), so the kernel reaches its layers only through the mount.

Nothing is mounted on the host, and the mounts end with the kernel's namespace.

A directory that holds, or lies inside, kernelexec's own directories (the temp directory with
the kernels' directories, the sessions' working directories, saved state and recordings) is
refused: lent, it would hand other tenants' files to this kernel.

Only an ordinary directory is lent (issue 41): never one on a pseudo-filesystem (``proc``,
``sysfs``, ``devpts``, ``cgroup``, ... told by ``statfs``), never ``/proc``, ``/sys`` or ``/dev``
or anything under them (the sandbox gives the kernel its own; ``devtmpfs`` reads as an ordinary
``tmpfs``), and never a directory the sandbox itself provides or that holds the host's system
sockets (``/``, ``/tmp``, ``/var/tmp``, ``/run``, ``/var/run``): lent over the kernel's own,
each would hand it the host's processes, devices or services. A directory below ``/run`` or
``/tmp`` that is an ordinary folder may still be lent.

Nothing lent reaches a host socket, FIFO or device: every loan is an overlay (``"read"`` too, a
read-only one whose lower layers are the directory and an empty one), and a socket or FIFO seen
through an overlay is the overlay's own inode, which no host listener or writer shares, while
``nodev`` refuses devices. That holds for one made after the check too (a directory writable by
others), so the tree is not walked.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kernelexec._exceptions import ConfigError
from kernelexec._sandbox import _nshelper
from kernelexec._sandbox._users import blocked, within
from kernelexec._tempdirs import owner_of
from kernelexec._workdirs import LAYERS

_SYSTEM = ("/proc", "/sys", "/dev")
"""Trees the sandbox provides itself: nothing in them is lent."""
_PROVIDED = ("/", "/tmp", "/var/tmp", "/run", "/var/run")
"""Directories the sandbox provides itself, or that hold the host's system sockets: not lent
themselves (an ordinary folder below one may be)."""
_PSEUDO = {
    0x9FA0: "proc",
    0x62656572: "sysfs",
    0x1CD1: "devpts",
    0x27E0EB: "cgroup",
    0x63677270: "cgroup2",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0xCAFE4A11: "bpf",
    0x19800202: "mqueue",
    0x62656570: "configfs",
    0x6165676C: "pstore",
    0xDE5E81E4: "efivarfs",
    0x65735543: "fusectl",
    0x42494E4D: "binfmt_misc",
    0x0187: "autofs",
    0x6E736673: "nsfs",
    0x958458F6: "hugetlbfs",
    0xF97CFF8C: "selinuxfs",
    0x43415D53: "smackfs",
    0x67596969: "rpc_pipefs",
    0x50495045: "pipefs",
    0x534F434B: "sockfs",
}
"""``statfs`` types of the pseudo-filesystems (the kernel's numbers, ``linux/magic.h``)."""
_libc = ctypes.CDLL(None, use_errno=True)

LoanMode = Literal["own", "copy", "read"]
"""How a directory is lent: ``"own"``, copy on write with the host user's files appearing as
the kernel user's (a directory the operator lets kernels use as their own); ``"copy"``, copy on
write with owners and modes kept (the kernel reads what any local user may); ``"read"``,
read-only with owners and modes kept."""


@dataclass(frozen=True)
class Loan:
    """A directory checked for lending: its real path, how, and its identity when checked (the
    helper refuses a directory that is another by the time it opens it)."""

    path: str
    mode: LoanMode
    dev: int
    ino: int


def check(
    path: str | os.PathLike[str],
    mode: LoanMode,
    private: Iterable[str | os.PathLike[str] | None] = (),
) -> Loan:
    """``path`` as a :class:`Loan` if it may be lent in ``mode``, given kernelexec's ``private``
    directories. Blocking (it reads the filesystem).

    Raises:
        ConfigError: it is not a directory; it is (or holds, or lies in) a directory of
            kernelexec's; or, unless lent as the kernel's own, a user other than its owner
            could not reach it (the message names which).
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path or "\0" in path or not path.isprintable():
        raise ConfigError(f"a directory to lend must be a printable, non-empty path, not {path!r}")
    try:
        path.encode()
    except UnicodeEncodeError:
        raise ConfigError(f"a directory to lend must be a valid path, not {path!r}") from None
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        st = None
    if st is None or not os.path.isdir(real):
        raise ConfigError(f"cannot lend {path} to a kernel: it is not a directory")
    _ordinary(path, real)
    temp = os.path.realpath(tempfile.gettempdir())
    if within(temp, real):
        raise ConfigError(
            f"cannot lend {path} to a kernel: it holds {temp}, where kernelexec keeps every "
            "kernel's own directory; lend a directory of its own"
        )
    top = os.path.join(temp, os.path.relpath(real, temp).split(os.sep)[0])
    if within(real, temp) and owner_of(top) is not None:  # by kernelexec's marker, not a name
        raise ConfigError(f"cannot lend {path} to a kernel: it lies in a directory of kernelexec's")
    for mine in private:
        if mine is None:
            continue
        own = os.path.realpath(mine)
        if within(real, own) or within(own, real):
            raise ConfigError(
                f"cannot lend {path} to a kernel: it overlaps {own}, one of the executor's own "
                "directories (working directories, saved state or recordings)"
            )
    if mode != "own":
        hidden = blocked(real)
        if hidden is not None:
            raise ConfigError(
                f"cannot lend {path} to a kernel as any local user sees it: {hidden} keeps "
                "other users out (lend it as the kernel's own only if the operator means it "
                "for kernels)"
            )
    return Loan(real, mode, st.st_dev, st.st_ino)


def _ordinary(path: str, real: str) -> None:
    """Refuse ``real`` unless it is an ordinary directory the sandbox does not provide itself.

    Raises:
        ConfigError: naming what it is.
    """
    for tree in _SYSTEM:
        if within(real, tree):
            raise ConfigError(
                f"cannot lend {path} to a kernel: it lies in {tree}, which the sandbox gives "
                "each kernel its own of (lent, it would show the host's)"
            )
    if real in _PROVIDED:
        raise ConfigError(
            f"cannot lend {path} to a kernel: the sandbox provides {real} itself, and the "
            "host's holds other programs' files and sockets; lend a folder in it"
        )
    kind = _PSEUDO.get(_fs_type(real))
    if kind is not None:
        raise ConfigError(
            f"cannot lend {path} to a kernel: it is on a {kind} filesystem, not an ordinary "
            "directory"
        )


def _fs_type(path: str) -> int:
    """The ``statfs`` type of the filesystem holding ``path`` (0 when it cannot be told)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(path.encode(), buf) != 0:
        return 0
    return int(struct.unpack_from("l", buf.raw)[0]) & 0xFFFFFFFF


def lend(pid: int, loan: Loan, uid: int, workdir: str) -> None:
    """Show ``loan`` to the kernel ``pid`` (running as ``uid``) at the same path; copy on write
    into ``workdir/.kx-lent/<digest of its path>`` unless it is read-only.

    Raises:
        OSError: the host could not do it (the message says why).
    """
    fields: dict[str, object] = {
        "pid": pid,
        "path": loan.path,
        "uid": uid,
        "dev": loan.dev,
        "ino": loan.ino,
        "idmap": loan.mode == "own",
    }
    if loan.mode != "read":
        fields["workdir"] = workdir
        fields["layers"] = LAYERS
        fields["name"] = hashlib.sha256(loan.path.encode()).hexdigest()[:16]
    _nshelper.request("lend", **fields)
