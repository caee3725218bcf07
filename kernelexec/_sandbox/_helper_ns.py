"""The namespace helper's own process: the mounts it builds on the host side and attaches in a
kernel's mount namespace (the host side, and what each request does, is :mod:`._nshelper`).

Run as a script by :func:`kernelexec._proctitle.helper_command` (``-I -S``, as root), never
imported by the host: standard library only (an import contract checks it). One request per
line of stdin as JSON, each answered ``ok`` or ``error <why>`` on stdout.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import sys

TYPE_CHECKING = False  # typing is not imported when it runs (a fifth of its start)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn, TextIO

libc = ctypes.CDLL(None, use_errno=True)
# The same numbers on every architecture since Linux 5.2 (5.12 for mount_setattr).
OPEN_TREE, MOVE_MOUNT, FSOPEN, FSCONFIG, FSMOUNT, FSPICK, MOUNT_SETATTR = (
    428,
    429,
    430,
    431,
    432,
    433,
    442,
)
NEWNS, NEWUSER = 0x00020000, 0x10000000
CLONE, CLOEXEC, EMPTY_PATH = 1, 0x80000, 0x1000
F_EMPTY, T_EMPTY = 0x4, 0x40
RDONLY, NOSUID, NODEV, NOEXEC, IDMAP = 0x1, 0x2, 0x4, 0x8, 0x100000
SET_FLAG, SET_STRING, SET_FD, CREATE, RECONFIGURE = 0, 1, 5, 6, 7
TMPFS = 0x01021994
_home: list[int] = []  # the host's mount namespace, opened at start (main)


def fail(what: str) -> NoReturn:
    err = ctypes.get_errno()
    raise OSError(err, what + ": " + os.strerror(err))


def call(what: str, number: int, *args: Any) -> int:
    fd = int(libc.syscall(number, *args))
    if fd < 0:
        fail(what)
    return fd


def fs_error(fs: int) -> str:
    # The filesystem's own words on a failed fsconfig (overlayfs names the layer at fault).
    words = []
    while True:
        try:
            line = os.read(fs, 1024)
        except OSError:
            break
        if not line:
            break
        words.append(line.decode(errors="replace").strip())
    return "; ".join(words)


def in_kernel(pid: int, work: Callable[[], None]) -> None:
    ns = os.open("/proc/" + str(pid) + "/ns/mnt", os.O_RDONLY)
    try:
        if libc.setns(ns, NEWNS) != 0:
            fail("setns into the kernel's mount namespace")
        try:
            work()
        finally:
            if libc.setns(_home[0], NEWNS) != 0:
                os._exit(3)  # cannot come back: let the host start another helper
            os.chdir("/")
    finally:
        os.close(ns)


def show(pid: int, path: str) -> None:
    tree = call("open_tree " + path, OPEN_TREE, -100, path.encode(), CLONE | CLOEXEC | 0x8000)
    try:

        def attach() -> None:
            if libc.syscall(MOVE_MOUNT, tree, b"", -100, path.encode(), F_EMPTY) != 0:
                fail("move_mount onto " + path)

        in_kernel(pid, attach)
    finally:
        os.close(tree)


def userns(uid: int, gid: int) -> int:
    # A user namespace in which the host's user is uid/gid: what an idmapped mount needs.
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        os.close(done_w)
        code = 0 if libc.unshare(NEWUSER) == 0 else 1
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(code)
    os.close(ready_w)
    os.close(done_r)
    try:
        os.read(ready_r, 1)
        with open(f"/proc/{child}/uid_map", "w") as f:
            f.write(f"{os.geteuid()} {uid} 1\n")
        with open(f"/proc/{child}/gid_map", "w") as f:
            f.write(f"{os.getegid()} {gid} 1\n")
        return os.open(f"/proc/{child}/ns/user", os.O_RDONLY)
    finally:
        os.write(done_w, b"x")
        os.close(done_w)
        os.close(ready_r)
        os.waitpid(child, 0)


def set_attrs(tree: int, attrs: int, ns: int = -1) -> None:
    attr = struct.pack("QQQQ", attrs, 0, 0, max(ns, 0))
    if libc.syscall(MOUNT_SETATTR, tree, b"", EMPTY_PATH, attr, len(attr)) != 0:
        fail("mount_setattr")


def fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)
    if libc.fstatfs(fd, buf) != 0:
        fail("fstatfs")
    return int(struct.unpack_from("l", buf.raw)[0])


def reconfigure(root_fd: int, flag: str) -> None:
    # The bridge is read-only twice: its superblock and its mount.
    attr = struct.pack("QQQQ", RDONLY if flag == "ro" else 0, RDONLY if flag == "rw" else 0, 0, 0)
    fs = call("fspick", FSPICK, root_fd, b"", 1 | 0x8)  # FSPICK_CLOEXEC | FSPICK_EMPTY_PATH
    try:
        if flag == "ro" and libc.syscall(MOUNT_SETATTR, root_fd, b"", EMPTY_PATH, attr, 32):
            fail("mount_setattr ro")
        if libc.syscall(FSCONFIG, fs, SET_FLAG, flag.encode(), None, 0) != 0:
            fail("fsconfig " + flag)
        if libc.syscall(FSCONFIG, fs, RECONFIGURE, None, None, 0) != 0:
            fail("remounting " + flag)
        if flag == "rw" and libc.syscall(MOUNT_SETATTR, root_fd, b"", EMPTY_PATH, attr, 32):
            fail("mount_setattr rw")
    finally:
        os.close(fs)


def our_bridge(fd: int) -> bool:
    # Whether fd is on a read-only tmpfs kernelexec mounted (a bridge over a blocked directory):
    # the only read-only place where a mount point is made.
    with open(f"/proc/self/fdinfo/{fd}") as f:
        mnt = [line.split()[1] for line in f if line.startswith("mnt_id:")]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if mnt and fields[0] == mnt[0]:
                rest = fields[fields.index("-") + 1 :]
                return rest[:2] == ["tmpfs", "kernelexec"] and "ro" in rest[2].split(",")
    return False


def searchable(st: os.stat_result, uid: int) -> bool:
    # Whether the kernel's user (uid, its own group, no others) may pass through a directory.
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == uid:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def new_bridge(parent: int, part: str) -> int:
    # A small tmpfs over parent/part, a directory the kernel's user cannot pass through (so
    # it reached nothing under it): the way to the lent directory is made in it, the rest
    # stays out of sight. Read-only once the loan is in place (see lend).
    fs = call("fsopen tmpfs", FSOPEN, b"tmpfs", 1)
    try:
        for key, value in (
            (b"source", b"kernelexec"),
            (b"mode", b"0755"),
            (b"size", b"64k"),
            (b"nr_inodes", b"4096"),
        ):
            if libc.syscall(FSCONFIG, fs, SET_STRING, key, value, 0) != 0:
                fail("fsconfig tmpfs " + key.decode())
        if libc.syscall(FSCONFIG, fs, CREATE, None, None, 0) != 0:
            fail("making a tmpfs")
        mnt = call("fsmount", FSMOUNT, fs, 1, NOSUID | NODEV | NOEXEC)
    finally:
        os.close(fs)
    try:
        target = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        try:
            if libc.syscall(MOVE_MOUNT, mnt, b"", target, b"", F_EMPTY | T_EMPTY) != 0:
                fail("bridging " + part)
        finally:
            os.close(target)
    finally:
        os.close(mnt)
    return os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)


def mount_point(path: str, uid: int, bridges: list[int]) -> int:
    # The directory at path in the current (kernel's) view, made where missing on a tmpfs;
    # a directory on the way that the kernel's user cannot pass through is bridged (its new
    # bridges' descriptors are added to bridges).
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    roots = {os.fstat(fd).st_dev: os.dup(fd)}  # device -> the first directory seen on it
    parts = [p for p in path.split("/") if p]
    try:
        where = ""
        for i, part in enumerate(parts):
            where += "/" + part
            try:
                inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if fs_type(fd) != TMPFS:
                    raise OSError(
                        errno.ENOENT, where + " is missing in the kernel's view"
                    ) from None
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except OSError as exc:
                    if exc.errno != errno.EROFS:
                        raise
                    root = roots[os.fstat(fd).st_dev]
                    if not our_bridge(root):
                        raise OSError(errno.EROFS, where + ": its parent is read-only") from None
                    reconfigure(root, "rw")
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    finally:
                        reconfigure(root, "ro")
                inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(
                        exc.errno, where + " is not a directory in the kernel's view"
                    ) from None
                raise
            if i < len(parts) - 1 and not searchable(os.fstat(inner), uid):
                os.close(inner)
                inner = new_bridge(fd, part)
                bridges.append(os.dup(inner))
            os.close(fd)
            fd = inner
            dev = os.fstat(fd).st_dev
            if dev not in roots:
                roots[dev] = os.dup(fd)
        return fd
    finally:
        for root in roots.values():
            os.close(root)


def subdir(parent: int, name: str, mode: int = 0o700) -> int:
    # parent/name, made if missing, never through a link (the session's directory is its
    # kernel's: it may have put anything there).
    try:  # noqa: SIM105 (contextlib would be a sixth of the helper's start)
        os.mkdir(name, mode, dir_fd=parent)
    except FileExistsError:
        pass
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def layers(workdir: str, folder: str, name: str, uid: int, mode: int) -> tuple[int, int]:
    # Descriptors of the upper and work layers in workdir/folder/name. folder and name
    # must be the host's alone (a folder the kernel made or was handed is refused); the
    # upper's top is the kernel user's with the lent directory's mode (the merged directory's
    # top takes both).
    fds = [os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    where = workdir
    try:
        for part in (folder, name):
            where += "/" + part
            try:
                fds.append(subdir(fds[-1], part))
            except OSError as exc:
                raise OSError(exc.errno, f"{where}: {exc.strerror}") from None
            st = os.fstat(fds[-1])
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise OSError(errno.EPERM, where + " is not the host's alone")
        upper = subdir(fds[-1], "upper")
        try:
            os.fchown(upper, uid, uid)
            os.fchmod(upper, mode)
            return upper, subdir(fds[-1], "work")
        except BaseException:
            os.close(upper)
            raise
    finally:
        for fd in fds:
            os.close(fd)


def overlay(path: str, layers: tuple[tuple[bytes | None, int, int], ...], flags: int) -> int:
    # A detached overlay of layers (key, kind, descriptor), mounted nosuid, nodev and flags.
    fs = call("fsopen overlay", FSOPEN, b"overlay", 1)
    try:
        for key, kind, aux in (*layers, (None, CREATE, 0)):
            if libc.syscall(FSCONFIG, fs, kind, key, None, aux) != 0:
                err = ctypes.get_errno()
                said = fs_error(fs) or os.strerror(err)
                raise OSError(err, "overlay over " + path + ": " + said)
        return call("fsmount", FSMOUNT, fs, 1, NOSUID | NODEV | flags)
    finally:
        os.close(fs)


def empty_layer() -> int:
    # An empty read-only tmpfs, detached: the second lower layer of a read-only overlay
    # (overlayfs wants two lower layers where there is no upper one).
    fs = call("fsopen tmpfs", FSOPEN, b"tmpfs", 1)
    try:
        for key, value in (
            (b"source", b"kernelexec"),
            (b"mode", b"0755"),
            (b"size", b"4k"),
            (b"nr_inodes", b"16"),
        ):
            if libc.syscall(FSCONFIG, fs, SET_STRING, key, value, 0) != 0:
                fail("fsconfig tmpfs " + key.decode())
        if libc.syscall(FSCONFIG, fs, CREATE, None, None, 0) != 0:
            fail("making a tmpfs")
        return call("fsmount", FSMOUNT, fs, 1, RDONLY | NOSUID | NODEV | NOEXEC)
    finally:
        os.close(fs)


def lend(req: dict[str, Any]) -> None:
    path, uid = req["path"], req["uid"]
    # The last component not followed, and the same directory the host checked.
    tree = call("open_tree " + path, OPEN_TREE, -100, path.encode(), CLONE | CLOEXEC | 0x100)
    mounted = tree
    try:
        st = os.fstat(tree)
        if (st.st_dev, st.st_ino) != (req["dev"], req["ino"]):
            raise OSError(errno.ESTALE, path + " changed since it was checked")
        if "workdir" not in req:
            # An overlay even read-only: a socket or FIFO seen through it is the overlay's
            # own inode, so no host listener or writer is reached (a bind would reach them).
            set_attrs(tree, RDONLY | NOSUID | NODEV)
            empty = empty_layer()
            try:
                mounted = overlay(
                    path, ((b"lowerdir+", SET_FD, tree), (b"lowerdir+", SET_FD, empty)), RDONLY
                )
            finally:
                os.close(empty)
        else:
            if req["idmap"]:
                ns = userns(uid, uid)
                try:
                    set_attrs(tree, RDONLY | NOSUID | NODEV | IDMAP, ns)
                finally:
                    os.close(ns)
            else:
                set_attrs(tree, RDONLY | NOSUID | NODEV)
            upper, work = layers(
                req["workdir"], req["layers"], req["name"], uid, st.st_mode & 0o777
            )
            try:
                mounted = overlay(
                    path,
                    (
                        (b"lowerdir+", SET_FD, tree),
                        (b"upperdir", SET_FD, upper),
                        (b"workdir", SET_FD, work),
                    ),
                    0,
                )
            finally:
                for fd in (upper, work):
                    os.close(fd)

        def attach() -> None:
            bridges: list[int] = []
            try:
                target = mount_point(path, uid, bridges)
                try:
                    if libc.syscall(MOVE_MOUNT, mounted, b"", target, b"", F_EMPTY | T_EMPTY) != 0:
                        fail("move_mount onto " + path)
                finally:
                    os.close(target)
            finally:
                for bridge in bridges:
                    try:
                        reconfigure(bridge, "ro")
                    finally:
                        os.close(bridge)

        in_kernel(req["pid"], attach)
    finally:
        if mounted != tree:
            os.close(mounted)
        os.close(tree)


def serve(requests: TextIO, answers: TextIO) -> None:
    """Answer each request line of ``requests`` on ``answers`` until its end."""
    for line in requests:
        try:
            req = json.loads(line)
            if req["op"] == "show":
                show(req["pid"], req["path"])
            else:
                lend(req)
            answers.write("ok\n")
        except Exception as exc:
            answers.write("error " + str(exc).replace("\n", " ") + "\n")
        answers.flush()


def main() -> None:
    """The helper's process: the host's mount namespace is remembered, then requests served."""
    _home.append(os.open("/proc/self/ns/mnt", os.O_RDONLY))
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
