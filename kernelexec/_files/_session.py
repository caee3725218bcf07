"""``AsyncSessionFiles``: files in and out of one session's working directory, through its
kernel.

Every operation takes the session's lock (so it runs between the session's calls, never during
one) and goes through the session's :class:`~kernelexec._files._link.KernelLink`. A stream
(:class:`FileReader`, :class:`FileWriter`) holds the lock from its start to its end.
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

from kernelexec._exceptions import TreeLimitError
from kernelexec._files._link import KernelLink
from kernelexec._files._wire import DEFAULT_CHUNK, FileInfo, check_path, raise_for_reply
from kernelexec._public import public
from kernelexec.backends._base import KernelConnection, KernelMessage

MAX_READ_BYTES = 64 << 20
"""What :meth:`AsyncSessionFiles.read` holds in memory at most, by default."""
WINDOW = 2
"""File operations in flight at once in a stream: the kernel handles one while the host sends
or takes the other (the kernel answers in order, one at a time, so more would only queue)."""


class AsyncSessionFiles:
    """Files in a session's working directory, moved through its kernel: ``session.files``.

    Paths are relative to the session's working directory; absolute paths, ``..`` leaving it,
    the empty path and links resolving outside it raise :class:`~kernelexec.PathRefusedError`.
    The kernel opens every file, so everything happens with the kernel's rights (at
    ``"process"`` its own uid) and works the same on every backend, a gateway's included.
    File data travels as binary message buffers in chunks of ``chunk_size`` bytes; no
    result-size limit applies. :meth:`read` and :meth:`write` hold the whole file in memory;
    :meth:`open_read`, :meth:`open_write`, :meth:`upload` and :meth:`download` never do.
    """

    def __init__(self, link: KernelLink, *, chunk_size: int = DEFAULT_CHUNK) -> None:
        self._link = link
        self._chunk = DEFAULT_CHUNK
        self.chunk_size = chunk_size

    @property
    def chunk_size(self) -> int:
        """Bytes per message of a transfer (4 MiB); keep it under the websocket message limit
        of a gateway (10 MiB by default for Jupyter Server)."""
        return self._chunk

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"chunk_size must be a positive int, got {value!r}")
        self._chunk = value

    async def write(self, path: str | os.PathLike[str], data: bytes | str) -> FileInfo:
        """Create or replace the file ``path`` with ``data`` (``str`` is written as UTF-8).

        Missing parent directories are made. The file appears whole or not at all (written
        beside it, then renamed); a replaced file keeps its mode.
        """
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data must be bytes or str, not {type(data).__name__}")
        view = memoryview(data).cast("B")
        async with self.open_write(path) as writer:
            for start in range(0, len(view), self.chunk_size):
                await writer.write(view[start : start + self.chunk_size])
        assert writer.info is not None
        return writer.info

    async def read(self, path: str | os.PathLike[str], *, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """The content of the file ``path``, held whole in memory: at most ``max_bytes``
        (default 64 MiB; :meth:`open_read` or :meth:`download` stream a larger file).

        Raises:
            TreeLimitError: the file holds more than ``max_bytes`` (nothing more is read).
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a whole number of bytes, not {max_bytes!r}")
        data = bytearray()
        async with self.open_read(path) as reader:
            if reader.size is not None and reader.size > max_bytes:
                raise TreeLimitError("bytes", max_bytes, f"session file {str(path)!r}")
            async for chunk in reader:
                if len(data) + len(chunk) > max_bytes:
                    raise TreeLimitError("bytes", max_bytes, f"session file {str(path)!r}")
                data += chunk
        return bytes(data)

    def open_read(self, path: str | os.PathLike[str]) -> FileReader:
        """Read ``path`` in chunks: ``async with files.open_read(p) as r: async for chunk in
        r: ...``. The session's other calls wait until the block ends."""
        return FileReader(self._link, check_path(path), str(path), self.chunk_size)

    def open_write(self, path: str | os.PathLike[str]) -> FileWriter:
        """Write ``path`` in pieces: ``async with files.open_write(p) as w: await
        w.write(data)``; the file is in place when the block ends without an error (and
        ``w.info`` describes it), else nothing of it remains."""
        return FileWriter(self._link, check_path(path), str(path), self.chunk_size)

    async def upload(
        self, local_path: str | os.PathLike[str], path: str | os.PathLike[str]
    ) -> FileInfo:
        """Copy the host file ``local_path`` to ``path`` in the session, chunk by chunk."""
        f = await asyncio.to_thread(open, local_path, "rb")  # a slow disk must not stall the loop
        try:
            async with self.open_write(path) as writer:
                while chunk := await asyncio.to_thread(f.read, self.chunk_size):
                    await writer.write(chunk)
        finally:
            f.close()
        assert writer.info is not None
        return writer.info

    async def download(
        self, path: str | os.PathLike[str], local_path: str | os.PathLike[str]
    ) -> int:
        """Copy ``path`` in the session to the host file ``local_path``; return its size."""
        size = 0
        f = await asyncio.to_thread(open, local_path, "wb")
        try:
            async with self.open_read(path) as reader:
                async for chunk in reader:
                    await asyncio.to_thread(f.write, chunk)
                    size += len(chunk)
        finally:
            f.close()
        return size

    async def list(
        self, path: str | os.PathLike[str] = ".", *, recursive: bool = False
    ) -> builtins.list[FileInfo]:
        """The entries of the directory ``path`` sorted by path (all below it with
        ``recursive``, links not followed); a file gives its own entry."""
        got = await self._one({"op": "list", "recursive": bool(recursive)}, path)
        return [FileInfo.model_validate(e) for e in got.content.get("entries") or []]

    async def stat(self, path: str | os.PathLike[str]) -> FileInfo:
        """``path``'s entry (a link inside the directory is followed)."""
        got = await self._one({"op": "stat"}, path)
        return FileInfo.model_validate(got.content["info"])

    async def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists (a link that leads outside still raises)."""
        try:
            await self.stat(path)
        except FileNotFoundError:
            return False
        return True

    async def remove(self, path: str | os.PathLike[str], *, recursive: bool = False) -> None:
        """Remove the file, link or empty directory ``path`` (a non-empty directory with
        ``recursive``). A link is removed itself, never what it points to."""
        await self._one({"op": "remove", "recursive": bool(recursive)}, path)

    async def mkdir(self, path: str | os.PathLike[str], *, parents: bool = True) -> FileInfo:
        """Make the directory ``path`` (with missing parents, and no error if it exists,
        unless ``parents=False``)."""
        got = await self._one({"op": "mkdir", "parents": bool(parents)}, path)
        return FileInfo.model_validate(got.content["info"])

    async def _one(self, content: dict[str, Any], path: str | os.PathLike[str]) -> KernelMessage:
        rel = check_path(path)
        async with self._link.lease.hold():
            conn = await self._link.connect()
            return await self._link.request(conn, {**content, "path": rel}, str(path))


class _Stream:
    """What a reader and a writer share: the lock held for the whole stream, and the handle."""

    def __init__(self, link: KernelLink, rel: str, given: str, chunk_size: int) -> None:
        self._link = link
        self._rel = rel
        self._given = given
        self._chunk = chunk_size
        self._stack: AsyncExitStack | None = None
        self._conn: KernelConnection | None = None
        self._handle: str | None = None

    async def _start(self) -> KernelConnection:
        if self._stack is not None:
            raise RuntimeError("a file stream can be entered only once")
        stack = AsyncExitStack()
        await stack.enter_async_context(self._link.lease.hold())
        self._stack = stack
        try:
            self._conn = await self._link.connect()
        except BaseException:
            await self._end()
            raise
        return self._conn

    async def _end(self) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            if self._handle is not None and self._conn is not None:
                handle, self._handle = self._handle, None
                await self._link.request(self._conn, {"op": "close", "handle": handle}, self._given)
        finally:
            await stack.aclose()

    def _live(self) -> KernelConnection:
        if self._conn is None or self._stack is None:
            raise RuntimeError("use the file stream inside its `async with` block")
        return self._conn


class FileReader(_Stream):
    """A file being read from a session in chunks (from :meth:`AsyncSessionFiles.open_read`).

    Up to :data:`WINDOW` chunks are asked for ahead, so the kernel reads the next while the
    host takes the last.

    Attributes:
        size: The file's size when it was opened.
    """

    size: int | None = None

    async def __aenter__(self) -> FileReader:
        conn = await self._start()
        self._ahead: deque[str] = deque()
        self._asked = 0
        self._eof = False
        try:
            got = await self._link.request(
                conn, {"op": "open_read", "path": self._rel, "chunk": self._chunk}, self._given
            )
        except BaseException:
            await self._end()
            raise
        self.size = int(got.content.get("size") or 0)
        self._first: bytes | None = self._take(got)
        self._asked = len(self._first)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._end()

    def _take(self, got: KernelMessage) -> bytes:
        self._handle = got.content.get("handle")
        self._eof = bool(got.content.get("eof"))
        return bytes(got.buffers[0]) if got.buffers else b""

    async def _ask_ahead(self) -> None:
        """Keep up to WINDOW reads in flight while the file (as big as it was at the open)
        has more, and always one until the end of the file is seen."""
        conn = self._live()
        size = self.size or 0
        while (
            not self._eof
            and self._handle is not None
            and len(self._ahead) < WINDOW
            and (self._asked < size or not self._ahead)
        ):
            content = {"op": "read", "handle": self._handle, "chunk": self._chunk}
            self._ahead.append(await self._link.post(conn, content))
            self._asked += self._chunk

    async def read(self) -> bytes:
        """The next chunk; ``b""`` at the end of the file."""
        conn = self._live()
        if self._first is not None:
            chunk, self._first = self._first, None
            await self._ask_ahead()
            return chunk
        while self._ahead:
            got = await self._link.collect(conn, self._ahead)
            self._ahead.remove(str(got.parent_id))
            if self._eof:
                continue  # asked for past the end (the file shrank): nothing more comes
            raise_for_reply(got.content, self._given)
            chunk = self._take(got)
            await self._ask_ahead()
            if chunk:
                return chunk
        return b""

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.read()
            if not chunk:
                return
            yield chunk


class FileWriter(_Stream):
    """A file being written to a session in pieces (from :meth:`AsyncSessionFiles.open_write`).

    After the first chunk, up to :data:`WINDOW` chunks are in flight, so the kernel writes one
    while the host sends the next.

    Attributes:
        info: The written file's entry, once the block ended without an error.
    """

    info: FileInfo | None = None

    async def __aenter__(self) -> FileWriter:
        await self._start()
        self._pending = bytearray()
        self._opened = False
        self._ahead: deque[str] = deque()
        return self

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; it is sent whenever a chunk's worth has gathered."""
        self._live()
        self._pending += data
        while len(self._pending) >= self._chunk:
            piece = bytes(self._pending[: self._chunk])
            del self._pending[: self._chunk]
            await self._send(piece, final=False)

    async def _send(self, piece: bytes, *, final: bool) -> None:
        conn = self._live()
        if not self._opened:
            content: dict[str, Any] = {"op": "open_write", "path": self._rel, "final": final}
            got = await self._link.request(conn, content, self._given, (piece,))
            self._opened = True
            self._handle = got.content.get("handle")
            self._settled(got, final)
            return
        content = {"op": "write", "handle": self._handle, "final": final}
        self._ahead.append(await self._link.post(conn, content, (piece,)))
        while len(self._ahead) >= (1 if final else WINDOW):
            got = await self._link.collect(conn, self._ahead)
            self._ahead.remove(str(got.parent_id))
            raise_for_reply(got.content, self._given)
            self._settled(got, final and not self._ahead)

    def _settled(self, got: KernelMessage, final: bool) -> None:
        if final:
            self._handle = None
            self.info = FileInfo.model_validate(got.content["info"])

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if et is None:
                piece, self._pending = bytes(self._pending), bytearray()
                await self._send(piece, final=True)
        finally:
            await self._end()  # an unfinished upload is removed in the kernel


public(__name__)
