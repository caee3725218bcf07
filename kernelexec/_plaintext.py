"""``strip_ansi``: text from a kernel (a traceback, its output) as plain text for a reader that
is no terminal: a model, an MCP client.

IPython colours its tracebacks with ANSI escape sequences: about twice the characters, and noise
to a model; code may also print any escape sequence it likes (a terminal title, a clipboard
write, a reset).
"""

from __future__ import annotations

import re

_ESCAPES = re.compile(
    r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\|$)"  # OSC: title, clipboard (52), links (8), ...
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\|$)"  # DCS, SOS, PM, APC strings
    r"|\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, erasing
    r"|\x1b[ -/]*[0-~]"  # the other escape sequences (ESC c resets the terminal)
    r"|\x1b"  # a lone ESC
    r"|\x9d[^\x07\x9c]*(?:\x07|\x9c|$)"  # 8-bit OSC
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
    r"|[\x80-\x9f]"  # C1 controls (8-bit CSI and OSC among them)
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 except \t \n \r


def strip_ansi(text: str) -> str:
    """``text`` as plain text: no terminal control sequences (colours, cursor moves, OSC
    titles, clipboard writes and links, resets), no control characters but tab and newline,
    and carriage returns applied as a terminal would (``"50%\\r100%"`` shows ``100%``).
    """
    text = _ESCAPES.sub("", text)
    if "\r" in text:
        text = "\n".join(_overwritten(line) for line in text.replace("\r\n", "\n").split("\n"))
    return _CONTROLS.sub("", text)


def _overwritten(line: str) -> str:
    """What a terminal shows of ``line``: each carriage return writes over it from column 0."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part) :]
    return shown
