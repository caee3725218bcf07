"""The host half of the files protocol: checking paths, the install request, one exchange of a
request and its reply, and the reply's errors as exceptions.

Its counterpart runs inside the kernel (``_kernel_files.py`` and ``_kernel_commands.py``,
kernel modules installed on a kernel's first file operation); the constants both halves need
are defined there and imported here. A request is asked with :func:`kernelexec.backends._base.ask`.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from kernelexec import _proctitle
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
from kernelexec._files import _kernel_supervisor as kernel_supervisor
from kernelexec._protocol import _install
from kernelexec._protocol._install import ExecuteRequest, KernelModule
from kernelexec._public import public
from kernelexec.backends._base import Stalled as Stalled
from kernelexec.backends._base import ask
from kernelexec.backends._base import wait_reply as wait_reply

FILES_REQUEST = kernel_files.FILES_REQUEST
FILES_REPLY = kernel_files.FILES_REPLY
COMMAND_REQUEST = kernel_commands.COMMAND_REQUEST
COMMAND_REPLY = kernel_commands.COMMAND_REPLY

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


FILES_MODULE = KernelModule(kernel_files.MODULE_NAME, kernel_files.__name__)
COMMANDS_MODULE = KernelModule(kernel_commands.MODULE_NAME, kernel_commands.__name__)


exchange = ask
"""One files or commands request and its reply (:func:`kernelexec.backends._base.ask`)."""


SUPERVISOR = KernelModule("__main__", kernel_supervisor.__name__, entry=None)
"""A command's supervisor: not installed as a module but handed to the commands helper, which
runs it (titled) as each command's parent."""


def _supervisor_code() -> str:
    title = f"kx_set_title({_proctitle.COMMAND!r}, {_proctitle.COMMS[_proctitle.COMMAND]!r})\n"
    return _proctitle.SOURCE + title + SUPERVISOR.source()


def install_request(workdir: str) -> ExecuteRequest:
    """The request that installs the files and commands helpers in a kernel; its reply says
    whether both serve (:func:`installed`)."""
    modules = [(FILES_MODULE, [workdir]), (COMMANDS_MODULE, [_supervisor_code()])]
    return _install.install_request(modules)


def installed(reply: dict[str, Any]) -> bool:
    """Whether the reply to :func:`install_request` says both handlers are registered."""
    got = _install.answers(reply)
    return bool(got) and all(answer is True for answer in got or ())


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
