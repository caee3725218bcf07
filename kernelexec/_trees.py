"""Tenant trees: the one way the host walks, copies, archives, hands over and removes a
directory that a tenant's processes may be changing while it does.

The rule (``docs/security.md``, "Tenant data"): the host never opens a path inside a tree a
tenant can write. Every step is relative to a directory descriptor, one name at a time, opened
without following a link (``O_NOFOLLOW``, ``AT_SYMLINK_NOFOLLOW``); a file is created only with
``O_EXCL`` and never opened for writing if it was there. A link planted or a directory swapped
while the host works can then redirect nothing: the step fails (``ELOOP``, ``ENOTDIR``,
``EEXIST``) or it acts on an entry of the tenant's own tree, never on one outside it. The only
paths opened by name are a tree's top and where a copy goes, which the caller holds: directories
of the host's (their parents the host's alone) or of the tenant's, whose own entries a race can
only change for the tenant itself.

Every walk is iterative and bounded (:class:`Bounds`): one descriptor per level, a depth, a
number of entries and, where data moves, a number of bytes; past a bound a
:class:`~kernelexec.TreeLimitError` names it and nothing past it was read or written. Files are
copied with their holes (a sparse file costs only its data). Removal has no depth bound: a
directory too deep to walk is moved up to the top first, so any tree the tenant made can be
removed with a few descriptors.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kernelexec._exceptions import TreeLimitError

MAX_DEPTH = 128
"""Levels below the top a walk goes (one descriptor each)."""
MAX_ENTRIES = 100_000
"""Entries a walk visits; also the inode cap of a capped directory (:mod:`._sandbox._disk`)."""

SOCKET = "a socket (not copied)"
"""Why a copy left a socket out: a socket file is an address, not data; once its process is
gone (a stopped kernel's ipc sockets) nothing is lost with it."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
_PASSES = 64  # removal passes that removed nothing, before giving up on a tree
_LINKED_MAX = 256  # files with several links a copy remembers (a descriptor each) to link again


@dataclass(frozen=True)
class Bounds:
    """How far a walk may go: ``depth`` levels, ``entries`` entries, ``data`` bytes of file data
    (None: no byte bound)."""

    depth: int = MAX_DEPTH
    entries: int = MAX_ENTRIES
    data: int | None = None


@dataclass
class Entry:
    """One entry of a walk: its name in the directory ``parent`` (a descriptor, valid until the
    walk moves on), its path from the top, its ``lstat`` and its level (1: in the top).
    Setting ``descend`` to False keeps the walk out of a directory."""

    parent: int
    name: str
    rel: str
    st: os.stat_result
    level: int
    descend: bool = True

    @property
    def is_dir(self) -> bool:
        """Whether it is a directory (never a link to one)."""
        return stat.S_ISDIR(self.st.st_mode)


def open_top(path: str | os.PathLike[str]) -> int:
    """The directory ``path`` opened as a tree's top, not following a link at its last name.

    Raises:
        OSError: it is not a directory (``ENOTDIR``, ``ELOOP`` for a link) or is missing.
    """
    return os.open(path, _DIR)


def open_dir(parent: int, name: str) -> int:
    """The directory ``name`` in the directory ``parent``, not following a link."""
    return os.open(name, _DIR, dir_fd=parent)


def walk(
    top: int,
    bounds: Bounds = Bounds(),
    *,
    where: str = "",
    skip_top: frozenset[str] = frozenset(),
    too_deep: Callable[[Entry], None] | None = None,
) -> Iterator[Entry]:
    """Every entry under the directory ``top`` (a descriptor; the caller keeps it), parents
    before what they hold; entries that vanish while listed are passed over, and so is a
    directory that is a link or another file system by the time it is opened. A directory
    at the depth bound is handed to ``too_deep`` and not walked, where that is given.

    Raises:
        TreeLimitError: the tree is deeper than ``bounds.depth`` (without ``too_deep``) or has
            more than ``bounds.entries`` entries (``where`` names it in the message).
    """
    dev = os.fstat(top).st_dev
    count = 0
    first = os.dup(top)
    frames: list[tuple[int, Iterator[os.DirEntry[str]], str]] = []
    try:
        frames.append((first, os.scandir(first), ""))
    except BaseException:
        os.close(first)
        raise
    try:
        while frames:
            fd, listing, rel = frames[-1]
            item = next(listing, None)
            if item is None:
                frames.pop()
                _close(fd, listing)
                continue
            if not rel and item.name in skip_top:
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            count += 1
            if count > bounds.entries:
                raise TreeLimitError("entries", bounds.entries, where or "a tenant's tree")
            entry = Entry(fd, item.name, f"{rel}/{item.name}" if rel else item.name, st,
                          len(frames))  # fmt: skip
            yield entry
            if not (entry.is_dir and entry.descend) or st.st_dev != dev:
                continue
            if len(frames) > bounds.depth:
                if too_deep is None:
                    raise TreeLimitError("depth", bounds.depth, where or "a tenant's tree")
                too_deep(entry)
                continue
            try:
                child = open_dir(fd, item.name)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # swapped since it was listed: nothing of the tree's to walk
                raise
            try:
                frames.append((child, os.scandir(child), entry.rel))
            except BaseException:
                os.close(child)
                raise
    finally:
        for fd, listing, _ in frames:
            _close(fd, listing)


def _close(fd: int, listing: Iterator[os.DirEntry[str]]) -> None:
    close = getattr(listing, "close", None)
    if close is not None:
        close()
    os.close(fd)


@dataclass
class Copied:
    """What a copy did: data bytes written, entries made and what it left out (path: why)."""

    data: int = 0
    entries: int = 0
    skipped: dict[str, str] = field(default_factory=dict)


def copy(
    src: int,
    dst: int,
    bounds: Bounds = Bounds(),
    *,
    where: str = "",
    skip_top: frozenset[str] = frozenset(),
    outside_links: bool = True,
    whiteouts: bool = False,
    xattrs: tuple[str, ...] = (),
    skip_too_deep: bool = False,
) -> Copied:
    """Copy the tree under the directory ``src`` into the directory ``dst`` (descriptors; the
    caller keeps both). Directories, plain files (holes kept; one with several links inside
    the tree copied once and linked) and symbolic links (as links, never followed) are copied;
    FIFOs, sockets and devices are left out, except overlayfs's whiteouts (the character device
    0:0) where ``whiteouts`` is set. Modes are kept without set-id bits (what is made is the
    host's; a hand-over gives it to a kernel's user). With ``outside_links=False`` a file that
    also has links outside the tree is left out (a link planted to a host file never reaches a
    tenant).
    The extended attributes ``xattrs`` of directories are kept. With ``skip_too_deep`` what
    lies past the depth bound is left out (named) rather than refused.

    An entry that already exists in ``dst`` is left as it is (a directory is merged into).

    Raises:
        TreeLimitError: past ``bounds`` (data counts the bytes written, not the holes).
    """
    done = Copied()

    def deep(entry: Entry) -> None:
        done.skipped[entry.rel + "/"] = f"deeper than {bounds.depth} levels (not copied)"

    too_deep = deep if skip_too_deep else None
    inside = None if outside_links else _links_inside(src, bounds, where, skip_top, too_deep)
    linked: dict[tuple[int, int], tuple[int, str]] = {}
    targets = [os.dup(dst)]
    try:
        for entry in walk(src, bounds, where=where, skip_top=skip_top, too_deep=too_deep):
            while len(targets) > entry.level:
                os.close(targets.pop())
            here = targets[-1]
            why = _copy_entry(entry, here, done, bounds, where, inside, linked, whiteouts)
            if why:
                done.skipped[entry.rel] = why
                entry.descend = False
                continue
            done.entries += 1
            if entry.is_dir:
                _copy_xattrs(entry, here, xattrs)
                try:
                    targets.append(open_dir(here, entry.name))
                except OSError as exc:
                    done.skipped[entry.rel] = f"not copied: {exc.strerror}"
                    entry.descend = False
    finally:
        for fd in targets:
            os.close(fd)
        for fd, _ in linked.values():
            os.close(fd)
    return done


def _copy_xattrs(entry: Entry, here: int, names: tuple[str, ...]) -> None:
    """Copy the extended attributes ``names`` of the directory ``entry`` to its copy in
    ``here`` (through the descriptors' own paths in ``/proc``, the last name not followed)."""
    for attr in names:
        try:
            value = os.getxattr(f"/proc/self/fd/{entry.parent}/{entry.name}", attr,
                                follow_symlinks=False)  # fmt: skip
        except OSError:
            continue
        with contextlib.suppress(OSError):
            os.setxattr(f"/proc/self/fd/{here}/{entry.name}", attr, value, follow_symlinks=False)


def _copy_entry(
    entry: Entry,
    here: int,
    done: Copied,
    bounds: Bounds,
    where: str,
    inside: dict[tuple[int, int], int] | None,
    linked: dict[tuple[int, int], tuple[int, str]],
    whiteouts: bool,
) -> str | None:
    """Make ``entry`` in the directory ``here``; why it was left out, or None."""
    st, name = entry.st, entry.name
    mode = stat.S_IMODE(st.st_mode) & 0o777
    try:
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode | 0o700, dir_fd=here)
            return None
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=entry.parent), name, dir_fd=here)
            return None
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0 and whiteouts:
            os.mknod(name, stat.S_IFCHR | 0o600, 0, dir_fd=here)
            return None
        if stat.S_ISSOCK(st.st_mode):
            return SOCKET
        if not stat.S_ISREG(st.st_mode):
            return "a FIFO or device (not copied)"
        key = (st.st_dev, st.st_ino)
        if inside is not None and st.st_nlink > 1 and inside.get(key, 0) < st.st_nlink:
            return "a file with links outside the tree (not copied)"
        if key in linked and st.st_nlink > 1:
            first_dir, first_name = linked[key]
            os.link(first_name, name, src_dir_fd=first_dir, dst_dir_fd=here,
                    follow_symlinks=False)  # fmt: skip
            return None
        written = copy_file(entry.parent, name, here, name, mode, done.data, bounds.data,
                            where or entry.rel, expect=key)  # fmt: skip
        if written is None:
            return "swapped for something else while copied (not copied)"
        done.data += written
        if st.st_nlink > 1 and len(linked) < _LINKED_MAX:  # past it, later links are copies
            linked[key] = (os.dup(here), name)
        return None
    except FileExistsError:
        return None  # already in the target: left as it is
    except OSError as exc:
        if isinstance(exc, TreeLimitError):
            raise
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None  # gone or swapped since it was listed
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENAMETOOLONG):
            return f"not copied: {exc.strerror or exc}"
        raise  # out of space, or of descriptors: the copy as a whole failed


