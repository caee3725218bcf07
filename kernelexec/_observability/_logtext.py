"""``untrusted``: text a kernel chose (an error's message, a file name, a problem it reported),
made safe to put in a log line.

A kernel's code holds the kernel's key and can make the host log any text it likes: a newline in
that text would start what a reader (or a log shipper that splits on lines) takes for a record of
its own, and an escape sequence could rewrite a terminal. Every log call that formats text from a
kernel passes it through :func:`untrusted` first.
"""

from __future__ import annotations

MAX_CHARS = 2000
"""The most characters of one untrusted text kept in a log line (the rest is counted)."""


def untrusted(value: object, limit: int = MAX_CHARS) -> str:
    """``str(value)`` on one line: control characters and other unprintable ones (newlines,
    carriage returns, escape sequences, Unicode line separators) shown as Python escapes
    (``\\n``, ``\\x1b``, ``\\u2028``), cut to ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii")
