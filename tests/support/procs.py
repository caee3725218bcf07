"""Processes the tests look for (through psutil): whether one still runs, its descendants,
children of a process whose command line has a marker, and every process whose command line
mentions a path; a signal that reaches a process through a thread other than its main one."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterable

import psutil


def _cmdline(proc: psutil.Process) -> bytes:
    """The command line as ``/proc/<pid>/cmdline`` has it: arguments each ended by a NUL."""
    return b"".join(arg.encode() + b"\0" for arg in proc.cmdline())


def running(process: psutil.Process | int) -> bool:
    """Not a zombie, and not gone: a process may end, and be reaped, at any moment between a
    listing that found it and this look at it."""
    try:
        proc = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pids: Iterable[int]) -> set[int]:
    """Pids of every process below ``pids`` now (one of ``pids`` may be gone)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
    return found


def children(ppid: int, *markers: bytes) -> set[int]:
    """Pids of the processes whose parent is ``ppid`` and whose command line contains every
    one of ``markers`` (a NUL in a marker ends an argument)."""
    found = set()
    try:
        kids = psutil.Process(ppid).children()
    except psutil.NoSuchProcess:
        return found
    for child in kids:
        try:
            cmdline = _cmdline(child)
        except psutil.Error:
            continue
        if all(marker in cmdline for marker in markers):
            found.add(child.pid)
    return found


def mentioning(text: str) -> list[psutil.Process]:
    """Every process whose command line mentions ``text``."""
    found = []
    needle = text.encode()
    for proc in psutil.process_iter():
        try:
            if needle in _cmdline(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


FORK_SERVER = "kernelexec fork server"
LAUNCHER = "kernelexec launcher"
KERNEL = "kernelexec kernel"
_SOURCE_MARKS = {FORK_SERVER: "# kernelexec fork server", LAUNCHER: "# kernelexec launcher"}
"""What the command line holds for the moment before a process titles itself (its source)."""


def title(proc: psutil.Process) -> str:
    """The command line as ``ps`` shows it (arguments joined by spaces)."""
    return " ".join(proc.cmdline())


def kind(proc: psutil.Process) -> str | None:
    """Which of kernelexec's processes ``proc`` is: ``"fork server"``, ``"launcher"`` or
    ``"kernel"`` (by its title, or by its source before it has titled itself), else None.

    Raises:
        psutil.Error: the process is gone or cannot be read.
    """
    shown = title(proc)
    for name, what in ((FORK_SERVER, "fork server"), (LAUNCHER, "launcher")):
        if shown.startswith(name) or _SOURCE_MARKS[name] in shown:
            return what
    if shown.startswith(KERNEL) or "ipykernel" in shown:
        return "kernel"
    return None


def of_kind(ppid: int, what: str) -> set[int]:
    """Pids of the children of ``ppid`` that are kernelexec's ``what`` (see :func:`kind`)."""
    found = set()
    try:
        kids = psutil.Process(ppid).children()
    except psutil.NoSuchProcess:
        return found
    for child in kids:
        try:
            if kind(child) == what:
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


def signal_another_thread(pid: int, signum: int) -> int:
    """Send ``signum`` to a thread of process ``pid`` other than its main thread, one that does
    not block it, as Linux may hand a process-wide signal to any such thread; its id.

    Python runs its signal handlers in the main thread only; this is the case where that
    thread was not the one the signal reached.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    for tid in sorted(int(name) for name in os.listdir(f"/proc/{pid}/task")):
        if tid == pid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                blocked = next(line for line in fh if line.startswith("SigBlk:"))
        except (OSError, StopIteration):
            continue  # the thread ended
        if int(blocked.split()[1], 16) & (1 << (signum - 1)):
            continue
        if libc.tgkill(pid, tid, signum) == 0:
            return tid
    raise AssertionError(f"no thread of process {pid} but its main one takes signal {signum}")