def copy_file(
    src_dir: int,
    name: str,
    dst_dir: int,
    dst_name: str,
    mode: int,
    spent: int = 0,
    limit: int | None = None,
    where: str = "",
    *,
    expect: tuple[int, int] | None = None,
) -> int | None:
    """Copy the plain file ``name`` of ``src_dir`` to a new file ``dst_name`` of ``dst_dir``
    with its holes; the data bytes written, or None when it is not a plain file by the time it
    is opened (or, with ``expect``, not the file of that device and inode).

    Raises:
        TreeLimitError: ``spent`` and its data pass ``limit`` bytes (the new file is removed).
    """
    source = os.open(name, _FILE, dir_fd=src_dir)
    try:
        st = os.fstat(source)
        if not stat.S_ISREG(st.st_mode):
            return None
        if expect is not None and (st.st_dev, st.st_ino) != expect:
            return None  # swapped since it was walked
        out = os.open(dst_name, _NEW, mode, dir_fd=dst_dir)
        try:
            written = _copy_data(source, out, st.st_size, spent, limit, where or name)
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(dst_name, dir_fd=dst_dir)
            raise
        os.close(out)
        return written
    finally:
        os.close(source)


def data_segments(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The (start, end) of each stretch of data in the first ``size`` bytes of the file ``fd``
    (holes left out)."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                return
            raise
        if start >= size:
            return
        end = max(min(os.lseek(fd, start, os.SEEK_HOLE), size), start + 1)
        yield start, end
        offset = end


def data_bytes(fd: int, size: int) -> int:
    """Bytes of data (not holes) in the first ``size`` bytes of the file ``fd``."""
    return sum(end - start for start, end in data_segments(fd, size))


def _copy_data(source: int, out: int, size: int, spent: int, limit: int | None, where: str) -> int:
    written = 0
    for start, end in data_segments(source, size):
        pos = start
        while pos < end:
            n = min(_CHUNK, end - pos)
            if limit is not None and spent + written + n > limit:
                raise TreeLimitError("data", limit, where)
            chunk = os.pread(source, n, pos)
            if not chunk:
                break
            os.pwrite(out, chunk, pos)
            pos += len(chunk)
            written += len(chunk)
    os.ftruncate(out, size)
    return written


def _links_inside(
    top: int,
    bounds: Bounds,
    where: str,
    skip_top: frozenset[str],
    too_deep: Callable[[Entry], None] | None,
) -> dict[tuple[int, int], int]:
    """How many links each file with several has inside the tree ``top``."""
    counts: dict[tuple[int, int], int] = {}
    for entry in walk(top, bounds, where=where, skip_top=skip_top, too_deep=too_deep):
        if stat.S_ISREG(entry.st.st_mode) and entry.st.st_nlink > 1:
            key = (entry.st.st_dev, entry.st.st_ino)
            counts[key] = counts.get(key, 0) + 1
    return counts


def change_owners(
    top: int,
    to: int,
    bounds: Bounds = Bounds(),
    *,
    which: Callable[[os.stat_result], bool],
    where: str = "",
    skip_top: frozenset[str] = frozenset(),
) -> int:
    """Give every entry under ``top`` for which ``which(lstat)`` holds to the uid and gid
    ``to``, links themselves (never followed); how many changed hands. A file with several
    links is never changed (a planted link to a file elsewhere would hand that file over), nor
    what lies past the depth bound (it stays whose it was).

    Raises:
        TreeLimitError: the tree has more entries than the bound.
    """
    changed = 0
    for entry in walk(top, bounds, where=where, skip_top=skip_top, too_deep=leave):
        st = entry.st
        if not which(st) or (not entry.is_dir and st.st_nlink > 1):
            continue
        if _change_owner(entry, to, which):
            changed += 1
    return changed


_AT_EMPTY_PATH = 0x1000


def _change_owner(entry: Entry, to: int, which: Callable[[os.stat_result], bool]) -> bool:
    """Give ``entry`` to ``to`` if, once opened (``O_PATH``, the link itself), it is still the
    entry walked and still passes the checks: a name swapped meanwhile (for a hard link to a
    host file, say) changes no owner."""
    try:
        fd = os.open(entry.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=entry.parent)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        same = (st.st_dev, st.st_ino) == (entry.st.st_dev, entry.st.st_ino)
        if not same or not which(st) or (not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1):
            return False
        return bool(_libc().fchownat(fd, b"", to, to, _AT_EMPTY_PATH) == 0)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fchownat.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint,
                              ctypes.c_int)  # fmt: skip
    return libc


