"""The files helper that kernelexec installs inside a kernel on its first file operation.

Never imported by the host's code paths that talk to kernels: its source text is sent to the
kernel (like ``_protocol/_kernel_side.py``) and run there as the module ``__kernelexec_files__``.
Standard library only.

It serves one shell message type of its own, :data:`FILES_REQUEST`, answered by
:data:`FILES_REPLY`. File data travels in the messages' binary buffers (Jupyter's zmq frames,
the gateway websocket's binary frames), never as JSON or base64, and in chunks, so no file has
to fit in one message or in the host's memory. Because the kernel itself opens every file, the
host reads and writes with the kernel's rights only (at ``"process"`` the kernel's own uid), and
a link planted by the kernel's code can reach nothing the code could not reach itself.

Paths are relative to the session's working directory (the one ``configure`` entered). A path
is refused when it, or a link on its way, resolves outside that directory; each opened file
descriptor is checked again through ``/proc/self/fd`` so a link swapped in between the check
and the open is caught too. Only regular files are read (a planted FIFO would block the shell).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import uuid
from typing import Any

MODULE_NAME = "__kernelexec_files__"
"""The name this module is installed under in the kernel's ``sys.modules``."""

FILES_REQUEST = "kernelexec_files_request"
"""The shell message type of a file operation; ``content["op"]`` names it."""

FILES_REPLY = "kernelexec_files_reply"

REFUSED = "refused"
"""The error kind of a path that leaves the working directory (or is not a regular file)."""

_ERRNO_KINDS = {
    errno.ENOENT: "not_found",
    errno.EISDIR: "is_directory",
    errno.ENOTDIR: "not_directory",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EEXIST: "exists",
    errno.ENOTEMPTY: "not_empty",
    errno.ELOOP: REFUSED,  # a link appeared where the path had none when it was checked
}

_Reply = tuple[dict[str, Any], list[Any]]
_handles: dict[str, Any] = {}
_state: dict[str, Any] = {"root": None}


class Refused(Exception):
    """A path that leaves the working directory, or an entry that is not a regular file."""


def install(root: str) -> bool:
    """Register the handler of :data:`FILES_REQUEST`; False when this ipykernel has no handler
    table. ``root`` is the working directory when the kernel side did not record one."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    recorded = getattr(sys.modules.get("__kernelexec__"), "_state", {}).get("workdir")
    _state["root"] = os.path.realpath(recorded or root)
    handlers = getattr(kernel, "shell_handlers", None)
    if not isinstance(handlers, dict):
        return False
    publish = getattr(kernel, "_publish_status", None)
    if publish is not None:

        def publish_status(status: Any, channel: Any, parent: Any = None) -> Any:
            # No busy/idle on iopub for a chunk: the host waits for the reply only.
            msg = parent if parent is not None else kernel.get_parent(channel)
            header = msg.get("header") if isinstance(msg, dict) else None
            if isinstance(header, dict) and header.get("msg_type") == FILES_REQUEST:
                return None
            return publish(status, channel, parent)

        kernel._publish_status = publish_status

    def handler(stream: Any, ident: Any, parent: Any) -> None:
        buffers = [_bytes(b) for b in parent.get("buffers") or []]
        reply, out = serve(parent.get("content") or {}, buffers)
        kernel.session.send(stream, FILES_REPLY, reply, parent, ident=ident, buffers=out)

    handlers[FILES_REQUEST] = handler
    return True


def _bytes(buffer: Any) -> memoryview:
    return memoryview(getattr(buffer, "buffer", buffer))


def serve(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    """Run one operation; return the reply's content and buffers. Never raises."""
    op = content.get("op")
    path = content.get("path")
    try:
        fn = _OPS.get(str(op))
        if fn is None:
            return _error("invalid", f"unknown file operation {op!r}", path), []
        return fn(content, buffers)
    except Refused as exc:
        return _error(REFUSED, str(exc), path), []
    except OSError as exc:
        kind = _ERRNO_KINDS.get(exc.errno or 0, "os_error")
        return _error(kind, exc.strerror or str(exc), path), []
    except Exception as exc:  # a fault of kernelexec's own: answer rather than go silent
        return _error("internal", f"{type(exc).__name__}: {exc}", path), []


