"""Asking a kernel half: one shell request to a kernel and its reply, on any backend.

The kernel halves that serve kernelexec's own shell messages (files, commands, branching) are
asked through :func:`ask`; a reply that does not come in time, or a kernel that dies meanwhile,
is a :class:`Stalled` value the caller turns into its own error (it knows what was lost).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kernelexec.backends._base import KernelConnection, KernelDied, KernelMessage


@dataclass(frozen=True, slots=True)
class Stalled:
    """No reply within the time allowed (``died``: the kernel died meanwhile)."""

    died: KernelDied | None = None


async def ask(
    conn: KernelConnection,
    msg_type: str,
    content: dict[str, Any],
    *,
    reply_type: str,
    timeout: float,
    metadata: dict[str, Any] | None = None,
    buffers: tuple[bytes, ...] = (),
) -> KernelMessage | Stalled:
    """Send one shell request and wait for its reply (other messages are passed over: the
    caller holds the session, so they can only be late ones of a finished run)."""
    msg_id = await conn.send("shell", msg_type, content, metadata=metadata, buffers=buffers)
    return await wait_reply(conn, msg_id, reply_type, timeout)


async def wait_reply(
    conn: KernelConnection, msg_ids: str | Collection[str], reply_type: str, timeout: float
) -> KernelMessage | Stalled:
    """The reply of type ``reply_type`` to ``msg_ids`` (the first to come when several are
    awaited: the kernel answers its shell requests in order), or :class:`Stalled` after
    ``timeout``."""
    ids = {msg_ids} if isinstance(msg_ids, str) else msg_ids
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Stalled()
        msg = await conn.receive(left)
        if msg is None:
            continue
        if isinstance(msg, KernelDied):
            return Stalled(died=msg)
        if msg.parent_id in ids and msg.channel == "shell" and msg.msg_type == reply_type:
            return msg
