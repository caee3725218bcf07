"""The kernel half of moving a checkpoint through the kernel protocol (kernels whose files the
host cannot see: a gateway's). Sent to the kernel as text; standard library only.

Each request names one operation: where the session's directories are, a chunk of a staged
file read or written, the working directory packed into a tar archive in the staging directory
or unpacked from one, the staging directory removed. Only names of kernelexec's own record and
archive files are opened, below the staging directory, never through a link. The host checks
every size and CRC-32 it is told (the kernel is the tenant's; nothing it says is trusted).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import zlib
from typing import Any

MODULE_NAME = "__kernelexec_transfer__"
"""The name of this module in the kernel's ``sys.modules``."""

RESULT_MIME = "application/vnd.kernelexec.transfer+json"
"""The mimetype of this module's answers in ``user_expressions``."""

NAME = re.compile(r"^[rf][0-9a-f]{24}\.(rec|tar)$")
"""The names of the files this module opens in the staging directory."""

_STAGING = ".kernelexec-state"


class _Answer:
    def __init__(self, data: Any) -> None:
        self._data = data

    def __repr__(self) -> str:
        return "<kernelexec transfer>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {RESULT_MIME: json.dumps(self._data)}


def handle() -> _Answer:
    """Run the operation the request's metadata names; its answer (errors as data)."""
    from IPython import get_ipython  # type: ignore[attr-defined,unused-ignore]

    meta = get_ipython().kernel.get_parent()["metadata"]["kernelexec_transfer"]
    try:
        return _Answer(_OPS[meta["op"]](**meta["args"]))
    except Exception as exc:
        return _Answer({"error": f"{type(exc).__name__}: {exc}"[:500]})


def _where(rel: str) -> dict[str, Any]:
    helper = sys.modules.get("__kernelexec__")
    entered = getattr(helper, "_state", {}).get("workdir")
    workdir = entered or os.path.abspath(rel)
    return {"workdir": workdir, "staging": os.path.join(workdir, _STAGING), "here": os.getcwd()}


def _path(staging: str, name: str) -> str:
    if not NAME.match(name):
        raise ValueError(f"not a file name of kernelexec's: {name!r}")
    st = os.lstat(staging)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError("the staging directory is not a directory")
    return os.path.join(staging, name)


def _read(staging: str, name: str, offset: int, size: int) -> dict[str, Any]:
    fd = os.open(_path(staging, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{name} is not a plain file")
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    return {"data": base64.b64encode(data).decode()}


def _write(staging: str, name: str, offset: int, data: str) -> dict[str, Any]:
    if offset == 0:
        os.makedirs(staging, mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if offset == 0 else 0)
    fd = os.open(_path(staging, name), flags, 0o600)
    try:
        os.pwrite(fd, base64.b64decode(data), offset)
    finally:
        os.close(fd)
    return {}


def _crc(path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def _pack(workdir: str, staging: str, name: str, limit: int) -> dict[str, Any]:
    """Archive the working directory's plain files and directories (links and the rest are
    skipped, named); stop as soon as the archive would pass ``limit``."""
    entries: list[tuple[str, str]] = []
    skipped: dict[str, str] = {}
    for top, dirs, files in os.walk(workdir):
        rel_top = os.path.relpath(top, workdir)
        if rel_top == ".":
            dirs[:] = [d for d in dirs if d != _STAGING]
        for d in sorted(dirs):
            path = os.path.join(top, d)
            if os.path.islink(path):
                skipped[os.path.normpath(os.path.join(rel_top, d))] = "a symbolic link"
            else:
                entries.append((path, os.path.normpath(os.path.join(rel_top, d))))
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
        for f in sorted(files):
            entries.append((os.path.join(top, f), os.path.normpath(os.path.join(rel_top, f))))
    if not entries:
        return {"empty": True, "skipped": skipped}
    os.makedirs(staging, mode=0o700, exist_ok=True)
    dest = _path(staging, name)
    total = 2 * tarfile.BLOCKSIZE * 10  # the end-of-archive blocks, rounded up
    with tarfile.open(dest, "x", format=tarfile.PAX_FORMAT) as tar:
        for path, arcname in entries:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                tar.addfile(tar.gettarinfo(path, arcname))
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                skipped[arcname] = "not a plain file with one link"
                continue
            total += tarfile.BLOCKSIZE * (2 + -(-st.st_size // tarfile.BLOCKSIZE))
            if total > limit:
                tar.close()
                os.unlink(dest)
                return {"too_large": total, "path": arcname}
            with open(path, "rb") as raw:
                tar.addfile(tar.gettarinfo(arcname=arcname, fileobj=raw), raw)
    size, crc = _crc(dest)
    return {"size": size, "crc": crc, "skipped": skipped}


def _unpack(workdir: str, staging: str, name: str, size: int, crc: int) -> dict[str, Any]:
    """Make the working directory what the archive holds (the files there now are an older
    state's): emptied first, then unpacked with tarfile's ``data`` filter (no links out, no
    absolute names, no devices)."""
    src = _path(staging, name)
    if _crc(src) != (size, crc):
        return {"problem": "the working directory's archive is damaged; not restored"}
    os.makedirs(workdir, exist_ok=True)
    for entry in os.listdir(workdir):
        if entry == _STAGING:
            continue
        path = os.path.join(workdir, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    with tarfile.open(src, "r") as tar:
        tar.extractall(workdir, filter="data")
    return {"problem": None}


def _clear(staging: str) -> dict[str, Any]:
    with contextlib.suppress(FileNotFoundError):
        if os.path.islink(staging) or not os.path.isdir(staging):
            os.unlink(staging)
        else:
            shutil.rmtree(staging)
    return {}


def _chdir(path: str) -> dict[str, Any]:
    os.chdir(path)
    return {}


_OPS: dict[str, Any] = {
    "where": _where,
    "read": _read,
    "write": _write,
    "pack": _pack,
    "unpack": _unpack,
    "clear": _clear,
    "chdir": _chdir,
}
