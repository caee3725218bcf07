"""The tail of a process's stderr log, for the error messages of backends that keep one."""

from __future__ import annotations

import os
from typing import IO


def stderr_tail(handle: IO[bytes] | None, title: str, limit: int = 2000) -> str:
    """``"\\n<title>:\\n<last limit bytes>"`` of the log file ``handle``; ``""`` when there is
    no file, it is empty or it cannot be read."""
    if handle is None:
        return ""
    try:
        size = os.fstat(handle.fileno()).st_size
        start = max(0, size - limit)
        text = os.pread(handle.fileno(), size - start, start).decode(errors="replace").strip()
    except (OSError, ValueError):
        return ""
    return f"\n{title}:\n{text}" if text else ""
