"""pydantic-ai on kernelexec: ``agent.run(..., workspace=KernelWorkspace())``.

:class:`KernelWorkspace` is a pydantic-ai workspace backend (``WorkspaceBackend`` +
``SupportsCommands`` + ``SupportsFilesystem``) whose environment is one kernelexec session:
commands run in the session's kernel (its own user and limits at ``"process"``) in its working
directory, and files are read and written by that kernel (``session.files``, or the shell).
:meth:`KernelWorkspace.toolset` adds a ``python`` tool on the same kernel, so the agent's Python
variables persist from step to step and share files with its commands.

Needs the ``pydantic-ai`` extra: ``pip install 'kernelexec[pydantic-ai]'``.
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from pydantic_ai.messages import WorkspaceRef
    from pydantic_ai.toolsets import FunctionToolset
    from pydantic_ai.workspaces import (
        CommandResult,
        FileEntry,
        WorkspaceTimeoutError,
        WorkspaceUnavailableError,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kernelexec.compat.pydantic_ai needs pydantic-ai ({exc.name} is missing): "
        "pip install 'kernelexec[pydantic-ai]'"
    ) from exc

from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._core._session import AsyncSession
from kernelexec._exceptions import (
    ExecutorClosedError,
    FileTransferError,
    KernelStartError,
    PathRefusedError,
    PoolExhaustedError,
)
from kernelexec._models import Execution
from kernelexec._sync import KernelExecutor
from kernelexec.compat._bridge import AgentKernel, SessionOp, T, describe_execution

__all__ = ["PROVIDER", "KernelWorkspace"]

PROVIDER = "kernelexec"
"""``WorkspaceRef.provider`` of a kernelexec workspace; its ``id`` is the agent id."""

_GONE = (ExecutorClosedError, FileTransferError, KernelStartError, PoolExhaustedError)


class KernelWorkspace:
    """A pydantic-ai workspace backend on one kernelexec session (one agent's kernel).

    Building it does nothing; the first operation opens the session (``ref`` is then
    ``WorkspaceRef("kernelexec", agent_id)``). A run's end never closes it: call
    :meth:`aclose` (or :meth:`close`) when the agent is done, or close the shared executor.

    Args:
        agent_id: The session's agent id (default: a fresh ``pydantic-ai-<hex>``).
        executor: A :class:`~kernelexec.KernelExecutor` or
            :class:`~kernelexec.AsyncKernelExecutor` to share; it stays open after
            :meth:`aclose`.
        **executor_config: :class:`~kernelexec.ExecutorConfig` fields for an executor the
            workspace makes itself (on first use) and closes in :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        agent_id: str | None = None,
        executor: KernelExecutor | AsyncKernelExecutor | None = None,
        **executor_config: Any,
    ) -> None:
        self._kernel = AgentKernel("pydantic-ai", agent_id, executor, executor_config)
        self._ref: WorkspaceRef | None = None
        self._attach = False
        self._workdir: str | None = None
        self._lock: asyncio.Lock | None = None

    @classmethod
    def attach(
        cls, ref: WorkspaceRef, executor: KernelExecutor | AsyncKernelExecutor
    ) -> KernelWorkspace:
        """A backend for the open session ``ref`` names on ``executor``; its first operation
        raises ``WorkspaceUnavailableError`` when that session is gone."""
        if ref.provider != PROVIDER:
            raise ValueError(f"not a kernelexec workspace: provider {ref.provider!r}")
        workspace = cls(agent_id=ref.id, executor=executor)
        workspace._attach = True
        return workspace

    @property
    def agent_id(self) -> str:
        """The kernelexec session's agent id."""
        return self._kernel.agent_id

    @property
    def ref(self) -> WorkspaceRef | None:
        """The environment's identity: None until the first operation opened the session."""
        return self._ref

    async def _open(self) -> None:
        if self._ref is not None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent first operations open one session
            if self._ref is not None:
                return
            try:
                if self._attach and not self._kernel.session_exists():
                    raise WorkspaceUnavailableError(
                        f"kernelexec session {self.agent_id!r} is closed or was never opened"
                    )
                await self._kernel.acall(_noop)
            except _GONE as exc:
                raise WorkspaceUnavailableError(str(exc)) from exc
            self._ref = WorkspaceRef(provider=PROVIDER, id=self.agent_id)

    async def _call(self, op: SessionOp[T]) -> T:
        await self._open()
        try:
            return await self._kernel.acall(op)
        except _GONE as exc:
            raise WorkspaceUnavailableError(str(exc)) from exc

    async def working_dir(self) -> str:
        """The session's working directory as its kernel sees it (``pwd -P``)."""
        if self._workdir is None:
            result = await self._call(lambda s: s.commands.run(["pwd", "-P"], timeout=60))
            if result.exit_code != 0:
                raise WorkspaceUnavailableError(f"pwd failed in the kernel: {result.stderr}")
            self._workdir = result.stdout.rstrip("\n")
        return self._workdir

    async def run(
        self,
        command: str | Sequence[str],
        *,
        shell: bool = False,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run a command in the kernel, in the working directory, stdin at end of file.

        Raises:
            WorkspaceTimeoutError: it ran past ``timeout`` (it was killed; partial output on
                the error).
            WorkspaceUnavailableError: the session or its kernel is gone.
        """
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not timeout > 0
            or timeout == float("inf")
        ):
            raise ValueError("timeout must be a positive finite number or None")
        if shell and not isinstance(command, str):
            raise TypeError("shell=True takes the command as one string")
        if not shell and isinstance(command, str):
            raise TypeError("an argv sequence is needed without shell=True")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("empty command")
        extra = {str(k): str(v) for k, v in (env or {}).items()}
        result = await self._call(lambda s: s.commands.run(argv, env=extra, timeout=timeout))
        if result.timed_out:
            raise WorkspaceTimeoutError(
                f"command ran past its timeout of {timeout} s and was killed",
                stdout=result.stdout,
                stderr=result.stderr,
            )
        code = result.exit_code if result.exit_code is not None else -9
        return CommandResult(exit_code=code, stdout=result.stdout, stderr=result.stderr)

    # SupportsFilesystem. Reads and writes of files inside the working directory go through
    # ``session.files`` (bytes as binary message frames, never base64 through a shell); every
    # other operation, and a path outside the directory or one ``session.files`` refuses (a link
    # leading out, a FIFO), goes through pydantic-ai's own shell-derived filesystem on this
    # backend's commands, so pydantic-ai's rules for links, FIFOs and errors hold as they do for
    # command-only backends. Either way the kernel opens the file, with its rights.

    def _shell(self) -> Any:
        from pydantic_ai.workspaces.workspace import _ShellFilesystem

        return _ShellFilesystem(self)

    async def _inside(self, path: str) -> str | None:
        root = await self.working_dir()
        norm = posixpath.normpath(path)
        return norm[len(root) + 1 :] if norm.startswith(root + "/") else None

    async def read_bytes(self, path: str) -> bytes:
        """A file's content."""
        rel = await self._inside(path)
        if rel is not None:
            try:
                return await self._call(lambda s: s.files.read(rel))
            except PathRefusedError:
                pass
        data: bytes = await self._shell().read_bytes(path)
        return data

    async def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace a file (parents made; an existing link is written through)."""
        rel = await self._inside(path)
        # A new file goes through session.files; an existing one is written in place by the
        # shell, which keeps pydantic-ai's rules (through a link, refused without write rights)
        # where session.files would replace it.
        if rel is not None and not await self._entry_exists(rel):
            try:
                await self._call(lambda s: s.files.write(rel, data))
                return
            except PathRefusedError:
                pass
        await self._shell().write_bytes(path, data)

    async def _entry_exists(self, rel: str) -> bool:
        """Whether anything (a dangling link too) is at ``rel``, or the check cannot tell."""
        try:
            await self._call(lambda s: s.files.list(rel))
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True
        return True

    async def stat(self, path: str) -> FileEntry:
        """A file's or directory's entry (links followed)."""
        entry: FileEntry = await self._shell().stat(path)
        return entry

    async def list_dir(self, path: str) -> Sequence[FileEntry]:
        """A directory's entries."""
        entries: Sequence[FileEntry] = await self._shell().list_dir(path)
        return entries

    async def make_dir(self, path: str) -> None:
        """Make a directory and its missing parents."""
        await self._shell().make_dir(path)

    async def remove(self, path: str) -> None:
        """Remove a file, a link, or a directory tree (never the working directory)."""
        await self._shell().remove(path)

    async def exists(self, path: str) -> bool:
        """Whether the path exists."""
        found: bool = await self._shell().exists(path)
        return found

    async def run_python(self, code: str, timeout: float | None = None) -> Execution:
        """Run Python in the same kernel (its variables persist between calls)."""
        return await self._call(lambda s: s.run_code(code, timeout=timeout))

    def toolset(self, *, timeout: float | None = None) -> FunctionToolset[Any]:
        """A toolset with a ``python`` tool on this workspace's kernel: give it to the agent
        (``toolsets=[workspace.toolset()]``) beside ``workspace=workspace``."""
        workspace = self

        async def python(code: str) -> str:
            """Run Python code in a persistent interpreter (variables, imports and files stay
            from one call to the next; the working directory is the workspace's). Returns what
            it printed and the value of its last expression, or its error."""
            return describe_execution(await workspace.run_python(code, timeout=timeout))

        return FunctionToolset([python])

    async def aclose(self) -> None:
        """Close the session (its kernel and commands end), and the executor when the
        workspace made it."""
        await self._kernel.aclose()

    def close(self) -> None:
        """:meth:`aclose` from synchronous code."""
        self._kernel.close()


async def _noop(session: AsyncSession) -> None:
    return None
