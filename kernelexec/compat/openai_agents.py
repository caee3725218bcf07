"""openai-agents Sandbox Agents on kernelexec: ``SandboxRunConfig(client=KernelSandboxClient())``.

:class:`KernelSandboxClient` is a sandbox client (``BaseSandboxClient``) whose sessions are
kernelexec sessions, one per sandbox session (so one per agent run, or per agent when the run
config passes the same session): its ``exec_command`` runs in the session's kernel (its own user
and limits at ``"process"``), files move through the kernel with ``session.files``, and the
manifest's root is the session's working directory (a kernel's user cannot make
``/workspace``). :class:`KernelPython` is a capability with a ``python`` tool on the same kernel,
so the agent's Python state persists between steps and shares files with its commands.

Needs the ``openai-agents`` extra: ``pip install 'kernelexec[openai-agents]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal, cast

try:
    from agents import function_tool
    from agents.sandbox.capabilities.capability import Capability
    from agents.sandbox.errors import (
        ExecTimeoutError,
        ExecTransportError,
        PtySessionNotFoundError,
        WorkspaceArchiveReadError,
        WorkspaceArchiveWriteError,
        WorkspaceReadNotFoundError,
    )
    from agents.sandbox.manifest import Manifest
    from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
    from agents.sandbox.session.pty_output import collect_pty_output
    from agents.sandbox.session.pty_types import (
        PTY_PROCESSES_MAX,
        PtyExecUpdate,
        allocate_pty_process_id,
        clamp_pty_yield_time_ms,
        process_id_to_prune_from_meta,
        resolve_pty_write_yield_time_ms,
    )
    from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
    from agents.sandbox.session.sandbox_session import SandboxSession
    from agents.sandbox.session.sandbox_session_state import SandboxSessionState
    from agents.sandbox.session.workspace_payloads import coerce_write_payload
    from agents.sandbox.snapshot import (
        LocalSnapshot,
        SnapshotBase,
        SnapshotSpec,
        resolve_snapshot,
    )
    from agents.sandbox.types import ExecResult, User
    from agents.tool import Tool
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kernelexec.compat.openai_agents needs openai-agents ({exc.name} is missing): "
        "pip install 'kernelexec[openai-agents]'"
    ) from exc

from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._config import make_config
from kernelexec._core._session import AsyncSession
from kernelexec._exceptions import ConfigError, KernelExecError, SessionFileError
from kernelexec._files._commands import BackgroundCommand, cut_marker
from kernelexec._paths import within
from kernelexec._sync import KernelExecutor
from kernelexec.compat._bridge import AgentKernel, describe_execution

__all__ = [
    "KernelPython",
    "KernelSandboxClient",
    "KernelSandboxClientOptions",
    "KernelSandboxSession",
    "KernelSandboxSessionState",
]

_STAGE = ".kernelexec-transfer"
"""Start of the name of a staged archive in the working directory (removed once unpacked)."""
_PREFIX = "openai-agents"
"""Start of the agent ids the client makes."""
MAX_ARCHIVE = 1 << 30
"""Bytes a workspace archive may have by default (it is a host temporary file meanwhile)."""
_CHUNK = 1 << 20


class _TooBig(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


class KernelSandboxClientOptions(BaseSandboxClientOptions):
    """Options of :meth:`KernelSandboxClient.create`.

    Attributes:
        agent_id: The kernelexec agent id of the session (default: a fresh
            ``openai-agents-<hex>``). Giving an open session's id shares its kernel (the
            caller's choice; a resumed state may name only what the client opened).
    """

    type: Literal["kernelexec"] = "kernelexec"
    agent_id: str | None = None


class KernelSandboxSessionState(SandboxSessionState):
    """A kernelexec sandbox session's state: the SDK's, plus the session's agent id."""

    type: Literal["kernelexec"] = "kernelexec"
    agent_id: str


_NO_STDIN = (
    "this sandbox's commands read no input (their stdin is at end of file): pass the input in "
    "the command itself (a pipe, a here-document or a file)"
)


