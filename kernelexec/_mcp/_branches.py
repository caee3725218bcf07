"""The MCP server's branching tools: ``fork`` a session into children, ``snapshot`` it, and
``restore`` it to a snapshot (see :meth:`kernelexec.AsyncSession.fork`).

Children are sessions of the client's like any other: a child of a named session is named
``<name>~<k>`` and shared like its parent; a child of the connection's own session is
``default~<k>`` and private to the connection. Snapshots belong to the session they were taken
of (ids ``s1``, ``s2``, ...) and are freed with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mcp_types as types

from kernelexec._mcp._sessions import ClientConnection, SessionEntry, SessionRegistry

if TYPE_CHECKING:
    from kernelexec._core._session import AsyncSession

_SESSION = {
    "type": "string",
    "description": "Session name (default: this connection's own session).",
}
FORK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session": _SESSION,
        "n": {
            "type": "integer",
            "minimum": 1,
            "maximum": 16,
            "description": "How many children (default 1).",
        },
    },
    "additionalProperties": False,
}
SNAPSHOT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"session": _SESSION},
    "additionalProperties": False,
}
RESTORE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session": _SESSION,
        "snapshot": {"type": "string", "description": "The id the snapshot tool returned."},
    },
    "required": ["snapshot"],
    "additionalProperties": False,
}


def branch_tools() -> list[types.Tool]:
    """The branching tools of a kernelexec MCP server."""
    return [
        types.Tool(
            name="fork",
            description=(
                "Branch a session: n new sessions start as exact copies of its live kernel "
                "(variables, imports, definitions, files) and then go their own ways; the "
                "original is unchanged. Use it to try several approaches from one state. "
                "Returns the children's session names."
            ),
            input_schema=FORK_SCHEMA,
        ),
        types.Tool(
            name="snapshot",
            description="Keep a frozen copy of a session's state (kernel and files) to "
            "restore later; returns its id.",
            input_schema=SNAPSHOT_SCHEMA,
        ),
        types.Tool(
            name="restore",
            description="Put a session back exactly to a snapshot taken of it (any number "
            "of times): an undo.",
            input_schema=RESTORE_SCHEMA,
        ),
    ]


def _text(text: str, structured: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structured_content=structured
    )


def _child_name(client: ClientConnection, parent: SessionEntry, child: AsyncSession) -> str:
    suffix = child.agent_id[len(parent.agent_id) :]
    return client.shown_name(parent) + suffix


async def fork(
    client: ClientConnection, registry: SessionRegistry, name: str | None, n: int
) -> types.CallToolResult:
    """Fork the session ``name`` of ``client`` into ``n`` children."""
    shown, entry = client.resolve(name)
    session = await registry.session(entry)
    async with entry.lock:
        children = await session.fork(n)
    names = []
    for child in children:
        child_entry = registry.entry(child.agent_id, shared=entry.shared, user=client.id)
        child_entry.use(child)
        names.append(_child_name(client, entry, child))
    text = f"session {shown!r} forked into {', '.join(repr(c) for c in names)}"
    return _text(text, {"session": shown, "children": names})


async def snapshot(
    client: ClientConnection, registry: SessionRegistry, name: str | None
) -> types.CallToolResult:
    """Snapshot the session ``name`` of ``client``."""
    shown, entry = client.resolve(name)
    session = await registry.session(entry)
    async with entry.lock:
        snap = await session.snapshot()
    entry.snapshot_count += 1
    snap_id = f"s{entry.snapshot_count}"
    entry.snapshots[snap_id] = snap
    text = f"session {shown!r}: snapshot {snap_id!r} kept"
    return _text(text, {"session": shown, "snapshot": snap_id})


async def restore(
    client: ClientConnection, registry: SessionRegistry, name: str | None, snap_id: str
) -> types.CallToolResult:
    """Restore the session ``name`` of ``client`` to its snapshot ``snap_id``."""
    shown, entry = client.resolve(name)
    snap = entry.snapshots.get(snap_id)
    if snap is None:
        known = ", ".join(sorted(entry.snapshots)) or "none"
        raise LookupError(f"session {shown!r} has no snapshot {snap_id!r} (it has: {known})")
    session = await registry.session(entry)
    async with entry.lock:
        await session.restore(snap)
        entry.last_outcome = f"restored to snapshot {snap_id}"
    text = f"session {shown!r} restored to snapshot {snap_id!r}"
    return _text(text, {"session": shown, "snapshot": snap_id, "restored": True})
