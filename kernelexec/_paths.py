"""``within``: whether one path lies in another, by their text (the sandbox's loans and the
framework adapters' path checks ask it the same way)."""

from __future__ import annotations


def within(inner: str, outer: str) -> bool:
    """Whether the path ``inner`` is ``outer`` or lies in it (both normalised the same way)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")
