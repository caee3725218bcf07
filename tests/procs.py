"""Processes seen through /proc: children of a process whose command line has a marker."""

from __future__ import annotations

from pathlib import Path


def children(ppid: int, *markers: bytes) -> set[int]:
    """Pids of the processes whose parent is ``ppid`` and whose command line contains every
    one of ``markers`` (as a substring of one of its arguments)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] != str(ppid):
            continue
        if all(marker in cmdline for marker in markers):
            found.add(int(entry.name))
    return found
