"""``SessionFiles`` and ``SessionCommands``: the blocking twins of ``AsyncSessionFiles`` and
``AsyncSessionCommands`` (``Session.files``, ``Session.commands``).

Every method is one call into the executor's event-loop thread through ``call`` (the blocking
facade's portal); streams enter, step and leave their async twin the same way.
"""

from __future__ import annotations

import builtins
import os
import signal
from collections.abc import Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from kernelexec._files._commands import (
    MAX_OUTPUT,
    AsyncSessionCommands,
    BackgroundCommand,
    CommandResult,
)
from kernelexec._files._session import MAX_READ_BYTES, AsyncSessionFiles, FileReader, FileWriter
from kernelexec._files._wire import FileInfo
from kernelexec._public import public

T = TypeVar("T")
Call = Callable[..., Any]
"""Runs a coroutine function on the executor's loop thread and returns its result."""


class SessionFiles:
    """Files in a session's working directory; see :class:`~kernelexec.AsyncSessionFiles`."""

    def __init__(self, inner: AsyncSessionFiles, call: Call) -> None:
        self._inner = inner
        self._call = call

    @property
    def chunk_size(self) -> int:
        """Bytes per message of a transfer (4 MiB)."""
        return self._inner.chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        self._inner.chunk_size = value

    def write(self, path: str | os.PathLike[str], data: bytes | str) -> FileInfo:
        """Create or replace ``path`` with ``data``; see :meth:`AsyncSessionFiles.write`."""
        return self._run(self._inner.write, path, data)

    def read(self, path: str | os.PathLike[str], *, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """The content of ``path``, at most ``max_bytes``; see :meth:`AsyncSessionFiles.read`."""
        return self._run(self._inner.read, path, max_bytes=max_bytes)

    def list(
        self, path: str | os.PathLike[str] = ".", *, recursive: bool = False
    ) -> builtins.list[FileInfo]:
        """The entries of ``path``; see :meth:`AsyncSessionFiles.list`."""
        return self._run(self._inner.list, path, recursive=recursive)

    def stat(self, path: str | os.PathLike[str]) -> FileInfo:
        """``path``'s entry; see :meth:`AsyncSessionFiles.stat`."""
        return self._run(self._inner.stat, path)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists; see :meth:`AsyncSessionFiles.exists`."""
        return self._run(self._inner.exists, path)

    def remove(self, path: str | os.PathLike[str], *, recursive: bool = False) -> None:
        """Remove ``path``; see :meth:`AsyncSessionFiles.remove`."""
        self._run(self._inner.remove, path, recursive=recursive)

    def mkdir(self, path: str | os.PathLike[str], *, parents: bool = True) -> FileInfo:
        """Make the directory ``path``; see :meth:`AsyncSessionFiles.mkdir`."""
        return self._run(self._inner.mkdir, path, parents=parents)

    def upload(self, local_path: str | os.PathLike[str], path: str | os.PathLike[str]) -> FileInfo:
        """Copy a host file into the session; see :meth:`AsyncSessionFiles.upload`."""
        return self._run(self._inner.upload, local_path, path)

    def download(self, path: str | os.PathLike[str], local_path: str | os.PathLike[str]) -> int:
        """Copy a session file to the host; see :meth:`AsyncSessionFiles.download`."""
        return self._run(self._inner.download, path, local_path)

    def open_read(self, path: str | os.PathLike[str]) -> BlockingFileReader:
        """Read ``path`` in chunks: ``with files.open_read(p) as r: for chunk in r: ...``."""
        return BlockingFileReader(self._inner.open_read(path), self._call)

    def open_write(self, path: str | os.PathLike[str]) -> BlockingFileWriter:
        """Write ``path`` in pieces: ``with files.open_write(p) as w: w.write(data)``."""
        return BlockingFileWriter(self._inner.open_write(path), self._call)

    def _run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        result: T = self._call(fn, *args, **kwargs)
        return result


class BlockingFileReader:
    """Blocking twin of :class:`FileReader`."""

    def __init__(self, inner: FileReader, call: Call) -> None:
        self._inner = inner
        self._call = call

    @property
    def size(self) -> int | None:
        """The file's size when it was opened."""
        return self._inner.size

    def __enter__(self) -> BlockingFileReader:
        self._call(self._inner.__aenter__)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._call(self._inner.__aexit__, et, e, tb)

    def read(self) -> bytes:
        """The next chunk; ``b""`` at the end of the file."""
        chunk: bytes = self._call(self._inner.read)
        return chunk

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read():
            yield chunk


class BlockingFileWriter:
    """Blocking twin of :class:`FileWriter`."""

    def __init__(self, inner: FileWriter, call: Call) -> None:
        self._inner = inner
        self._call = call

    @property
    def info(self) -> FileInfo | None:
        """The written file's entry, once the block ended without an error."""
        return self._inner.info

    def __enter__(self) -> BlockingFileWriter:
        self._call(self._inner.__aenter__)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._call(self._inner.__aexit__, et, e, tb)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; see :meth:`FileWriter.write`."""
        self._call(self._inner.write, data)


class SessionCommands:
    """Background commands in a session's kernel; see :class:`~kernelexec.AsyncSessionCommands`."""

    def __init__(self, inner: AsyncSessionCommands, call: Call) -> None:
        self._inner = inner
        self._call = call

    def start(
        self,
        command: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = ".",
        max_output: int = MAX_OUTPUT,
    ) -> BlockingBackgroundCommand:
        """Start ``command`` and return at once; see :meth:`AsyncSessionCommands.start`."""
        proc = self._call(self._inner.start, command, env=env, cwd=cwd, max_output=max_output)
        return BlockingBackgroundCommand(proc, self._call)

    def run(
        self,
        command: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = ".",
        timeout: float | None = None,
        max_output: int = MAX_OUTPUT,
    ) -> CommandResult:
        """Run ``command`` to its end; see :meth:`AsyncSessionCommands.run`."""
        result: CommandResult = self._call(
            self._inner.run, command, env=env, cwd=cwd, timeout=timeout, max_output=max_output
        )
        return result


class BlockingBackgroundCommand:
    """Blocking twin of :class:`BackgroundCommand`."""

    def __init__(self, inner: BackgroundCommand, call: Call) -> None:
        self._inner = inner
        self._call = call

    @property
    def pid(self) -> int:
        """Its supervisor's process id in the kernel's namespace (also its process group)."""
        return self._inner.pid

    @property
    def exit_code(self) -> int | None:
        """Its exit status once it ended, else None."""
        return self._inner.exit_code

    @property
    def running(self) -> bool:
        """Whether it had not ended at the last poll."""
        return self._inner.running

    @property
    def stdout(self) -> bytes:
        """Standard output gathered so far."""
        return self._inner.stdout

    @property
    def stderr(self) -> bytes:
        """Standard error gathered so far."""
        return self._inner.stderr

    def poll(self, wait: float = 0.0) -> int | None:
        """Gather new output; see :meth:`BackgroundCommand.poll`."""
        code: int | None = self._call(self._inner.poll, wait)
        return code

    def wait(self, timeout: float | None = None) -> int | None:
        """Poll until it ends; see :meth:`BackgroundCommand.wait`."""
        code: int | None = self._call(self._inner.wait, timeout)
        return code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal its process group; see :meth:`BackgroundCommand.kill`."""
        self._call(self._inner.kill, sig)

    def result(self, *, timed_out: bool = False) -> CommandResult:
        """What was gathered; see :meth:`BackgroundCommand.result`."""
        return self._inner.result(timed_out=timed_out)


public(__name__)
