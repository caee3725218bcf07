"""``KernelLink``: the session's kernel, with kernelexec's files and commands helpers in it.

The helpers are installed on a kernel's first file or command operation (one execute request,
which also enters the session's working directory when it is the kernel's first request) and
again in every fresh kernel after a restart. The link is a watcher of the session's lease (see
``kernelexec._core._lease.KernelWatcher``): told of each fresh kernel, and of the session's end,
after which every operation raises ``ExecutorClosedError``.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from kernelexec._exceptions import ExecutorClosedError, FileTransferError
from kernelexec._files._wire import (
    FILES_REPLY,
    FILES_REQUEST,
    Stalled,
    exchange,
    install_request,
    installed,
    raise_for_reply,
    wait_reply,
)
from kernelexec._models import Restored
from kernelexec._protocol._host import with_configure
from kernelexec._protocol._install import Installed
from kernelexec.backends._base import KernelConnection, KernelMessage

if TYPE_CHECKING:
    from kernelexec._core._lease import Arrival, LeasedKernel, Leaving


class LinkLease(Protocol):
    """What the helpers need of a session's hold on its kernel (``KernelLease`` is one)."""

    agent_id: str
    generation: int

    def hold(self) -> AbstractAsyncContextManager[None]:
        """Exclusive use of the kernel, in the order asked for."""

    async def attach(self) -> tuple[KernelConnection, builtins.list[str] | None]:
        """The kernel (started if none), and the names lost since the last run (or None)."""

    def put_back_lost(self, lost: builtins.list[str] | None) -> None:
        """Hand what :meth:`attach` returned back, for the session's next run to report."""

    def take_settings(self) -> dict[str, Any] | None:
        """The working-directory settings a fresh kernel still needs, once."""

    async def lose_state(self) -> None:
        """Replace the kernel; the next run reports what was lost."""


class KernelLink:
    """One session's kernel as the files and commands helpers see it: connecting (and
    installing the helpers in each fresh kernel), one request, and what a stalled one means.
    Every method is used with the session's lock held."""

    def __init__(self, lease: LinkLease, workdir: str, timeout: float) -> None:
        self.lease = lease
        self._workdir = workdir
        self.timeout = timeout
        self._installed = Installed()
        self._gone = False

    async def attaching(self) -> None:
        """The helpers wait for the kernel."""

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        """A fresh kernel: it has no helpers yet (even a fork of one that had them)."""
        self._installed.forget()
        return None

    async def before_use(self, kernel: LeasedKernel) -> None:
        """Using the kernel does not concern the helpers."""

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        """The kernel goes (its helpers with it)."""
        return False

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        """Runs do not concern the helpers."""

    def gone(self) -> None:
        """The session closed: no more operations."""
        self._gone = True

    async def connect(self) -> KernelConnection:
        """The session's kernel, with the files helper installed."""
        if self._gone:
            raise ExecutorClosedError(f"session {self.lease.agent_id!r} is closed")
        conn, lost = await self.lease.attach()
        self.lease.put_back_lost(lost)  # a file operation is not the run that reports them
        if not conn.custom_messages:
            raise FileTransferError(
                "this backend does not carry kernelexec's own messages; file operations need them"
            )
        if not self._installed.on(self.lease.generation, conn):
            await self._install(conn)
        return conn

    async def _install(self, conn: KernelConnection) -> None:
        request = install_request(self._workdir)
        settings = self.lease.take_settings()
        if settings is not None:  # the kernel's first request: it enters the directory
            request = with_configure(request, settings)
        got = await exchange(
            conn,
            request.msg_type,
            request.content(),
            reply_type=request.reply_type,
            timeout=self.timeout,
            metadata=request.metadata,
        )
        if isinstance(got, Stalled):
            await self._stalled(got, "installing the files helper")
        if got.content.get("status") != "ok" or not installed(got.content):
            why = got.content.get("evalue") or "this ipykernel has no shell handler table"
            raise FileTransferError(f"the kernel cannot serve file operations: {why}")
        self._installed.mark(self.lease.generation, conn)

    async def request(
        self,
        conn: KernelConnection,
        content: dict[str, Any],
        path: str,
        buffers: tuple[bytes, ...] = (),
    ) -> KernelMessage:
        """One file operation; its reply (errors raised)."""
        got = await self.ask(conn, FILES_REQUEST, FILES_REPLY, content, buffers)
        raise_for_reply(got.content, path)
        return got

    async def post(
        self, conn: KernelConnection, content: dict[str, Any], buffers: tuple[bytes, ...] = ()
    ) -> str:
        """Send a file operation without waiting; its msg_id, for :meth:`collect`."""
        return await conn.send("shell", FILES_REQUEST, content, buffers=buffers)

    async def collect(self, conn: KernelConnection, msg_ids: Collection[str]) -> KernelMessage:
        """The next reply to the posted operations ``msg_ids`` (they are answered in order),
        whatever it says."""
        got = await wait_reply(conn, msg_ids, FILES_REPLY, self.timeout)
        if isinstance(got, Stalled):
            await self._stalled(got, "a file transfer")
        return got

    async def ask(
        self,
        conn: KernelConnection,
        msg_type: str,
        reply_type: str,
        content: dict[str, Any],
        buffers: tuple[bytes, ...] = (),
    ) -> KernelMessage:
        """One request to a helper; its reply, whatever it says."""
        got = await exchange(
            conn, msg_type, content, reply_type=reply_type, timeout=self.timeout, buffers=buffers
        )
        if isinstance(got, Stalled):
            what = f"{content.get('op')} of {content.get('path') or content.get('id')!r}"
            await self._stalled(got, what)
        return got

    async def _stalled(self, stalled: Stalled, what: str) -> NoReturn:
        """The kernel died, or did not answer in time (a shell handler cannot be interrupted
        into answering): either way it is replaced, and the next run says so."""
        self._installed.forget()
        await self.lease.lose_state()
        if stalled.died is not None:
            raise FileTransferError(f"the kernel died during {what} ({stalled.died.reason})")
        raise FileTransferError(
            f"no answer within {self.timeout:g} s during {what}; the kernel was replaced"
        )
