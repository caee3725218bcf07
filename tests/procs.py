"""Processes the tests look for (through psutil): children of a process whose command line has
a marker, and every process whose command line mentions a path."""

from __future__ import annotations

import psutil


def _cmdline(proc: psutil.Process) -> bytes:
    """The command line as ``/proc/<pid>/cmdline`` has it: arguments each ended by a NUL."""
    return b"".join(arg.encode() + b"\0" for arg in proc.cmdline())


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
