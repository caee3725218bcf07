"""Taking user namespaces away from a kernel: a seccomp filter the launcher installs before the
kernel starts, so ``unshare -U``, ``clone(CLONE_NEWUSER)`` and ``clone3`` fail for the kernel
and everything it starts.

A user namespace makes its creator "root" inside it, which opens kernel code paths (mounts,
network configuration, many filesystems) to an unprivileged tenant: the most common start of
a local privilege escalation. bubblewrap's ``--disable-userns`` needs bwrap itself in a user
namespace, which root-run bwrap (the uid drop happens inside, through setpriv) is not, so the
filter is the one mechanism for both levels.

``clone3`` passes its flags in memory seccomp cannot read, so it is answered ``ENOSYS``; the C
library then falls back to ``clone``, whose flags the filter does read (what Flatpak and
container runtimes do). x86-64 and aarch64; elsewhere nothing is installed and
:func:`supported` says so.

:data:`SOURCE` is standard-library text the launcher runs (``drop_userns()``).
"""

from __future__ import annotations

import os

ARCHES = ("x86_64", "aarch64")

# jupyter-client substitutes "{name}" in every argument of a kernel's command line: this text
# (part of the launcher's) must contain none.
SOURCE = r"""
def drop_userns():
    # A seccomp filter: unshare/clone with CLONE_NEWUSER -> EPERM, clone3 -> ENOSYS, x32 -> EPERM.
    import ctypes, os, struct
    arches = dict(x86_64=(0xC000003E, 56, 272), aarch64=(0xC00000B7, 220, 97))
    machine = os.uname().machine
    if machine not in arches:
        return False
    arch, clone, unshare = arches[machine]
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [
        (ld, 0, 0, 4),  # 0: arch
        (jeq, 0, 7, arch),  # 1: another arch -> allow
        (ld, 0, 0, 0),  # 2: syscall number
        (jge, 6, 0, 0x40000000),  # 3: x32 -> deny
        (jeq, 6, 0, 435),  # 4: clone3 -> ENOSYS
        (jeq, 1, 0, clone),  # 5: clone -> flags
        (jeq, 0, 2, unshare),  # 6: unshare -> flags, else allow
        (ld, 0, 0, 16),  # 7: low word of the first argument (the flags)
        (jset, 1, 0, 0x10000000),  # 8: CLONE_NEWUSER -> deny
        (ret, 0, 0, allow),  # 9
        (ret, 0, 0, eperm),  # 10
        (ret, 0, 0, enosys),  # 11
    ]
    code = b"".join(struct.pack("HBBI", *op) for op in program)
    buf = ctypes.create_string_buffer(code, len(code))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(program), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() != 0:
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: needed without CAP_SYS_ADMIN
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        err = ctypes.get_errno()
        raise OSError(err, "installing the seccomp filter: " + os.strerror(err))
    return True
"""


def supported() -> bool:
    """Whether the launcher can take user namespaces away on this machine's architecture."""
    return os.uname().machine in ARCHES
