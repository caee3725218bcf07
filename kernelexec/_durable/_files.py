"""A session's working directory saved as a tar archive and put back into a fresh one.

The directory is the kernel's: anything may lie there (links, FIFOs, files swapped while read).
Only directories and plain files are archived, each opened without following links and checked
by ``fstat``; what is skipped is named. An archive is unpacked only into an empty directory
(nothing there yet that a link could redirect), with tarfile's ``data`` filter.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zlib
from pathlib import Path

from kernelexec._durable._kernel_state import STAGING

Signature = tuple[tuple[str, int, int], ...]


def signature(workdir: Path) -> Signature:
    """What the directory holds, cheaply: (path, size, mtime) of every entry."""
    found: list[tuple[str, int, int]] = []
    for root, dirs, files in os.walk(workdir):
        if root == str(workdir):
            dirs[:] = [d for d in dirs if d != STAGING]
        for name in files + dirs:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            found.append((os.path.relpath(path, workdir), st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))


def archive(workdir: Path, dest: Path, limit: int) -> tuple[int, int, dict[str, str]]:
    """Write the directory's files to ``dest``; its size, CRC-32 and what was skipped (why).

    Raises:
        OSError: the archive would pass ``limit`` bytes.
    """
    skipped: dict[str, str] = {}
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for root, dirs, files in os.walk(workdir):
            if root == str(workdir):
                dirs[:] = [d for d in dirs if d != STAGING]
            for name in sorted(dirs + files):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, workdir)
                why = _add(tar, path, rel)
                if why:
                    skipped[rel] = why
                if raw.tell() > limit:
                    raise OSError(f"the working directory's files pass {limit} bytes")
        raw.flush()
        os.fsync(raw.fileno())
    return _crc_file(dest), os.path.getsize(dest), skipped


def _add(tar: tarfile.TarFile, path: str, rel: str) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        info = tarfile.TarInfo(rel)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o700, int(st.st_mtime)
        tar.addfile(info)
        return None
    if not stat.S_ISREG(st.st_mode):
        return "a link or special file (not saved)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return f"not readable: {exc.strerror}"
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return "not a plain file with one link (not saved)"
        data = f.read(st.st_size)
    info = tarfile.TarInfo(rel)
    info.size, info.mode, info.mtime = len(data), st.st_mode & 0o700, int(st.st_mtime)
    tar.addfile(info, io.BytesIO(data))
    return None


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def extract(source: Path, workdir: Path, size: int, crc: int) -> str | None:
    """Unpack an archive into ``workdir`` if that is empty; what went wrong, else None."""
    with os.scandir(workdir) as entries:
        if any(entries):
            return None  # the session kept its directory (same executor): nothing to put back
    if os.path.getsize(source) != size or _crc_file(source) != crc:
        return "the working directory's archive is damaged; its files were not restored"
    with tarfile.open(source, mode="r") as tar:
        tar.extractall(workdir, filter="data")
    return None
