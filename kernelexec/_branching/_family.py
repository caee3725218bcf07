"""``Brancher``: the forks, snapshots and restores of one executor's kernels, and the rule that
keeps a process alive while processes forked from it live.

A branch is a descendant of the kernel it was forked from (kernel -> template -> branch), and
a branch dies with its template (``PR_SET_PDEATHSIG``; a template lives on the host's
connection, and at ``"process"`` the kernel's launcher kills every descendant when its own
kernel ends). So a kernel whose session closes, or whose session gets
another kernel, while branches of it live is not shut down but *kept*: it stays, idle and
unreachable, and is shut down with its last branch; a closed snapshot whose branches live is
kept the same way. Kept processes do not count against ``max_kernels``. The executor's close
ends every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kernelexec import _trees
from kernelexec._branching import _process
from kernelexec._branching._process import Template
from kernelexec._exceptions import BranchError, BranchingNotSupportedError, ExecutorClosedError
from kernelexec._models import IsolationLevel
from kernelexec._public import public
from kernelexec.backends._base import KernelConnection

log = logging.getLogger("kernelexec")

BRANCHED_LEVELS: tuple[IsolationLevel, ...] = ("none", "process")
"""Isolation levels whose kernels can be forked."""


@dataclass(eq=False)
class _Node:
    """A process of a family: a kernel or a template."""

    parent: _Node | None
    destroy: Callable[[], Awaitable[None]]
    children: set[_Node] = field(default_factory=set)
    closed: bool = False


class AsyncSnapshot:
    """A frozen copy of a session's kernel, from :meth:`AsyncSession.snapshot`.

    It is a paused fork of the kernel: it holds memory only for the pages the session changes
    afterwards. Give it to :meth:`AsyncSession.restore` any number of times; free it with
    :meth:`aclose` (closing the executor frees every snapshot).

    Attributes:
        agent_id: The session it was taken of.
        names: The user's variable names at the snapshot.
    """

    def __init__(
        self, brancher: Brancher, template: Template, agent_id: str, names: tuple[str, ...]
    ) -> None:
        self._brancher = brancher
        self.template = template
        self.agent_id = agent_id
        self.names = names
        self.files: str | None = None
        """A copy of the session's working directory at the snapshot (host filesystem)."""
        self.setup_ran = False
        """Whether the session's ``setup_code`` had run in the kernel at the snapshot."""
        self.outlives_kernel = False
        """Whether it outlives the kernel it was taken of (not a launcher's own kernel at
        ``"process"``, whose end ends every descendant)."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (or the executor closed)."""
        return self._brancher.is_closed(self.template)

    async def aclose(self) -> None:
        """Free the snapshot (branches restored from it stay). Idempotent."""
        await self._brancher.close_template(self.template)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<AsyncSnapshot of {self.agent_id!r} ({state})>"


