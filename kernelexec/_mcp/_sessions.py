"""Which kernel an MCP request runs in: a default session per client connection, named sessions
shared by name, each closed when the last connection that used it goes away.

A connection's default session has an agent id no client can name (``client-`` and a random
hex id), so two clients never share a kernel unless both pass the same ``session`` name.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernelexec._exceptions import ConfigError

if TYPE_CHECKING:  # the server answers initialize before the kernel machinery is imported
    from kernelexec._assembly._executor import AsyncKernelExecutor
    from kernelexec._branching._family import AsyncSnapshot
    from kernelexec._core._session import AsyncSession

log = logging.getLogger("kernelexec.mcp")

DEFAULT_NAME = "default"
_RESERVED_PREFIX = "client-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,63}")
_BRANCH = re.compile(r"(~[0-9]{1,6}){1,16}")  # default~1~2: a branch of the default session


@dataclass
class SessionEntry:
    """One MCP-visible session: its kernelexec session, who uses it, how its last run ended."""

    agent_id: str
    shared: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: set[str] = field(default_factory=set)
    sessions: list[AsyncSession] = field(default_factory=list)
    runs: int = 0
    last_outcome: str | None = None
    cancelled: int = 0
    last_cancelled: str | None = None
    snapshots: dict[str, AsyncSnapshot] = field(default_factory=dict)
    snapshot_count: int = 0

    def use(self, session: AsyncSession) -> AsyncSession:
        """Note that ``session`` (one per environment the entry ran in) belongs to it."""
        if all(s is not session for s in self.sessions):
            self.sessions.append(session)
        return session


class SessionRegistry:
    """The MCP server's sessions over one executor; one :class:`ClientConnection` per client."""

    def __init__(
        self, executor: AsyncKernelExecutor, exposed: Mapping[str, Sequence[Any]] | None = None
    ) -> None:
        self.executor = executor
        self._entries: dict[str, SessionEntry] = {}
        self._exposed = dict(exposed or {})  # module -> host functions (--upstream tools)
        self._ready: weakref.WeakSet[AsyncSession] = weakref.WeakSet()

    def connect(self) -> ClientConnection:
        """A new client connection with its own (not yet started) default session."""
        return ClientConnection(self, secrets.token_hex(6))

    def entry(self, agent_id: str, shared: bool, user: str) -> SessionEntry:
        found = self._entries.get(agent_id)
        if found is None:
            found = self._entries[agent_id] = SessionEntry(agent_id, shared)
        found.users.add(user)
        return found

    async def session(self, entry: SessionEntry) -> AsyncSession:
        """The kernelexec session behind ``entry`` (its kernel starts on first run), with the
        upstream servers' tools exposed to its code."""
        session = entry.use(await self.executor.session(entry.agent_id))
        if self._exposed and session not in self._ready:
            for module, functions in self._exposed.items():
                if functions:
                    await session.expose(*functions, module=module)
            self._ready.add(session)
        return session

    def visible_to(self, user: str) -> list[SessionEntry]:
        """The sessions ``user`` may see: its own default one and every named one."""
        return [e for e in self._entries.values() if e.shared or user in e.users]

    async def release(self, user: str) -> None:
        """``user`` went away: close each session no other connection uses (at once: a stdio
        client kills the server 2 s after it closes stdin)."""
        closing: list[AsyncSession] = []
        snapshots: list[AsyncSnapshot] = []
        for agent_id, entry in list(self._entries.items()):
            if user not in entry.users:
                continue
            entry.users.discard(user)
            if not entry.users:
                del self._entries[agent_id]
                closing.extend(entry.sessions)
                snapshots.extend(entry.snapshots.values())
        await asyncio.gather(*(snap.aclose() for snap in snapshots))
        await asyncio.gather(*(session.aclose() for session in closing))
        if closing:
            log.info("closed %d session(s) of connection %s", len(closing), user)


class ClientConnection:
    """The sessions of one MCP client connection (an HTTP MCP session, or the stdio process)."""

    def __init__(self, registry: SessionRegistry, connection_id: str) -> None:
        self.registry = registry
        self.id = connection_id
        self.default_agent = f"{_RESERVED_PREFIX}{connection_id}"
        self.closed = False

    def resolve(self, name: str | None) -> tuple[str, SessionEntry]:
        """The name shown to the client and the entry for ``session`` as the client passed it.

        Raises:
            ConfigError: the name is not a valid session name (the message says why).
        """
        if name is None or name == DEFAULT_NAME:
            entry = self.registry.entry(self.default_agent, shared=False, user=self.id)
            return DEFAULT_NAME, entry
        branch = isinstance(name, str) and name.startswith(DEFAULT_NAME + "~")
        if branch and _BRANCH.fullmatch(name[len(DEFAULT_NAME) :]):
            # A branch of this connection's own session: private to the connection too.
            agent = self.default_agent + name[len(DEFAULT_NAME) :]
            return name, self.registry.entry(agent, shared=False, user=self.id)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"session {name!r} is not a valid session name (1-64 letters, digits, '.', '_' "
                "or '-', starting with a letter or digit)"
            )
        if name.startswith(_RESERVED_PREFIX):
            raise ConfigError(
                f"session {name!r}: names starting with {_RESERVED_PREFIX!r} are "
                "reserved for the clients' default sessions"
            )
        return name, self.registry.entry(name, shared=True, user=self.id)

    def shown_name(self, entry: SessionEntry) -> str:
        """How this client names ``entry`` (``default~1`` for a branch of its own session)."""
        if entry.agent_id.startswith(self.default_agent):
            return DEFAULT_NAME + entry.agent_id[len(self.default_agent) :]
        return entry.agent_id

    async def aclose(self) -> None:
        """Close the sessions only this connection used. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await self.registry.release(self.id)