@dataclass
class _Process:
    """A command ``exec_command`` left running: its background command and how much of its
    output the model has seen."""

    command: BackgroundCommand
    last_used: float = field(default_factory=time.monotonic)
    seen_out: int = 0
    seen_err: int = 0
    chunks: deque[bytes] = field(default_factory=deque)
    chunks_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)


class KernelSandboxSession(BaseSandboxSession):
    """One sandbox session on one kernelexec session (made by :class:`KernelSandboxClient`).

    ``exec_command`` runs as a background command of the session: one that outlives its
    ``yield_time_ms`` goes on running and the model gets its session id, to read more of its
    output with ``write_stdin`` (with empty ``chars``: the commands read no input).
    """

    state: KernelSandboxSessionState

    def __init__(
        self,
        *,
        state: KernelSandboxSessionState,
        kernel: AgentKernel,
        max_archive_bytes: int = MAX_ARCHIVE,
    ) -> None:
        self.state = state
        self.kernel = kernel
        self.max_archive_bytes = max_archive_bytes
        self._processes: dict[int, _Process] = {}

    @property
    def agent_id(self) -> str:
        """The kernelexec session's agent id."""
        return self.kernel.agent_id

    def _relative(self, path: Path | str, *, for_write: bool = False) -> str:
        absolute = PurePosixPath(self.normalize_path(path, for_write=for_write))
        root = PurePosixPath(self.state.manifest.root)
        try:
            rel = absolute.relative_to(root)
        except ValueError:
            raise WorkspaceArchiveReadError(
                path=Path(str(path)), context={"reason": "outside_session_directory"}
            ) from None
        return str(rel) if str(rel) != "." else "."

    async def _exec_internal(
        self, *command: str | Path, timeout: float | None = None
    ) -> ExecResult:
        argv = [str(part) for part in command]
        try:
            out, err, code, timed_out = await self.kernel.acall(
                lambda s: _run_bytes(s, argv, timeout)
            )
        except KernelExecError as exc:
            raise ExecTransportError(command=command, cause=exc) from exc
        if timed_out:
            raise ExecTimeoutError(command=command, timeout_s=timeout)
        return ExecResult(stdout=out, stderr=err, exit_code=code)

    def supports_pty(self) -> bool:
        """Yes: long commands go on in the background (see the class docstring)."""
        return True

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        """Start a command in the background; its output (and exit code) when it ends within
        ``yield_time_s``, else its output so far and a process id for :meth:`pty_write_stdin`.
        ``timeout`` is not applied, as in the SDK's own local sandbox; ``tty`` gives no
        terminal (the output comes through pipes)."""
        argv = self._prepare_exec_command(*command, shell=shell, user=user)
        try:
            started = await self.kernel.acall(lambda s: s.commands.start(argv))
        except KernelExecError as exc:
            raise ExecTransportError(command=command, cause=exc) from exc
        process = _Process(started)
        process_id = allocate_pty_process_id(set(self._processes))
        self._processes[process_id] = process
        await self._prune_processes()
        yield_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._collect(
            process_id, process, clamp_pty_yield_time_ms(yield_ms), max_output_tokens
        )

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        """More output of a command :meth:`pty_exec_start` left running (``chars`` must be
        empty: the commands read no input)."""
        process = self._processes.get(session_id)
        if process is None:
            raise PtySessionNotFoundError(session_id=session_id)
        if chars:
            raise RuntimeError(_NO_STDIN)
        yield_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        yield_ms = resolve_pty_write_yield_time_ms(yield_time_ms=yield_ms, input_empty=True)
        return await self._collect(session_id, process, yield_ms, max_output_tokens)

    async def pty_terminate_all(self) -> None:
        """Kill every command still running in the background (their process groups)."""
        processes, self._processes = list(self._processes.values()), {}
        for process in processes:
            await self._kill(process)

    async def _kill(self, process: _Process) -> None:
        with contextlib.suppress(KernelExecError):  # gone with its session or kernel
            await self.kernel.acall(lambda _: process.command.kill(signal.SIGKILL))

    async def _prune_processes(self) -> None:
        if len(self._processes) <= PTY_PROCESSES_MAX:
            return
        meta = [(pid, p.last_used, not p.command.running) for pid, p in self._processes.items()]
        victim = process_id_to_prune_from_meta(meta)
        if victim is not None:
            await self._kill(self._processes.pop(victim))

    async def _collect(
        self, process_id: int, process: _Process, yield_ms: int, max_output_tokens: int | None
    ) -> PtyExecUpdate:
        command = process.command

        async def poll_output(deadline: float) -> None:
            wait = min(max(deadline - time.monotonic(), 0.0), 0.25)
            try:
                await self.kernel.acall(lambda _: command.poll(wait))
            except KernelExecError as exc:
                self._processes.pop(process_id, None)
                raise ExecTransportError(command=(str(process_id),), cause=exc) from exc
            out, err = command.stdout, command.stderr
            fresh = out[process.seen_out :] + err[process.seen_err :]
            process.seen_out, process.seen_err = len(out), len(err)
            if fresh:
                process.chunks.append(fresh)
                process.notify.set()

        async def wait_for_output(remaining_s: float) -> None:
            return None  # each poll already waits in the kernel

        async with process.reading:  # two readers of one process would each miss output
            output, tokens, closed = await collect_pty_output(
                output_chunks=process.chunks,
                output_lock=process.chunks_lock,
                output_notify=process.notify,
                is_done=lambda: not command.running,
                yield_time_ms=yield_ms,
                max_output_tokens=max_output_tokens,
                poll_output=poll_output,
                wait_for_output=wait_for_output,
            )
        process.last_used = time.monotonic()
        if closed:
            self._processes.pop(process_id, None)
            code = command.exit_code if command.exit_code is not None else -1
            return PtyExecUpdate(
                process_id=None, output=output, exit_code=code, original_token_count=tokens
            )
        return PtyExecUpdate(
            process_id=process_id, output=output, exit_code=None, original_token_count=tokens
        )

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        """A file's content (the kernel has one user: ``user`` is not switched to)."""
        rel = self._relative(path)
        try:
            data = await self.kernel.acall(lambda s: s.files.read(rel))
        except FileNotFoundError as exc:
            raise WorkspaceReadNotFoundError(path=path, cause=exc) from exc
        except (SessionFileError, KernelExecError, ValueError) as exc:
            raise WorkspaceArchiveReadError(path=path, cause=exc) from exc
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        """Create or replace a file, its parent folders made."""
        payload = coerce_write_payload(path=path, data=data)
        content = payload.stream.read()
        rel = self._relative(path, for_write=True)
        try:
            await self.kernel.acall(lambda s: s.files.write(rel, content))
        except (SessionFileError, KernelExecError, ValueError) as exc:
            raise WorkspaceArchiveWriteError(path=path, cause=exc) from exc

    async def running(self) -> bool:
        """Whether the kernelexec session is open."""
        try:
            return self.kernel.session_exists()
        except KernelExecError:
            return False

    async def persist_workspace(self) -> io.IOBase:
        """The working directory as a tar archive with relative members: made in the kernel
        (sparse files kept sparse) into a staged file there, then streamed to a host temporary
        file (on disk, never whole in memory) of at most ``max_archive_bytes``.

        Raises:
            WorkspaceArchiveReadError: tar failed, or the archive is larger than the bound.
        """
        root = self.state.manifest.root
        stage = f"{_STAGE}-{uuid.uuid4().hex}.tar"
        argv = ["tar", "-C", root, "--sparse", f"--exclude=./{_STAGE}-*", "-cf", stage, "."]
        try:
            _, err, code, _ = await self.kernel.acall(lambda s: _run_bytes(s, argv, None))
            if code != 0:
                raise WorkspaceArchiveReadError(
                    path=Path(root),
                    context={
                        "reason": "tar_failed",
                        "stderr": err.decode("utf-8", "replace")[-500:],
                    },
                )
            return await self.kernel.acall(lambda s: _fetch(s, stage, self.max_archive_bytes))
        except KernelExecError as exc:
            raise WorkspaceArchiveReadError(path=Path(root), cause=exc) from exc
        except _TooBig as exc:
            raise WorkspaceArchiveReadError(
                path=Path(root), context={"reason": "archive_too_large", "limit": exc.limit}
            ) from None
        finally:
            with contextlib.suppress(KernelExecError, FileNotFoundError):
                await self.kernel.acall(lambda s: s.files.remove(stage))

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        """Unpack a tar archive (from :meth:`persist_workspace`) into the working directory;
        it is streamed into the kernel in chunks."""
        stage = f"{_STAGE}-{uuid.uuid4().hex}.tar"
        root = self.state.manifest.root
        argv = ["sh", "-c", 'tar -C "$1" -xf "$2"; s=$?; rm -f "$2"; exit $s', "sh", root, stage]
        try:
            await self.kernel.acall(lambda s: _send(s, stage, data))
            _, err, code, _ = await self.kernel.acall(lambda s: _run_bytes(s, argv, None))
        except (SessionFileError, KernelExecError) as exc:
            raise WorkspaceArchiveWriteError(path=Path(root), cause=exc) from exc
        if code != 0:
            raise WorkspaceArchiveWriteError(
                path=Path(root),
                context={"reason": "tar_failed", "stderr": err.decode("utf-8", "replace")[-500:]},
            )