class Brancher:
    """Forks kernels of one executor and keeps what their branches need (module docstring).

    Args:
        timeout: Seconds a kernel has to fork, and a branch to come up.
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._nodes: dict[int, _Node] = {}  # id(kernel connection or template) -> node
        self._installed: set[int] = set()  # id()s of kernels with the kernel side installed
        self._owners: dict[int, object] = {}  # keeps the id()s above valid
        self._closed = False
        self.last_pause_s = 0.0
        """How long the last fork paused its kernel (the kernel's own measure; benchmarks)."""

    # -- what a session asks for ------------------------------------------------------------

    def check(self, conn: KernelConnection | None, level: IsolationLevel, backend: str) -> None:
        """Refuse, before anything is forked, a kernel this cannot fork.

        Raises:
            BranchingNotSupportedError: naming the backend or isolation level.
            ExecutorClosedError: the executor is closed.
        """
        if self._closed:
            raise ExecutorClosedError("the executor is closed")
        if level not in BRANCHED_LEVELS:
            raise BranchingNotSupportedError(
                f"sessions at isolation={level!r} cannot be forked or snapshotted (a kernel in "
                f"its own namespaces is not forkable from the host); use "
                f"isolation='process' or 'none'"
            )
        if conn is not None and conn.family() is None:
            raise BranchingNotSupportedError(
                f"sessions of the {backend!r} backend cannot be forked or snapshotted (only "
                "local kernels at isolation 'none' or 'process' can)"
            )

    async def snapshot(self, conn: KernelConnection, agent_id: str) -> Template:
        """Fork a template from the live kernel ``conn`` (it is paused for the fork only)."""
        family = conn.family()
        if family is None:
            raise BranchingNotSupportedError("this kernel cannot be forked")
        if id(conn) not in self._installed:
            await _process.install(conn, self._timeout)
            self._remember(conn, installed=True)
            await asyncio.to_thread(family.seal)
        # Inside the family's first kernel's directory: the only place (besides the working
        # directories) its mount namespace shows at "process", and it outlives the family.
        tdir = await asyncio.to_thread(tempfile.mkdtemp, prefix="t", dir=family.directory)
        try:
            await asyncio.to_thread(family.hand_over, tdir)
            control = os.path.join(tdir, "c")
            # A branch's ipc sockets sit one directory deeper than its parent's
            # (<kernel dir>/bXXXXXXXX/s-5): say so plainly instead of "AF_UNIX path too long".
            if len(os.fsencode(os.path.join(family.directory, "bXXXXXXXX", "s-5"))) > 107:
                raise BranchError(
                    f"the temp directory {os.path.dirname(family.directory)!r} is too long for a "
                    "branch's ipc sockets (at most 107 bytes); point TMPDIR at a shorter one"
                )
            forked = await _process.fork_template(conn, control, self._timeout)
            template = Template(
                forked.pid,
                control,
                tdir,
                forked.threads,
                family,
                forked.fork_s,
                listener=forked.kernel,
            )
            try:
                await template.ready(self._timeout)
            except BaseException:
                template.close()
                raise
        except BaseException:
            await asyncio.to_thread(_remove, tdir)
            raise
        self.last_pause_s = forked.paused_s
        parent = self._node_of(conn)
        node = _Node(parent, lambda: asyncio.to_thread(template.close))
        parent.children.add(node)
        self._nodes[id(template)] = node
        self._owners[id(template)] = template
        return template

    async def branch(self, template: Template, origin: str) -> KernelConnection:
        """Fork a branch kernel from ``template``, with its channels connected.

        Raises:
            BranchError: the template is closed or gone, or the branch did not start.
        """
        if self.is_closed(template) or not template.alive():
            raise BranchError("the snapshot is closed or its process is gone")
        try:
            child = await asyncio.wait_for(template.family.branch(template, origin), self._timeout)
        except asyncio.TimeoutError:
            raise BranchError(f"the branch did not start in {self._timeout:g} s") from None
        node = _Node(self._nodes[id(template)], child.shutdown)
        node.parent.children.add(node)  # type: ignore[union-attr]
        self._nodes[id(child)] = node
        self._remember(child, installed=True)
        return child

    async def seal(self, conn: KernelConnection) -> None:
        """A branch is ready: close its channels to the others of its family (see
        :func:`seal`)."""
        family = conn.family()
        if family is not None:
            await asyncio.to_thread(family.seal)

    def is_closed(self, template: Template) -> bool:
        """Whether the snapshot behind ``template`` was closed (or the executor closed)."""
        node = self._nodes.get(id(template))
        return self._closed or node is None or node.closed

    async def close_template(self, template: Template) -> None:
        """A snapshot is no longer wanted: end it, or keep it while its branches live."""
        node = self._nodes.get(id(template))
        if node is not None and not node.closed:
            node.closed = True
            await self._settle(node)

    # -- what the pool asks -----------------------------------------------------------------

    async def released(self, conn: KernelConnection) -> bool:
        """``conn``'s kernel is about to be shut down or replaced: True when it is kept (it
        has live branches; the caller must leave it alone), False when the caller shuts it
        down as usual."""
        node = self._nodes.get(id(conn))
        if node is None:
            self._forget(conn)
            return False
        node.closed = True
        if node.children:
            log.info("keeping a kernel while its branches live")
            return True
        node.destroy = _noop  # the caller shuts it down
        await self._settle(node)
        return False

    async def aclose(self) -> None:
        """End every kept kernel and every template (the executor closes)."""
        self._closed = True
        nodes = list(self._nodes.values())
        self._nodes.clear()
        self._owners.clear()
        self._installed.clear()
        results = await asyncio.gather(*(n.destroy() for n in nodes), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                log.warning("ending a branch's process failed: %s", result)

    # -- internals ---------------------------------------------------------------------------

    def _remember(self, obj: object, *, installed: bool) -> None:
        self._owners[id(obj)] = obj
        if installed:
            self._installed.add(id(obj))

    def _forget(self, obj: object) -> None:
        self._owners.pop(id(obj), None)
        self._installed.discard(id(obj))
        self._nodes.pop(id(obj), None)

    def _node_of(self, conn: KernelConnection) -> _Node:
        node = self._nodes.get(id(conn))
        if node is None:
            node = _Node(None, conn.shutdown)
            self._nodes[id(conn)] = node
            self._owners[id(conn)] = conn
        return node

    async def _settle(self, node: _Node) -> None:
        """End closed processes that no longer have branches, from ``node`` up."""
        current: _Node | None = node
        while current is not None and current.closed and not current.children:
            key = next((k for k, n in self._nodes.items() if n is current), None)
            if key is not None:
                del self._nodes[key]
                self._installed.discard(key)
                self._owners.pop(key, None)
            try:
                await current.destroy()
            except Exception as exc:
                log.warning("ending a branch's process failed: %s", exc)
            parent = current.parent
            if parent is not None:
                parent.children.discard(current)
            current = parent


async def _noop() -> None:
    return None


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        _trees.remove(path)


public(__name__)
