"""Process titles: every process kernelexec starts names itself in ``ps`` (``kernelexec fork
server``, ``kernelexec launcher``, ``kernelexec kernel <agent id> [<isolation>]``).

:data:`SOURCE` is standard-library Python run as text in those processes (the fork server, the
launcher, a plain kernel's launch line and the kernel side), whose interpreter may lack any
package, so it does what ``setproctitle`` does by hand: it overwrites the memory that
``/proc/<pid>/cmdline`` shows (the original ``argv``, located through ``/proc/self/stat``) and
sets the thread name ``top`` and ``ps -e`` show (``prctl(PR_SET_NAME)``). The title is cut to
the length of the original command line, which for kernelexec's processes holds source code
and runs to hundreds of characters. Where it cannot (not Linux), nothing changes.
"""

from __future__ import annotations

# jupyter-client substitutes "{name}" in a plain kernel's arguments: this text must hold none.
SOURCE = r'''
def kx_set_title(title, comm=None):
    """Show ``title`` as this process's command line (and ``comm`` as its name); False when
    this system does not allow it."""
    import ctypes
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError):
        return False
    size = end - start
    if size < 2:
        return False
    text = "".join(c if c.isprintable() else "?" for c in str(title))
    data = text.encode("utf-8", "replace")[: size - 1]
    data = data.decode("utf-8", "ignore").encode("utf-8")
    # A NUL after the title and none at the end: Linux then shows the title alone.
    ctypes.memmove(start, (data + b"\0").ljust(size, b" "), size)
    if comm:
        try:
            ctypes.CDLL(None).prctl(15, str(comm).encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass
    return True
'''

FORK_SERVER = "kernelexec fork server"
LAUNCHER = "kernelexec launcher"
NS_HELPER = "kernelexec ns helper"
KERNEL = "kernelexec kernel"
NO_AGENT = "(pool)"
"""Shown in place of an agent id until a session takes the kernel."""

COMMS = {
    FORK_SERVER: "kx-forkserver",
    LAUNCHER: "kx-launcher",
    KERNEL: "kx-kernel",
    NS_HELPER: "kx-ns-helper",
}
"""The short names (15 bytes at most) ``ps -e`` and ``top`` show."""


def kernel_title(agent_id: str | None, isolation: str) -> str:
    """A kernel's title: ``kernelexec kernel <agent id> [<isolation>]``."""
    return f"{KERNEL} {agent_id if agent_id is not None else NO_AGENT} [{isolation}]"
