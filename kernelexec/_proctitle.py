"""Process titles: every process kernelexec starts names itself in ``ps`` (``kernelexec fork
server``, ``kernelexec launcher``, ``kernelexec kernel <agent id> [<isolation>]``, ``kernelexec
ns helper``, ``kernelexec disk helper``, ``kernelexec command`` for a command's supervisor).

:func:`set_title` does what ``setproctitle`` does, by hand and with the standard library only,
because it runs in processes whose interpreter may lack any package: it overwrites the memory
that ``/proc/<pid>/cmdline`` shows (the original ``argv``, located through ``/proc/self/stat``)
and sets the thread name ``top`` and ``ps -e`` show (``prctl(PR_SET_NAME)``). The title is cut
to the length of the original command line. Where it cannot (not Linux), nothing changes.

Two ways in: processes started with ``-c`` (the fork server, the launcher, a plain kernel's
launch line, the kernel side, a command's supervisor) carry :data:`SOURCE`, the text of
:func:`set_title`; the host-wide helpers are modules of their own, run as scripts by this module
(:func:`helper_command`), which titles the process before it runs the helper. This module
imports only the standard library.
"""

from __future__ import annotations

import sys


def set_title(title: str, comm: str | None = None) -> bool:
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
        try:  # noqa: SIM105 (no contextlib: it would cost every process a few ms to start)
            ctypes.CDLL(None).prctl(15, str(comm).encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass
    return True


FORK_SERVER = "kernelexec fork server"
LAUNCHER = "kernelexec launcher"
NS_HELPER = "kernelexec ns helper"
DISK_HELPER = "kernelexec disk helper"
COMMAND = "kernelexec command"
"""A background command's supervisor (in the kernel; the command itself keeps its own title)."""
KERNEL = "kernelexec kernel"
NO_AGENT = "(pool)"
"""Shown in place of an agent id until a session takes the kernel."""

COMMS = {
    FORK_SERVER: "kx-forkserver",
    LAUNCHER: "kx-launcher",
    KERNEL: "kx-kernel",
    NS_HELPER: "kx-ns-helper",
    DISK_HELPER: "kx-disk-helper",
    COMMAND: "kx-command",
}
"""The short names (15 bytes at most) ``ps -e`` and ``top`` show."""


def kernel_title(agent_id: str | None, isolation: str) -> str:
    """A kernel's title: ``kernelexec kernel <agent id> [<isolation>]``."""
    return f"{KERNEL} {agent_id if agent_id is not None else NO_AGENT} [{isolation}]"


def helper_command(title: str, script: str, *args: str) -> list[str]:
    """The command line of a host-wide helper: the standard-library module at ``script`` run
    with ``args`` by a fresh interpreter (``-I -S``: nothing of the environment, the user's
    site or the installed packages) in a process titled ``title``."""
    return [sys.executable, "-I", "-S", __file__, title, COMMS[title], script, *args]


def _source() -> str:
    import inspect

    # jupyter-client substitutes "{name}" in a plain kernel's arguments: the text holds none.
    return inspect.getsource(set_title) + "\n\nkx_set_title = set_title\n"


if __name__ != "__main__":
    SOURCE = _source()
    """The text of :func:`set_title` (also named ``kx_set_title``), for ``-c`` processes."""
else:  # a helper (see helper_command): titled first, then run as the main module
    set_title(sys.argv[1], sys.argv[2])
    sys.argv = sys.argv[3:]
    with open(sys.argv[0], "rb") as script:  # not runpy: a quarter of the helper's start
        helper = compile(script.read(), sys.argv[0], "exec")
    exec(helper, {"__name__": "__main__", "__file__": sys.argv[0], "__builtins__": __builtins__})
