"""Awaiting work that must end even when its caller is cancelled (stopping code, shutdowns).

``asyncio.shield`` alone does not do it: the shielded work goes on, but the caller returns at
once, and under anyio's task groups a cancelled caller is cancelled again at every later await,
so work that was meant to finish first (deleting a gateway kernel, replacing a stuck one) is
left running on its own, or never finishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_shielded(work: Awaitable[T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled (again) meanwhile, and return
    its result; those cancellations are absorbed (the caller raises its own afterwards)."""
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise


async def finish_then_cancel(work: Awaitable[T]) -> T:
    """:func:`finish_shielded`, then raise ``CancelledError`` if the caller was cancelled
    while ``work`` ran: the cancellation waits for the work instead of being lost."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
