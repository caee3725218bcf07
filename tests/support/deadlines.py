"""Deadlines that must pass after a run's first output, on a machine of any load.

A deadline is a duration counted from the request: a test cannot hold it until the kernel has
started the code. On a loaded machine the kernel may not reach the code's first line within a
short one; that attempt ends as a timeout with no output, and is made again with a longer
deadline, until one passes after the output (which the test then checks as it would have).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import pytest

T = TypeVar("T")


class _Printed(Protocol):
    @property
    def stdout(self) -> str: ...


DEADLINES = (1.0, 5.0, 25.0)


def after_output(
    attempt: Callable[[float], T],
    saw_output: Callable[[T], bool],
    deadlines: tuple[float, ...] = DEADLINES,
) -> tuple[T, float]:
    """Call ``attempt(deadline)`` with each of ``deadlines`` in turn until ``saw_output`` says
    its result holds output from before the deadline; return that result and its deadline.

    ``attempt`` checks whatever holds of every timeout (output or not) itself.
    """
    for deadline in deadlines:
        result = attempt(deadline)
        if saw_output(result):
            return result, deadline
    pytest.fail(f"the code printed nothing before any of the deadlines {deadlines} (s)")


def started_before(word: str) -> Callable[[tuple[_Printed, float]], bool]:
    """A ``saw_output`` for attempts that return their result and the ``time.monotonic()`` its
    deadline passed at, whose code prints ``word`` and its own ``time.monotonic()`` as it
    starts: whether the code started before its deadline (CLOCK_MONOTONIC is the machine's,
    the kernel's too)."""

    def in_time(tried: tuple[_Printed, float]) -> bool:
        said, by = tried[0].stdout.split(), tried[1]
        return len(said) == 2 and said[0] == word and float(said[1]) < by

    return in_time
