"""``Lifecycle``: the one way kernelexec's objects know whether they are open, and the one error
that use after close raises (``ExecutorClosedError``, naming what was closed)."""

from __future__ import annotations

import enum

from kernelexec._exceptions import ExecutorClosedError


class Phase(enum.Enum):
    """Where an object is in its life."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class Lifecycle:
    """An object's phase; ``check()`` raises once it is closed.

    Args:
        what: How the error names the object (``"the executor"``, ``"session 'a'"``).
        opened: Start in the open phase (objects that are usable once made).
    """

    def __init__(self, what: str, *, opened: bool = False) -> None:
        self.what = what
        self.phase = Phase.OPEN if opened else Phase.UNOPENED

    @property
    def is_open(self) -> bool:
        """Whether the object is open now."""
        return self.phase is Phase.OPEN

    @property
    def closed(self) -> bool:
        """Whether the object was closed."""
        return self.phase is Phase.CLOSED

    def open(self) -> None:
        """Move to the open phase (only from unopened)."""
        self.check()
        self.phase = Phase.OPEN

    def close(self) -> bool:
        """Move to the closed phase; True the first time (so closing work runs once)."""
        if self.phase is Phase.CLOSED:
            return False
        self.phase = Phase.CLOSED
        return True

    def check(self) -> None:
        """Raise :class:`ExecutorClosedError` if the object is closed."""
        if self.phase is Phase.CLOSED:
            raise ExecutorClosedError(f"{self.what} is closed")
