"""The host half of the files protocol: checking paths, the install request, one exchange of a
request and its reply, and the reply's errors as exceptions.

Its counterpart runs inside the kernel (``_kernel_files.py``, sent as text on a kernel's first
file operation); the constants both halves need are defined there and imported here.
"""

from __future__ import annotations

import errno
import importlib.resources
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from kernelexec._exceptions import (
    FileTransferError,
    PathRefusedError,
    SessionFileError,
    SessionFileExistsError,
    SessionFileNotFoundError,
    SessionIsADirectoryError,
    SessionNotADirectoryError,
    SessionPermissionError,
)
from kernelexec._files import _kernel_commands as kernel_commands
from kernelexec._files import _kernel_files as kernel_files
from kernelexec._protocol._host import ExecuteRequest
from kernelexec._public import public
from kernelexec.backends._base import KernelConnection, KernelDied, KernelMessage

FILES_REQUEST = kernel_files.FILES_REQUEST
FILES_REPLY = kernel_files.FILES_REPLY
COMMAND_REQUEST = kernel_commands.COMMAND_REQUEST
COMMAND_REPLY = kernel_commands.COMMAND_REPLY
_METADATA_KEY = "kernelexec_files"

DEFAULT_CHUNK = 4 << 20
"""Bytes per message. Well under the 10 MiB a Jupyter Server websocket accepts by default
(tornado's ``websocket_max_message_size``), so chunks pass a gateway unchanged."""


class FileInfo(BaseModel):
    """One entry of a session's working directory.

    Attributes:
        path: Relative to the session's working directory (``"data/a.csv"``).
        size: Bytes (of the link itself for a symbolic link).
        is_dir: Whether it is a directory (a link to one is not).
        is_symlink: Whether it is a symbolic link (listings do not follow links).
        modified: Last modification, seconds since the epoch.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    path: str
    size: int
    is_dir: bool
    is_symlink: bool = False
    modified: float | None = None


def check_path(path: Any) -> str:
    """``path`` relative to the working directory, normalised (``a/./b/../c`` is ``a/c``;
    the directory itself is ``"."``).

    Raises:
        TypeError: ``path`` is not a ``str`` or path object.
        PathRefusedError: it is empty, absolute, holds a NUL byte, or ``..`` leaves the
            working directory.
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path must be str, not {type(path).__name__}")
    if path == "":
        raise PathRefusedError(path, "the empty path names no file")
    if "\x00" in path:
        raise PathRefusedError(path, "it contains a NUL character")
    if path.startswith("/"):
        reason = "absolute paths are refused; give it relative to the working directory"
        raise PathRefusedError(path, reason)
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise PathRefusedError(path, "'..' leaves the working directory")
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts) or "."


def install_request(workdir: str) -> ExecuteRequest:
    """The request that installs the files and commands helpers in a kernel (their sources
    ride in the metadata) and says in its reply's payload whether both serve."""
    folder = importlib.resources.files(__package__)
    modules = [
        (kernel_files.MODULE_NAME, folder.joinpath("_kernel_files.py").read_text(), [workdir]),
        (kernel_commands.MODULE_NAME, folder.joinpath("_kernel_commands.py").read_text(), []),
    ]
    code = (
        "def __kx_files():\n"
        "    import sys, types\n"
        "    from IPython import get_ipython\n"
        "    ip = get_ipython()\n"
        f"    meta = ip.kernel.get_parent()['metadata'][{_METADATA_KEY!r}]\n"
        "    serves = True\n"
        "    for name, source, args in meta['modules']:\n"
        "        mod = types.ModuleType(name)\n"
        "        sys.modules[name] = mod\n"
        "        exec(compile(source, f'<{name}>', 'exec'), mod.__dict__)\n"
        "        serves = mod.install(*args) is True and serves\n"
        f"    ip.payload_manager.write_payload({{'source': {kernel_files.SERVES_PAYLOAD!r},"
        " 'serves': serves})\n"
        "__kx_files(); del __kx_files\n"
    )
    return ExecuteRequest(
        code=code,
        silent=True,
        store_history=False,
        metadata={_METADATA_KEY: {"modules": modules}},
    )


def installed(reply: dict[str, Any]) -> bool:
    """Whether the reply to :func:`install_request` says the handler is registered."""
    for payload in reply.get("payload") or []:
        if isinstance(payload, dict) and payload.get("source") == kernel_files.SERVES_PAYLOAD:
            return payload.get("serves") is True
    return False


@dataclass(frozen=True, slots=True)
class Stalled:
    """No reply within the time allowed (``died``: the kernel died meanwhile)."""

    died: KernelDied | None = None


async def exchange(
    conn: KernelConnection,
    msg_type: str,
    content: dict[str, Any],
    *,
    reply_type: str,
    timeout: float,
    metadata: dict[str, Any] | None = None,
    buffers: tuple[bytes, ...] = (),
) -> KernelMessage | Stalled:
    """Send one shell request and wait for its reply (other messages are passed over: the
    session's lock is held, so they can only be late ones of a finished run)."""
    msg_id = await conn.send("shell", msg_type, content, metadata=metadata, buffers=buffers)
    return await wait_reply(conn, msg_id, reply_type, timeout)


async def wait_reply(
    conn: KernelConnection, msg_ids: str | Collection[str], reply_type: str, timeout: float
) -> KernelMessage | Stalled:
    """The reply of type ``reply_type`` to ``msg_ids`` (the first to come when several are
    awaited: the kernel answers its shell requests in order), or :class:`Stalled` after
    ``timeout``."""
    ids = {msg_ids} if isinstance(msg_ids, str) else msg_ids
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Stalled()
        msg = await conn.receive(left)
        if msg is None:
            continue
        if isinstance(msg, KernelDied):
            return Stalled(died=msg)
        if msg.parent_id in ids and msg.channel == "shell" and msg.msg_type == reply_type:
            return msg


_KINDS: dict[str, tuple[type[SessionFileError], int]] = {
    "not_found": (SessionFileNotFoundError, errno.ENOENT),
    "is_directory": (SessionIsADirectoryError, errno.EISDIR),
    "not_directory": (SessionNotADirectoryError, errno.ENOTDIR),
    "permission_denied": (SessionPermissionError, errno.EACCES),
    "exists": (SessionFileExistsError, errno.EEXIST),
    "not_empty": (SessionFileError, errno.ENOTEMPTY),
}


def raise_for_reply(content: dict[str, Any], path: str) -> None:
    """Raise what an error reply means; return for a success.

    Raises:
        PathRefusedError: the kernel found the path leaving the working directory.
        SessionFileError: (a subclass for each common case) the kernel's file system refused.
        FileTransferError: the kernel side failed in a way of its own.
    """
    if content.get("status") == "ok":
        return
    kind = str(content.get("kind", ""))
    message = str(content.get("message", "failed"))
    if kind == kernel_files.REFUSED:
        raise PathRefusedError(path, message)
    found = _KINDS.get(kind)
    if found is not None:
        cls, code = found
        raise cls(code, message, path)
    if kind == "os_error":
        raise SessionFileError(errno.EIO, message, path)
    raise FileTransferError(f"file operation on {path!r} failed in the kernel: {message}")


public(__name__)
