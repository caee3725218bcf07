"""deepagents on kernelexec: ``create_deep_agent(backend=KernelSandbox())``.

:class:`KernelSandbox` is a deepagents sandbox backend (``BaseSandbox``): ``execute`` runs the
command with bash in one kernelexec session's kernel (its own user and limits at
``"process"``), in the session's working directory; deepagents' file tools (``ls``, ``read``,
``write``, ``edit``, ``grep``, ``glob``) run through it; ``upload_files`` and
``download_files`` move bytes through the kernel with ``session.files``. :meth:`python_tool`
adds a ``python`` tool on the same kernel, so the agent's Python state persists between steps.

Needs the ``deepagents`` extra: ``pip install 'kernelexec[deepagents]'``.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import Any

try:
    from deepagents.backends.protocol import (
        ExecuteResponse,
        FileDownloadResponse,
        FileUploadResponse,
    )
    from deepagents.backends.sandbox import BaseSandbox
    from langchain_core.tools import BaseTool, StructuredTool
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kernelexec.compat.deepagents needs deepagents ({exc.name} is missing): "
        "pip install 'kernelexec[deepagents]'"
    ) from exc

from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._exceptions import (
    PathRefusedError,
    SessionFileError,
    SessionIsADirectoryError,
    SessionPermissionError,
)
from kernelexec._files._commands import CommandResult
from kernelexec._sync import KernelExecutor
from kernelexec.compat._bridge import AgentKernel, describe_execution

__all__ = ["KernelSandbox"]

_STAGE = ".kernelexec-transfer"
"""Start of the name of a file in the working directory that holds, for a moment, a file bound
for (or from) a path outside it."""

# Runs in the kernel's own process tree (as a command), so with the kernel's rights:
# ``put STAGED DEST`` / ``get SRC STAGED``; prints the error literal, or nothing.
_COPY = """\
import os, shutil, sys
op, src, dst = sys.argv[1:4]
try:
    if op == "put":
        parent = os.path.dirname(dst)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if os.path.isdir(dst):
            raise IsADirectoryError(dst)
        shutil.copyfile(src, dst)
    else:
        if os.path.isdir(src):
            raise IsADirectoryError(src)
        shutil.copyfile(src, dst)
except FileNotFoundError:
    print("file_not_found")
except IsADirectoryError:
    print("is_directory")
except PermissionError:
    print("permission_denied")
except (OSError, ValueError):
    print("invalid_path")
finally:
    if op == "put":
        try:
            os.unlink(src)
        except OSError:
            pass
