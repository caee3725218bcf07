"""What this process must be allowed to hold for ``max_kernels`` local kernels: open files
(``RLIMIT_NOFILE``) and zmq sockets.

Each local kernel costs the host 8 descriptors (measured: three zmq sockets with a mailbox and
a connection each, the kernel's pidfd and its stderr file; a plain launch 9, with
jupyter-client's control socket instead of the pidfd). Most Linux hosts give a process a
soft limit of 1,024 open files and a much higher hard one: the soft limit is raised as far as
``max_kernels`` needs (not further, so a host application's own ``select()`` on low
descriptors keeps working), with a log line; a hard limit below the need is an error that says
what to change. A zmq context holds at most 1,023 sockets unless told otherwise, so the
context the kernels' clients use is made with room for three per kernel.
"""

from __future__ import annotations

import logging
import resource

from kernelexec._exceptions import HostLimitError

log = logging.getLogger("kernelexec")

FDS_PER_KERNEL = 10
"""Descriptors counted per kernel: 8 measured for a forked kernel, 9 for a plain launch."""

SPARE_FDS = 256
"""Descriptors left for everything else in the process (the event loop, logs, the caller)."""

SOCKETS_PER_KERNEL = 3
"""zmq sockets the host holds per kernel (shell, iopub, control)."""

ZMQ_DEFAULT_SOCKETS = 1023
"""A zmq context's socket cap when nothing sets it (libzmq's ``ZMQ_MAX_SOCKETS_DFLT``)."""


def fds_needed(kernels: int) -> int:
    """Open files this process needs to hold ``kernels`` kernels at once."""
    return kernels * FDS_PER_KERNEL + SPARE_FDS


def sockets_needed(kernels: int) -> int:
    """zmq sockets the kernels' clients need at once (never below zmq's default)."""
    return max(ZMQ_DEFAULT_SOCKETS, kernels * SOCKETS_PER_KERNEL + 64)


_reserved = 0
"""Kernels reserved by the executors of this process that are open now."""


def reserve(kernels: int) -> int:
    """Count ``kernels`` more kernels for this process (an executor was made) and make room
    for all those reserved (see :func:`ensure_open_files`); the total reserved now.

    Raises:
        HostLimitError: the hard limit is lower than the total needs (nothing is counted).
    """
    global _reserved
    ensure_open_files(_reserved + kernels)
    _reserved += kernels
    return _reserved


def unreserve(kernels: int) -> None:
    """An executor that reserved ``kernels`` kernels has closed."""
    global _reserved
    _reserved = max(0, _reserved - kernels)


def ensure_open_files(kernels: int) -> None:
    """Make sure this process may open the files ``kernels`` kernels need: raise the soft
    ``RLIMIT_NOFILE`` when it is lower (logged).

    Raises:
        HostLimitError: the hard limit is lower than needed.
    """
    needed = fds_needed(kernels)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        fits = max(0, (hard - SPARE_FDS) // FDS_PER_KERNEL)
        raise HostLimitError(
            f"max_kernels={kernels} needs about {needed} open files in this process "
            f"({FDS_PER_KERNEL} per kernel and {SPARE_FDS} spare), but its hard limit "
            f"(RLIMIT_NOFILE) is {hard}: use max_kernels={fits} or less, or raise the hard "
            "limit (ulimit -Hn as root, LimitNOFILE= in a systemd unit, nofile in "
            "/etc/security/limits.conf, --ulimit nofile= for a container)"
        )
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (OSError, ValueError) as exc:
        raise HostLimitError(
            f"max_kernels={kernels} needs about {needed} open files in this process; raising "
            f"the soft RLIMIT_NOFILE from {soft} to {needed} failed: {exc}"
        ) from exc
    log.info(
        "raised this process's soft RLIMIT_NOFILE from %d to %d for max_kernels=%d",
        soft,
        needed,
        kernels,
    )