def leave(_entry: Entry) -> None:
    """A directory past the depth bound is left as it is."""


def signature(
    top: int,
    bounds: Bounds = Bounds(),
    *,
    where: str = "",
    skip_top: frozenset[str] = frozenset(),
    too_deep: Callable[[Entry], None] | None = None,
) -> tuple[tuple[str, int, int], ...]:
    """What the tree holds, cheaply: (path, size, mtime) of every entry, sorted."""
    found = [
        (e.rel, e.st.st_size, e.st.st_mtime_ns)
        for e in walk(top, bounds, where=where, skip_top=skip_top, too_deep=too_deep)
    ]
    return tuple(sorted(found))


def clear(top: int, *, keep: frozenset[str] = frozenset(), depth: int = MAX_DEPTH) -> None:
    """Remove everything under the directory ``top`` (a descriptor) but the names ``keep`` at
    its top, however deep or wide: a directory past ``depth`` levels is moved up to the top
    and removed from there, so a few descriptors remove any tree. Nothing is followed.

    Raises:
        OSError: the tree could not be emptied (the tenant refilled it as fast as it was
            removed, or an entry could not be removed).
    """
    idle = 0
    while idle < _PASSES:
        left, removed = _clear_pass(top, keep, depth)
        if not left:
            return
        idle = 0 if removed else idle + 1
    raise OSError(errno.ENOTEMPTY, "the tree kept changing while it was removed")