class KernelSandboxClient(BaseSandboxClient[KernelSandboxClientOptions | None]):
    """A Sandbox Agents client whose sessions are kernelexec sessions.

    A session state is what the SDK serialises between runs; :meth:`resume` trusts only what
    this client made (issue 41): an agent id it opened, or one of its own prefix
    (``openai-agents-``) that no open session of the executor has (a fresh session is opened
    for it), and a local snapshot only in a directory it made one in or one of
    ``snapshot_roots``. A forged state naming another session's agent id, or a snapshot
    elsewhere on the host, is refused.

    Args:
        executor: A :class:`~kernelexec.KernelExecutor` or
            :class:`~kernelexec.AsyncKernelExecutor` to share; it stays open after
            :meth:`aclose`.
        max_archive_bytes: Largest workspace archive :meth:`KernelSandboxSession.persist_workspace`
            hands over (a host temporary file meanwhile); a larger one is refused.
        snapshot_roots: Directories a resumed state's local snapshot may lie in, beyond those
            this client's :meth:`create` was given (a state saved by an earlier process).
        **executor_config: :class:`~kernelexec.ExecutorConfig` fields for an executor the
            client makes itself (on first use) for all its sessions and closes in
            :meth:`aclose`.
    """

    backend_id = "kernelexec"
    supports_default_options = True

    def __init__(
        self,
        *,
        executor: KernelExecutor | AsyncKernelExecutor | None = None,
        max_archive_bytes: int = MAX_ARCHIVE,
        snapshot_roots: Iterable[str | os.PathLike[str]] = (),
        **executor_config: Any,
    ) -> None:
        if isinstance(max_archive_bytes, bool) or not isinstance(max_archive_bytes, int):
            raise ConfigError(f"max_archive_bytes must be an int, not {max_archive_bytes!r}")
        if isinstance(snapshot_roots, str | os.PathLike):
            raise ConfigError("snapshot_roots must be a list of directories, not one path")
        self._max_archive = max_archive_bytes
        self._snapshot_roots = {os.path.realpath(os.fspath(p)) for p in snapshot_roots}
        self._created: set[str] = set()
        if executor is not None and executor_config:
            names = ", ".join(sorted(executor_config))
            raise TypeError(f"pass either executor= or executor settings ({names}), not both")
        if executor is None:
            facade = {"backend", "backend_options", "on_progress"}
            make_config(**{k: v for k, v in executor_config.items() if k not in facade})
        self._executor = executor
        self._config = dict(executor_config)
        self._owned = executor is None
        self._made = threading.Lock()
        self._kernels: dict[str, AgentKernel] = {}

    @property
    def executor(self) -> KernelExecutor | AsyncKernelExecutor:
        """The executor the sessions run on (an owned one is made on first use)."""
        if self._executor is None:
            with self._made:
                if self._executor is None:
                    self._executor = KernelExecutor(**self._config)
        return self._executor

    async def _open(self, agent_id: str, manifest: Manifest) -> tuple[AgentKernel, Manifest]:
        kernel = AgentKernel("openai-agents", agent_id, self.executor, {})
        result = await kernel.acall(lambda s: s.commands.run(["pwd", "-P"], timeout=60))
        if result.exit_code != 0:
            await kernel.aclose()
            raise ExecTransportError(command=("pwd", "-P"), context={"stderr": result.stderr})
        root = result.stdout.rstrip("\n")
        self._kernels[agent_id] = kernel
        self._created.add(agent_id)
        return kernel, manifest.model_copy(update={"root": root}, deep=True)

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: KernelSandboxClientOptions | None = None,
    ) -> SandboxSession:
        """Open a kernelexec session; the manifest's root becomes its working directory."""
        manifest = self._validate_manifest_for_create(manifest or Manifest())
        agent_id = (options.agent_id if options else None) or f"{_PREFIX}-{uuid.uuid4().hex[:12]}"
        kernel, manifest = await self._open(agent_id, manifest)
        session_id = uuid.uuid4()
        # one snapshot per session: a shared id would make runs restore each other's files
        resolved = resolve_snapshot(snapshot, str(session_id))
        if isinstance(resolved, LocalSnapshot):
            self._snapshot_roots.add(await asyncio.to_thread(os.path.realpath, resolved.base_path))
        state = KernelSandboxSessionState(
            session_id=session_id, manifest=manifest, snapshot=resolved, agent_id=agent_id
        )
        return self._wrap_session(self._session(state, kernel))

    def _session(
        self, state: KernelSandboxSessionState, kernel: AgentKernel
    ) -> KernelSandboxSession:
        return KernelSandboxSession(state=state, kernel=kernel, max_archive_bytes=self._max_archive)

    def _check_resumable(self, state: KernelSandboxSessionState) -> None:
        """Refuse a state naming what this client did not make.

        Raises:
            ConfigError: another session's agent id, or a snapshot outside the roots.
        """
        agent_id = state.agent_id
        if agent_id not in self._created:
            if not agent_id.startswith(f"{_PREFIX}-"):
                raise ConfigError(
                    f"cannot resume agent_id {agent_id!r}: this client neither opened it nor "
                    f"names its own sessions so (ids it makes start with {_PREFIX}-)"
                )
            if agent_id in self.executor.sessions:
                raise ConfigError(
                    f"cannot resume agent_id {agent_id!r}: it is an open session this client "
                    "did not open"
                )
        snap = state.snapshot
        if isinstance(snap, LocalSnapshot):
            where = os.path.realpath(snap.base_path)
            if not any(within(where, root) for root in self._snapshot_roots):
                raise ConfigError(
                    f"cannot resume a snapshot in {snap.base_path}: not a directory this client "
                    "made snapshots in (name it in KernelSandboxClient(snapshot_roots=[...]))"
                )

    async def delete(self, session: SandboxSession) -> SandboxSession:
        """Close the session's kernelexec session (its kernel, commands and files go)."""
        inner = session._inner
        if not isinstance(inner, KernelSandboxSession):
            raise TypeError("KernelSandboxClient.delete expects a kernelexec sandbox session")
        self._kernels.pop(inner.agent_id, None)
        await inner.kernel.aclose()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """Reattach to the agent's session while it is open; else open a fresh one (the SDK
        then restores the workspace from the state's snapshot).

        Raises:
            ConfigError: the state names what this client did not make (see the class).
        """
        if not isinstance(state, KernelSandboxSessionState):
            raise TypeError("KernelSandboxClient.resume expects a KernelSandboxSessionState")
        await asyncio.to_thread(self._check_resumable, state)
        kernel, manifest = await self._open(state.agent_id, state.manifest)
        if manifest.root != state.manifest.root:
            state = state.model_copy(update={"manifest": manifest, "workspace_root_ready": False})
        return self._wrap_session(self._session(state, kernel))

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, KernelSandboxSessionState)

    async def aclose(self) -> None:
        """Close every session this client opened, and the executor when it made it."""
        kernels, self._kernels = list(self._kernels.values()), {}
        for kernel in kernels:
            await kernel.aclose()
        if self._owned and self._executor is not None:
            ex, self._executor = self._executor, None
            assert isinstance(ex, KernelExecutor)
            await asyncio.to_thread(ex.close)

    def close(self) -> None:
        """:meth:`aclose` from synchronous code."""
        kernels, self._kernels = list(self._kernels.values()), {}
        for kernel in kernels:
            kernel.close()
        if self._owned and self._executor is not None:
            ex, self._executor = self._executor, None
            assert isinstance(ex, KernelExecutor)
            ex.close()


