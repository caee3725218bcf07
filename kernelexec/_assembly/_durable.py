"""``DurableSessions``: an executor's durable state (with a ``state_dir``): the store, the
hand-off of agents between executors sharing it, each session's keeper (with the replayer that
rebuilds names from its recording), hibernating every session when the executor closes, and
deleting an agent's saved state."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path, PurePath

from kernelexec._config import ExecutorConfig
from kernelexec._core._lease import KernelLease
from kernelexec._core._session import AsyncSession
from kernelexec._durable._handoff import AgentClaim, Handoff
from kernelexec._durable._keeper import Replayer, Runner, SessionState
from kernelexec._durable._leases import LeaseBook
from kernelexec._durable._rebuild import replay
from kernelexec._durable._store import StateStore
from kernelexec._durable._transfer import RemoteSessionState
from kernelexec._exceptions import ConfigError
from kernelexec._observability._logtext import untrusted
from kernelexec._recording import SessionRecorder

log = logging.getLogger("kernelexec")


class DurableSessions:
    """The durable side of one executor's sessions.

    Args:
        config: The executor's configuration (its ``state_dir`` is set).
        backend: The backend's name (for the error when it cannot keep state).
        host_filesystem: Whether the backend's kernels see this host's filesystem (if not, the
            state moves through the kernel protocol).

    Raises:
        ConfigError: ``checkpoint="after_call"`` where the backend's kernels do not see this
            host's filesystem.
    """

    def __init__(self, config: ExecutorConfig, backend: str, host_filesystem: bool) -> None:
        assert config.state_dir is not None
        if not host_filesystem and config.checkpoint == "after_call":
            raise ConfigError(
                f"checkpoint='after_call': the {backend!r} backend's kernels do "
                "not see this host's filesystem; its durable sessions save on_evict"
            )
        self._config = config
        self._host_filesystem = host_filesystem
        self.store = StateStore(config.state_dir)
        self.handoff = Handoff(LeaseBook(config.state_dir), config.handoff_timeout)

    def open(self) -> None:
        """Open the store and the hand-off (the executor starts; the caller then runs
        ``handoff.serve`` in the background)."""
        self.store.open()
        self.handoff.open()

    def close(self) -> None:
        """Close the hand-off and the store (the executor's kernels are gone)."""
        self.handoff.close()
        self.store.close()

    async def claim(self, agent_id: str, key: str) -> AgentClaim:
        """Hold ``agent_id`` (under ``key``) for a new session of it, asking another
        executor that holds it to hand it over."""
        claim = self.handoff.claim(agent_id, key)
        await claim.take()
        return claim

    def keeper(
        self,
        agent_id: str,
        key: str,
        workdir: PurePath,
        lease: KernelLease,
        *,
        same_user: bool,
        recorder: SessionRecorder | None,
        claim: AgentClaim,
    ) -> SessionState:
        """The keeper of a new session's state (``key``: empty for the default environment,
        else its fingerprint), holding the agent through ``claim`` and handing it over
        through ``lease``; with a recording, names are rebuilt from it when a checkpoint
        cannot bring them back."""
        cfg = self._config
        state = SessionState if self._host_filesystem else RemoteSessionState
        keeper = state(
            self.store,
            agent_id,
            key,
            Path(workdir),  # a gateway's: relative, as its kernels see it
            checkpoint=cfg.checkpoint,
            limit=cfg.max_checkpoint_bytes,
            same_user=same_user,
            secret_names=frozenset(cfg.env_vars),
            claim=claim,
        )
        keeper.serve_handovers(lease)
        if recorder is not None:
            keeper.replayer = _replayer(recorder)
        return keeper

    async def hibernate_all(self, sessions: list[AsyncSession]) -> None:
        """Save every session that has a kernel before the kernels go; a session busy now
        cannot be saved: its names are reported lost on resume (with ``after_call``, its last
        completed call's checkpoint stays)."""

        async def one(session: AsyncSession) -> None:
            lease = session.lease
            keeper = session.durable
            if keeper is None or not lease.has_kernel:
                return
            if not lease.busy:
                await lease.evict()
            elif keeper.checkpoint == "on_evict":
                await keeper.tombstone(
                    list(lease.names), "the session was busy when its executor closed"
                )

        results = await asyncio.gather(*(one(s) for s in sessions), return_exceptions=True)
        for session, result in zip(sessions, results, strict=True):
            if isinstance(result, Exception):
                log.warning(
                    "agent %r: not hibernated at close: %s", session.agent_id, untrusted(result)
                )

    async def delete(self, agent_id: str, key: str, live: AsyncSession | None) -> bool:
        """Delete the saved state of ``agent_id`` under ``key``; whether there was any. A
        ``live`` session of it keeps its kernel's state."""
        if live is not None and live.durable is not None:
            live.durable.deleted()
        return await asyncio.to_thread(self.store.delete, agent_id, key)


def _replayer(recorder: SessionRecorder) -> Replayer:
    """Rebuilds names from the cells ``recorder`` holds."""

    async def rebuild(names: list[str], run: Runner) -> list[str]:
        cells = recorder.notebook.cells
        return await replay((c.source for c in cells if c.cell_type == "code"), names, run)

    return rebuild