def _clear_pass(top: int, keep: frozenset[str], depth: int) -> tuple[bool, int]:
    """One pass of :func:`clear`: whether anything is left, and how many entries went. Each
    frame holds a directory's descriptor, the names still to remove in it and the name of the
    directory below it being walked; a directory moved up joins the top's names."""
    left, removed = False, 0
    first = os.dup(top)
    try:
        frames: list[tuple[int, list[str], str]] = [(first, os.listdir(first), "")]
    except BaseException:
        os.close(first)
        raise
    try:
        while frames:
            fd, names, _ = frames[-1]
            if not names:
                frames.pop()
                os.close(fd)
                if frames:
                    try:
                        os.rmdir(frames[-1][2], dir_fd=frames[-1][0])
                        removed += 1
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:
                            left = True
                continue
            name = names.pop()
            if len(frames) == 1 and name in keep:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
                    removed += 1
                continue
            if len(frames) > depth:
                aside = f".kx-deep-{secrets.token_hex(8)}"
                try:
                    os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=top)
                    frames[0][1].append(aside)
                except FileNotFoundError:
                    pass
                except OSError:
                    left = True
                continue
            try:
                child = open_dir(fd, name)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue
                raise
            frames[-1] = (fd, names, name)
            try:
                frames.append((child, os.listdir(child), ""))
            except BaseException:
                os.close(child)
                raise
    finally:
        for fd, _, _ in frames:
            os.close(fd)
    return left, removed


def remove(path: str | os.PathLike[str]) -> None:
    """Remove the tree at ``path`` (a link there is removed, never followed); nothing when it
    is missing. Errors are left to the caller (see :func:`clear`)."""
    path = os.fspath(path)
    try:
        top = open_top(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        raise
    try:
        clear(top)
    finally:
        os.close(top)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)
