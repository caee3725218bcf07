"""A session's working directory saved as a tar archive and put back into a fresh one.

The directory is the kernel's: anything may lie there (links, FIFOs, files swapped while read,
trees too deep or wide to walk). It is walked by the working directory's copy rule
(:data:`kernelexec._workdirs.ARCHIVE`), as every tenant tree is (:mod:`kernelexec._trees`:
through directory descriptors, never following a link, bounded in depth and entries). Only
directories and plain files with one link are archived, each checked by ``fstat`` once open;
what is skipped is named. A file counts at its size as the archive holds it (its holes too), and
the archive never passes the limit: a file that would pass it is refused before it is read.
An archive is unpacked only into an empty directory, the same way: one name at a time below the
directory's descriptor, new entries only, nothing followed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from kernelexec import _trees, _workdirs
from kernelexec._exceptions import CheckpointTooLargeError

Signature = tuple[tuple[str, int, int], ...]
_BLOCK = tarfile.BLOCKSIZE


def signature(workdir: Path) -> Signature:
    """What the directory holds, cheaply: (path, size, mtime) of every entry.

    Raises:
        TreeLimitError: the directory passes a bound of the walk.
    """
    return _workdirs.signature(workdir)


def archive(workdir: Path, dest: Path, limit: int) -> tuple[int, int, dict[str, str]]:
    """Write the directory's files to ``dest``; its CRC-32, size and what was skipped (why).

    Raises:
        CheckpointTooLargeError: the archive would pass ``limit`` bytes (a file's whole size
            counts, holes included: nothing past the limit is read).
        TreeLimitError: the directory has more entries than the walk's bound (what lies past
            its depth bound is left out, named in what was skipped).
    """
    skipped: dict[str, str] = {}
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    top = _trees.open_top(workdir)
    try:
        with open(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for entry in _workdirs.walk(top, workdir, skipped):
                why = _add(tar, raw, entry, limit)
                if why:
                    skipped[entry.rel] = why
                if raw.tell() > limit:  # headers count too (long names, many directories)
                    raise CheckpointTooLargeError(
                        f"the working directory's archive passes max_checkpoint_bytes={limit} "
                        "(its directories and names alone); nothing was saved"
                    )
            raw.flush()
            os.fsync(raw.fileno())
    finally:
        os.close(top)
    return _crc_file(dest), os.path.getsize(dest), skipped


def _add(tar: tarfile.TarFile, raw: BinaryIO, entry: _trees.Entry, limit: int) -> str | None:
    st = entry.st
    if entry.is_dir:
        info = tarfile.TarInfo(entry.rel)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o700, int(st.st_mtime)
        tar.addfile(info)
        return None
    if not stat.S_ISREG(st.st_mode):
        return "a link or special file (not saved)"
    try:
        fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=entry.parent)
    except OSError as exc:
        return f"not readable: {exc.strerror}"
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return "not a plain file with one link (not saved)"
        size = st.st_size
        if raw.tell() + 3 * _BLOCK + size > limit:
            raise CheckpointTooLargeError(
                f"the working directory's file {entry.rel!r} ({size} bytes) takes the archive "
                f"past max_checkpoint_bytes={limit}; nothing was saved"
            )
        info = tarfile.TarInfo(entry.rel)
        info.size, info.mode, info.mtime = size, st.st_mode & 0o700, int(st.st_mtime)
        tar.addfile(info, _Exactly(f, size))
    return None


class _Exactly:
    """A file read as exactly ``size`` bytes: zeros for what was cut while it was read, and
    nothing of what was added (the tenant may change it meanwhile)."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f, self._left = f, size

    def read(self, n: int = -1) -> bytes:
        n = self._left if n < 0 else min(n, self._left)
        data = self._f.read(n) if n else b""
        if len(data) < n:
            data += bytes(n - len(data))
        self._left -= len(data)
        return data


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def empty(workdir: Path) -> None:
    """Remove what ``workdir`` holds, nothing followed (its files are stale: another executor
    ran the agent since, and the checkpoint's archive is to be unpacked there)."""
    top = _trees.open_top(workdir)
    try:
        _trees.clear(top)
    finally:
        os.close(top)


def extract(source: Path, workdir: Path, size: int, crc: int) -> str | None:
    """Unpack an archive into ``workdir`` if that is empty; what went wrong, else None."""
    top = _trees.open_top(workdir)
    try:
        if os.listdir(top):
            return None  # the session kept its directory (same executor): nothing to put back
        if os.path.getsize(source) != size or _crc_file(source) != crc:
            return "the working directory's archive is damaged; its files were not restored"
        with tarfile.open(source, mode="r") as tar:
            for member in tar:
                try:
                    _unpack(tar, member, top)
                except OSError as exc:  # a name taken meanwhile, a link on the way
                    return f"the working directory's files were restored in part: {exc}"
    finally:
        os.close(top)
    return None


def _unpack(tar: tarfile.TarFile, member: tarfile.TarInfo, top: int) -> None:
    """Make one member below ``top``: directories and plain files only, new entries only."""
    parts = PurePosixPath(member.name).parts
    if not parts or parts[0] == "/" or ".." in parts or len(parts) > _trees.MAX_DEPTH:
        return
    here = os.dup(top)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=here)
            below = _trees.open_dir(here, part)
            os.close(here)
            here = below
        name = parts[-1]
        if member.isdir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=here)
        elif member.isreg():
            data = tar.extractfile(member)
            if data is None:
                return
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                          member.mode & 0o700, dir_fd=here)  # fmt: skip
            with open(out, "wb") as f:
                while chunk := data.read(1 << 20):
                    f.write(chunk)
                f.flush()
                os.utime(f.fileno(), (member.mtime, member.mtime))
    finally:
        os.close(here)