"""


class KernelSandbox(BaseSandbox):
    """A deepagents sandbox backend on one kernelexec session (one agent's kernel).

    Args:
        agent_id: The session's agent id, also the sandbox's ``id`` (default: a fresh
            ``deepagents-<hex>``).
        executor: A :class:`~kernelexec.KernelExecutor` (or an
            :class:`~kernelexec.AsyncKernelExecutor` running on another thread) to share; it
            stays open after :meth:`close`.
        timeout: Seconds before a command is killed when deepagents gives no timeout (default:
            none).
        **executor_config: :class:`~kernelexec.ExecutorConfig` fields for an executor the
            sandbox makes itself (on first use) and closes in :meth:`close`.
    """

    def __init__(
        self,
        *,
        agent_id: str | None = None,
        executor: KernelExecutor | AsyncKernelExecutor | None = None,
        timeout: float | None = None,
        **executor_config: Any,
    ) -> None:
        self._kernel = AgentKernel("deepagents", agent_id, executor, executor_config)
        self._timeout = timeout
        self._workdir: str | None = None

    @property
    def id(self) -> str:
        """The kernelexec session's agent id."""
        return self._kernel.agent_id

    def working_dir(self) -> str:
        """The session's working directory as its kernel sees it (an absolute path)."""
        if self._workdir is None:
            result = self._run(["pwd", "-P"], 60)
            if result.exit_code != 0:
                raise RuntimeError(f"pwd failed in the kernel: {result.stderr}")
            self._workdir = result.stdout.rstrip("\n")
        return self._workdir

    def _run(self, argv: list[str], timeout: float | None) -> CommandResult:
        return self._kernel.call(lambda s: s.commands.run(argv, timeout=timeout))

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        """Run ``command`` with bash in the kernel; stdout and stderr as they interleave.

        A command that runs past ``timeout`` seconds is killed: exit code 124, as with
        ``timeout(1)``, and a line saying so after its output.
        """
        limit = self._timeout if timeout is None else timeout
        result = self._run(["bash", "-c", "exec 2>&1\n" + command], limit)
        output = result.stdout + result.stderr
        if result.timed_out:
            note = f"Error: the command ran past its timeout of {limit} s and was killed."
            output = f"{output}\n{note}" if output else note
            return ExecuteResponse(output=output, exit_code=124, truncated=result.truncated)
        return ExecuteResponse(
            output=output, exit_code=result.exit_code, truncated=result.truncated
        )

    def _inside(self, path: str) -> str | None:
        """``path`` relative to the working directory, or None when it is outside."""
        root = self.working_dir()
        norm = posixpath.normpath(path)
        if norm.startswith(root + "/"):
            return norm[len(root) + 1 :]
        return None

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Write each file (its parent folders made) with the kernel's rights."""
        responses = []
        for path, data in files:
            if not path.startswith("/"):
                responses.append(FileUploadResponse(path=path, error="invalid_path"))
                continue
            rel = self._inside(path)
            error: str | None = None
            try:
                if rel is not None:
                    self._write(rel, data)
                else:
                    error = self._through_stage("put", path, data)
            except PathRefusedError:
                error = self._through_stage("put", path, data)
            except SessionFileError as exc:
                error = _literal(exc)
            responses.append(FileUploadResponse(path=path, error=error))
        return responses

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Read each file with the kernel's rights."""
        responses = []
        for path in paths:
            if not path.startswith("/"):
                responses.append(FileDownloadResponse(path=path, error="invalid_path"))
                continue
            rel = self._inside(path)
            content: bytes | None = None
            error: str | None = None
            try:
                if rel is not None:
                    content = self._read(rel)
                else:
                    content, error = self._fetch_outside(path)
            except PathRefusedError:
                content, error = self._fetch_outside(path)
            except SessionFileError as exc:
                error = _literal(exc)
            responses.append(FileDownloadResponse(path=path, content=content, error=error))
        return responses

    def _write(self, rel: str, data: bytes) -> None:
        self._kernel.call(lambda s: s.files.write(rel, data))

    def _read(self, rel: str) -> bytes:
        return self._kernel.call(lambda s: s.files.read(rel))

    def _fetch_outside(self, path: str) -> tuple[bytes | None, str | None]:
        stage = f"{_STAGE}-{uuid.uuid4().hex}"
        error = self._through_stage("get", path, None, stage)
        if error is not None:
            return None, error
        try:
            return self._kernel.call(lambda s: s.files.read(stage)), None
        finally:
            self._kernel.call(lambda s: s.files.remove(stage))

    def _through_stage(
        self, op: str, path: str, data: bytes | None, stage: str | None = None
    ) -> str | None:
        """Copy between ``path`` (outside the working directory) and a staged file inside it,
        in the kernel with its rights; the error literal, or None."""
        stage = stage or f"{_STAGE}-{uuid.uuid4().hex}"
        if data is not None:
            self._kernel.call(lambda s: s.files.write(stage, data))
        staged = posixpath.join(self.working_dir(), stage)
        src, dst = (staged, path) if op == "put" else (path, staged)
        result = self._run(["python", "-c", _COPY, op, src, dst], 600)
        if result.exit_code != 0:
            return f"copy failed: {result.stderr.strip()[-500:]}"
        return result.stdout.strip() or None

    def python_tool(self, *, timeout: float | None = None) -> BaseTool:
        """A ``python`` tool on this sandbox's kernel: ``create_deep_agent(tools=[...])``. Its
        description names the working directory (this starts the session's kernel)."""

        def python(code: str) -> str:
            return describe_execution(self._kernel.run_code(code, timeout=timeout))

        description = (
            "Run Python code in a persistent interpreter (variables, imports and files stay "
            "from one call to the next). Returns what it printed and the value of its last "
            "expression, or its error with the whole traceback. The working directory is "
            f"{self.working_dir()}: relative paths are there."
        )
        return StructuredTool.from_function(python, name="python", description=description)

    def system_prompt(self) -> str:
        """A piece for ``create_deep_agent(system_prompt=...)`` that tells the model where it
        works: deepagents' file tools take absolute paths, and only the sandbox's working
        directory is the agent's to write (``/notes.md`` is refused). Starts the session's
        kernel."""
        root = self.working_dir()
        return (
            f"Your working directory is {root}. Commands and Python run there; write files "
            f"under it, with absolute paths in the file tools (for example {root}/notes.md)."
        )

    def close(self) -> None:
        """Close the session (its kernel and commands end), and the executor when the
        sandbox made it."""
        self._kernel.close()


def _literal(exc: SessionFileError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "file_not_found"
    if isinstance(exc, SessionIsADirectoryError):
        return "is_directory"
    if isinstance(exc, SessionPermissionError):
        return "permission_denied"
    return "invalid_path"