class KernelPython(Capability):
    """A ``python`` tool on the sandbox session's kernel (variables persist between calls).

    Use it with :class:`KernelSandboxClient`:
    ``SandboxAgent(..., capabilities=[*Capabilities.default(), KernelPython()])``.
    """

    type: Literal["kernelexec_python"] = "kernelexec_python"
    timeout: float | None = None

    def tools(self) -> list[Tool]:
        capability = self

        @function_tool(name_override="python")
        async def python(code: str) -> str:
            """Run Python code in a persistent interpreter (variables, imports and files stay
            from one call to the next; the working directory is the sandbox's). Returns what it
            printed and the value of its last expression, or its error."""
            session = capability.session
            inner = getattr(session, "_inner", session)
            if not isinstance(inner, KernelSandboxSession):
                return "error: the python tool needs a kernelexec sandbox session"
            result = await inner.kernel.acall(
                lambda s: s.run_code(code, timeout=capability.timeout)
            )
            return describe_execution(result)

        return [python]


async def _run_bytes(
    session: AsyncSession, argv: list[str], timeout: float | None
) -> tuple[bytes, bytes, int, bool]:
    """Run a command in the kernel: its stdout and stderr as bytes, exit code, timed out."""
    proc: BackgroundCommand = await session.commands.start(argv)
    try:
        code = await proc.wait(timeout)
    except asyncio.CancelledError:
        await asyncio.shield(proc.kill())
        raise
    timed_out = code is None and proc.running
    if timed_out:
        await proc.kill(signal.SIGKILL)
        await proc.wait()
    out = proc.stdout + _marker(len(proc.stdout), proc.stdout_dropped)
    err = proc.stderr + _marker(len(proc.stderr), proc.stderr_dropped)
    if timed_out:
        return out, err, -signal.SIGKILL, True
    return out, err, proc.exit_code if proc.exit_code is not None else -1, False


async def _fetch(session: AsyncSession, stage: str, limit: int) -> io.IOBase:
    """The kernel's file ``stage`` in a host temporary file (unlinked: gone once closed),
    rewound; :class:`_TooBig` past ``limit`` bytes."""
    out = await asyncio.to_thread(tempfile.TemporaryFile)
    try:
        size = 0
        async with session.files.open_read(stage) as reader:
            async for chunk in reader:
                size += len(chunk)
                if size > limit:
                    raise _TooBig(limit)
                await asyncio.to_thread(out.write, chunk)
        await asyncio.to_thread(out.seek, 0)
    except BaseException:
        out.close()
        raise
    return cast(io.IOBase, out)


async def _send(session: AsyncSession, stage: str, data: io.IOBase) -> None:
    """Write ``data`` (read in chunks) to the kernel's file ``stage``."""
    async with session.files.open_write(stage) as writer:
        while chunk := await asyncio.to_thread(data.read, _CHUNK):
            await writer.write(chunk.encode() if isinstance(chunk, str) else chunk)


def _marker(kept: int, dropped: int) -> bytes:
    return cut_marker(kept, dropped).encode() if dropped else b""
