"""The disk helper's own process: the child that :func:`kernelexec._sandbox._disk.support` shows
a capped directory to, to learn whether capped working directories work on this host.

Run as a script by :func:`kernelexec._proctitle.helper_command` (``-I -S``, as root), never
imported by the host: standard library only (an import contract checks it). It takes a mount
namespace of its own in which the host's mount at the path it is given is not seen, says
``ready``, waits for a line on stdin (the host has shown it the mount meanwhile), and prints
what the file ``seen`` there holds (``nothing`` when it cannot read it).
"""

from __future__ import annotations

import ctypes
import os
import sys

_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
_MNT_DETACH = 2


def main(path: str) -> int:
    """Probe ``path`` (see the module docstring); the exit status."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
    if libc.unshare(_NEWNS) != 0 or libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None):
        return 1
    libc.umount2(
        path.encode(), _MNT_DETACH
    )  # the namespace must not see the host's mount by itself
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        with open(os.path.join(path, "seen")) as fh:
            print(fh.read())
    except OSError:
        print("nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