def _error(kind: str, message: str, path: Any) -> dict[str, Any]:
    return {"status": "error", "kind": kind, "message": _shown(message), "path": path}


# -- paths --------------------------------------------------------------------------------------


def _root() -> str:
    root = _state["root"]
    os.makedirs(root, exist_ok=True)
    return str(root)


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip("/") + "/")


def _resolve(rel: str, *, follow: bool = True) -> tuple[str, str]:
    """``(root, real path)`` of ``rel``; links followed (the last one only when ``follow``)."""
    root = _root()
    full = os.path.join(root, rel)
    if follow:
        real = os.path.realpath(full)
    else:
        head, name = os.path.split(os.path.normpath(full))
        real = os.path.join(os.path.realpath(head), name)
    if not _inside(real, root):
        raise Refused(f"{rel!r} resolves outside the working directory")
    return root, real


def _check_fd(fd: int, root: str, rel: str) -> None:
    """Refuse an open descriptor that is not inside ``root`` (a link swapped in meanwhile)."""
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return  # no /proc: the realpath check before the open stands alone
    if not _inside(where, root):
        os.close(fd)
        raise Refused(f"{rel!r} resolves outside the working directory")


def _open_dir(path: str, root: str, rel: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    _check_fd(fd, root, rel)
    return fd


def _shown(name: str) -> str:
    """A file name as text that any reply can carry: bytes that are not UTF-8 (held as
    surrogates by ``os``) are written as ``\\xNN`` escapes."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _info(rel: str, st: os.stat_result, link: bool = False) -> dict[str, Any]:
    return {
        "path": _shown(rel),
        "size": st.st_size,
        "is_dir": stat.S_ISDIR(st.st_mode),
        "is_symlink": link,
        "modified": st.st_mtime,
    }


# -- reading -----------------------------------------------------------------------------------


def _open_read(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    rel = str(content["path"])
    root, real = _resolve(rel)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    _check_fd(fd, root, rel)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
        raise Refused(f"{rel!r} is not a regular file")
    handle = uuid.uuid4().hex
    _handles[handle] = os.fdopen(fd, "rb", buffering=0)
    reply, out = _read({"handle": handle, "chunk": content.get("chunk")}, [])
    reply["size"] = st.st_size
    return reply, out


def _read(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    handle = str(content["handle"])
    f = _handles.get(handle)
    if f is None:
        return _error("invalid", "no such open file (the kernel was restarted?)", None), []
    size = int(content.get("chunk") or 4 << 20)
    data = bytearray(size)
    got = f.readinto(data) or 0
    eof = got < size
    if eof:
        _handles.pop(handle).close()
    return {"status": "ok", "handle": None if eof else handle, "eof": eof}, [memoryview(data)[:got]]


# -- writing -----------------------------------------------------------------------------------


class _Upload:
    """A file being written: a hidden temporary file beside the target, renamed at the end."""

    def __init__(self, dir_fd: int, name: str, rel: str) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.rel = rel
        self.temp = f".{name}.kx-{uuid.uuid4().hex[:12]}.part"
        mode = 0o666
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
            if stat.S_ISREG(st.st_mode):
                mode = stat.S_IMODE(st.st_mode)  # replacing a file keeps its mode
        except FileNotFoundError:
            pass
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.temp, flags, mode, dir_fd=dir_fd)
        self.size = 0

    def write(self, data: memoryview) -> None:
        while data:
            n = os.write(self.fd, data)
            data = data[n:]
            self.size += n

    def commit(self) -> dict[str, Any]:
        os.close(self.fd)
        self.fd = -1
        os.replace(self.temp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.temp = ""
        st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        self.close_dir()
        return _info(self.rel, st)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.temp and self.dir_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp, dir_fd=self.dir_fd)
        self.close_dir()

    def close_dir(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


def _open_write(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    rel = str(content["path"])
    root, real = _resolve(rel)
    if real == root:
        raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
    parent, name = os.path.split(real)
    os.makedirs(parent, exist_ok=True)
    dir_fd = _open_dir(parent, root, rel)
    try:
        upload = _Upload(dir_fd, name, rel)
    except BaseException:
        os.close(dir_fd)
        raise
    handle = uuid.uuid4().hex
    _handles[handle] = upload
    return _write({"handle": handle, "final": content.get("final")}, buffers)


def _write(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    handle = str(content["handle"])
    upload = _handles.get(handle)
    if not isinstance(upload, _Upload):
        return _error("invalid", "no such open file (the kernel was restarted?)", None), []
    try:
        for buffer in buffers:
            upload.write(buffer)
        if not content.get("final"):
            return {"status": "ok", "handle": handle}, []
        del _handles[handle]
        return {"status": "ok", "handle": None, "info": upload.commit()}, []
    except BaseException:
        _handles.pop(handle, None)
        upload.abort()
        raise


def _close(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    """Drop an open file: a reader is closed, an unfinished upload removed."""
    found = _handles.pop(str(content.get("handle")), None)
    if isinstance(found, _Upload):
        found.abort()
    elif found is not None:
        found.close()
    return {"status": "ok"}, []


# -- the rest ----------------------------------------------------------------------------------


def _stat(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    rel = str(content["path"])
    _, lexical = _resolve(rel, follow=False)
    link = os.path.islink(lexical)
    _, real = _resolve(rel)
    return {"status": "ok", "info": _info(rel, os.stat(real), link)}, []


def _list(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    rel = str(content["path"])
    root, real = _resolve(rel)
    base = "" if rel == "." else rel
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        return {"status": "ok", "entries": [_info(rel, st)]}, []
    fd = _open_dir(real, root, rel)
    os.close(fd)
    entries = []
    if content.get("recursive"):
        for top, dirs, files in os.walk(real):
            prefix = os.path.relpath(top, real)
            for name in dirs + files:
                entries.append(_entry(os.path.join(top, name), base, prefix, name))
        entries.sort(key=lambda e: str(e["path"]).split("/"))
    else:
        with os.scandir(real) as it:
            for item in sorted(it, key=lambda e: e.name):
                entries.append(_entry(item.path, base, ".", item.name))
    return {"status": "ok", "entries": entries}, []


def _entry(full: str, base: str, prefix: str, name: str) -> dict[str, Any]:
    st = os.lstat(full)
    rel = os.path.normpath(os.path.join(base, prefix, name))
    return _info(rel, st, stat.S_ISLNK(st.st_mode))


def _remove(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    rel = str(content["path"])
    root, real = _resolve(rel, follow=False)  # a link is removed, never what it points to
    if real == root:
        raise Refused("the working directory itself cannot be removed")
    parent, name = os.path.split(real)
    dir_fd = _open_dir(parent, root, rel)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
        elif content.get("recursive"):
            shutil.rmtree(real)  # fd-based on Linux: it never follows links out of the tree
        else:
            os.rmdir(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return {"status": "ok"}, []


def _mkdir(content: dict[str, Any], buffers: list[memoryview]) -> _Reply:
    rel = str(content["path"])
    _, real = _resolve(rel)
    if content.get("parents", True):
        os.makedirs(real, exist_ok=True)
    else:
        os.mkdir(real)
    return {"status": "ok", "info": _info(rel, os.stat(real))}, []


_OPS = {
    "open_read": _open_read,
    "read": _read,
    "open_write": _open_write,
    "write": _write,
    "close": _close,
    "stat": _stat,
    "list": _list,
    "remove": _remove,
    "mkdir": _mkdir,
}
