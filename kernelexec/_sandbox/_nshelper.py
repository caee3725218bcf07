"""The namespace helper: one small root process per host that puts host mounts into a running
kernel's mount namespace, at ``"process"`` (and ``"bwrap"``) on a root host.

A kernel's mount namespace exists from its launch (kernels are started ahead of need), and a
mount made on the host later does not reach it; the old ``mount(2)`` bind refuses to cross
namespaces. The helper builds the mount on the host side as a detached tree (``open_tree``,
``mount_setattr``, ``fsopen``), enters the kernel's namespace (``setns``), attaches the tree
there (``move_mount``) and comes back. ``setns`` into a mount namespace needs a
single-threaded caller, hence a process of its own rather than a thread of the host.

Two requests, one per line as JSON, answered ``ok`` or ``error <why>``:

- ``show``: the host's mount at ``path`` (a capped working directory, :mod:`._disk`), at the
  same path in the kernel's namespace;
- ``lend``: the host directory ``path`` (:mod:`._lend`; refused when it is no longer the one
  the host checked, ``dev`` and ``ino``), read-only and as it is (a read-only overlay over it
  and an empty layer, so that no host socket or FIFO in it is reached), or, with ``workdir`` and
  ``name``, as an overlay whose lower layer is ``path`` read-only (idmapped with ``idmap``, so
  that what the host's user owns appears as the kernel's user's), and whose changes go to
  ``workdir/.kx-lent/name/upper`` (copy on write: the host's directory never changes). Those
  layers are opened without following a link, in folders that must be the host's alone, and
  handed to overlayfs as descriptors: the session's directory is the kernel's, and a link or a
  folder planted there must not steer root's writes.

For ``lend`` the mount point is found in the kernel's view without following a link, one
directory descriptor at a time, and missing directories are made only on a tmpfs (the kernel's
private ``/tmp``, a read-only bridge over a blocked directory, which is made writable for the
moment it takes): never on a host filesystem. A directory on the way that the kernel's user
cannot pass through (the host's ``/root``, a 0700 parent) gets such a bridge then, as
:mod:`._mounts` gives one at launch: the kernel reached nothing under it, and still reaches
only the way to what is lent. The helper ends when the host does (its stdin
closes), or when the last executor of the host process closes (:func:`hold`, :func:`let_go`).
Root only.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import select
import subprocess
import sys
import threading
from typing import Any

from kernelexec import _proctitle

_BODY = r"""
import ctypes, errno, json, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
# The same numbers on every architecture since Linux 5.2 (5.12 for mount_setattr).
OPEN_TREE, MOVE_MOUNT, FSOPEN, FSCONFIG, FSMOUNT, FSPICK, MOUNT_SETATTR = (
    428, 429, 430, 431, 432, 433, 442)
NEWNS, NEWUSER = 0x00020000, 0x10000000
CLONE, CLOEXEC, EMPTY_PATH = 1, 0x80000, 0x1000
F_EMPTY, T_EMPTY = 0x4, 0x40
RDONLY, NOSUID, NODEV, NOEXEC, IDMAP = 0x1, 0x2, 0x4, 0x8, 0x100000
SET_FLAG, SET_STRING, SET_FD, CREATE, RECONFIGURE = 0, 1, 5, 6, 7
TMPFS = 0x01021994
home = os.open("/proc/self/ns/mnt", os.O_RDONLY)


def fail(what):
    err = ctypes.get_errno()
    raise OSError(err, what + ": " + os.strerror(err))


def call(what, number, *args):
    fd = libc.syscall(number, *args)
    if fd < 0:
        fail(what)
    return fd


def fs_error(fs):
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


def in_kernel(pid, work):
    ns = os.open("/proc/" + str(pid) + "/ns/mnt", os.O_RDONLY)
    try:
        if libc.setns(ns, NEWNS) != 0:
            fail("setns into the kernel's mount namespace")
        try:
            return work()
        finally:
            if libc.setns(home, NEWNS) != 0:
                os._exit(3)  # cannot come back: let the host start another helper
            os.chdir("/")
    finally:
        os.close(ns)


def show(pid, path):
    tree = call("open_tree " + path, OPEN_TREE, -100, path.encode(), CLONE | CLOEXEC | 0x8000)
    try:
        def attach():
            if libc.syscall(MOVE_MOUNT, tree, b"", -100, path.encode(), F_EMPTY) != 0:
                fail("move_mount onto " + path)
        in_kernel(pid, attach)
    finally:
        os.close(tree)


def userns(uid, gid):
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
        with open("/proc/%d/uid_map" % child, "w") as f:
            f.write("%d %d 1\n" % (os.geteuid(), uid))
        with open("/proc/%d/gid_map" % child, "w") as f:
            f.write("%d %d 1\n" % (os.getegid(), gid))
        return os.open("/proc/%d/ns/user" % child, os.O_RDONLY)
    finally:
        os.write(done_w, b"x")
        os.close(done_w)
        os.close(ready_r)
        os.waitpid(child, 0)


def set_attrs(tree, attrs, ns=-1):
    attr = struct.pack("QQQQ", attrs, 0, 0, max(ns, 0))
    if libc.syscall(MOUNT_SETATTR, tree, b"", EMPTY_PATH, attr, len(attr)) != 0:
        fail("mount_setattr")


def fs_type(fd):
    buf = ctypes.create_string_buffer(256)
    if libc.fstatfs(fd, buf) != 0:
        fail("fstatfs")
    return struct.unpack_from("l", buf.raw)[0]


def reconfigure(root_fd, flag):
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


def our_bridge(fd):
    # Whether fd is on a read-only tmpfs kernelexec mounted (a bridge over a blocked directory):
    # the only read-only place where a mount point is made.
    with open("/proc/self/fdinfo/%d" % fd) as f:
        mnt = [line.split()[1] for line in f if line.startswith("mnt_id:")]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if mnt and fields[0] == mnt[0]:
                rest = fields[fields.index("-") + 1:]
                return rest[:2] == ["tmpfs", "kernelexec"] and "ro" in rest[2].split(",")
    return False


def searchable(st, uid):
    # Whether the kernel's user (uid, its own group, no others) may pass through a directory.
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == uid:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def new_bridge(parent, part):
    # A small tmpfs over parent/part, a directory the kernel's user cannot pass through (so
    # it reached nothing under it): the way to the lent directory is made in it, the rest
    # stays out of sight. Read-only once the loan is in place (see lend).
    fs = call("fsopen tmpfs", FSOPEN, b"tmpfs", 1)
    try:
        for key, value in ((b"source", b"kernelexec"), (b"mode", b"0755"), (b"size", b"64k"),
                           (b"nr_inodes", b"4096")):
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


def mount_point(path, uid, bridges):
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
                    raise OSError(errno.ENOENT, where + " is missing in the kernel's view")
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except OSError as exc:
                    if exc.errno != errno.EROFS:
                        raise
                    root = roots[os.fstat(fd).st_dev]
                    if not our_bridge(root):
                        raise OSError(errno.EROFS, where + ": its parent is read-only")
                    reconfigure(root, "rw")
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    finally:
                        reconfigure(root, "ro")
                inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, where + " is not a directory in the kernel's view")
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


def subdir(parent, name, mode=0o700):
    # parent/name, made if missing, never through a link (the session's directory is its
    # kernel's: it may have put anything there).
    try:
        os.mkdir(name, mode, dir_fd=parent)
    except FileExistsError:
        pass
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                   dir_fd=parent)


def layers(workdir, folder, name, uid, mode):
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
                raise OSError(exc.errno, where + ": " + exc.strerror)
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


def overlay(path, layers, flags):
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


def empty_layer():
    # An empty read-only tmpfs, detached: the second lower layer of a read-only overlay
    # (overlayfs wants two lower layers where there is no upper one).
    fs = call("fsopen tmpfs", FSOPEN, b"tmpfs", 1)
    try:
        for key, value in ((b"source", b"kernelexec"), (b"mode", b"0755"), (b"size", b"4k"),
                           (b"nr_inodes", b"16")):
            if libc.syscall(FSCONFIG, fs, SET_STRING, key, value, 0) != 0:
                fail("fsconfig tmpfs " + key.decode())
        if libc.syscall(FSCONFIG, fs, CREATE, None, None, 0) != 0:
            fail("making a tmpfs")
        return call("fsmount", FSMOUNT, fs, 1, RDONLY | NOSUID | NODEV | NOEXEC)
    finally:
        os.close(fs)


def lend(req):
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
                mounted = overlay(path, ((b"lowerdir+", SET_FD, tree),
                                         (b"lowerdir+", SET_FD, empty)), RDONLY)
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
            upper, work = layers(req["workdir"], req["layers"], req["name"], uid,
                                 st.st_mode & 0o777)
            try:
                mounted = overlay(path, ((b"lowerdir+", SET_FD, tree),
                                         (b"upperdir", SET_FD, upper),
                                         (b"workdir", SET_FD, work)), 0)
            finally:
                for fd in (upper, work):
                    os.close(fd)

        def attach():
            bridges = []
            try:
                target = mount_point(path, uid, bridges)
                try:
                    if libc.syscall(MOVE_MOUNT, mounted, b"", target, b"",
                                    F_EMPTY | T_EMPTY) != 0:
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


for line in sys.stdin:
    try:
        req = json.loads(line)
        if req["op"] == "show":
            show(req["pid"], req["path"])
        else:
            lend(req)
        sys.stdout.write("ok\n")
    except Exception as exc:
        sys.stdout.write("error " + str(exc).replace("\n", " ") + "\n")
    sys.stdout.flush()
"""
# Named in ps like every process kernelexec starts (its command line would be this source).
_SOURCE = (
    _proctitle.SOURCE
    + f"kx_set_title({_proctitle.NS_HELPER!r}, {_proctitle.COMMS[_proctitle.NS_HELPER]!r})\n"
    + _BODY
)

_helper: subprocess.Popen[str] | None = None
_lock = threading.Lock()
_holders = 0  # the backends of open executors: the helper is theirs while there are any


class HelperError(OSError):
    """The helper could not do what was asked (the message has its reason)."""


_DEADLINE = 30.0  # seconds a request may take before the helper is replaced


def request(op: str, **fields: Any) -> None:
    """Ask the helper (started on first use, again if it died) to do ``op`` with ``fields``.
    One request at a time; one that takes longer than 30 s ends the helper (the next starts
    another), so no kernel's request holds the others up for longer. Asked while no executor
    holds it (:func:`hold`), the helper ends after answering.

    Raises:
        HelperError: it answered with an error, died twice, or took too long.
    """
    global _helper
    line = json.dumps({"op": op, **fields}) + "\n"
    with _lock:
        for _attempt in (1, 2):
            helper = _helper
            if helper is None or helper.poll() is not None:
                helper = _helper = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _SOURCE],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    cwd="/",
                )
            assert helper.stdin is not None and helper.stdout is not None
            try:
                helper.stdin.write(line)
                helper.stdin.flush()
                # poll, not select: a host with many kernels has descriptors above 1023.
                waiting = select.poll()
                waiting.register(helper.stdout, select.POLLIN)
                if not waiting.poll(_DEADLINE * 1000):
                    _stop(helper, kill=True)
                    _helper = None
                    raise HelperError(errno.ETIMEDOUT, f"{op} took more than {_DEADLINE:g} s")
                answer = helper.stdout.readline().strip()
            except OSError as exc:
                if isinstance(exc, HelperError):
                    raise
                answer = ""
            if answer and not _holders:  # asked outside any executor (a probe): not kept
                _stop(helper)
                _helper = None
            if answer == "ok":
                return
            if answer:
                raise HelperError(errno.EIO, answer.removeprefix("error "))
            _stop(helper)  # it died: once more with a new one
            _helper = None
    raise HelperError(errno.EIO, "the namespace helper died")


def hold() -> None:
    """An executor that may ask for the helper opens (a backend's ``hold``)."""
    global _holders
    with _lock:
        _holders += 1


def let_go() -> None:
    """An executor that called :func:`hold` has closed: the last one ends the helper, so a
    process that closed its executors has nothing of kernelexec's left running (a later
    executor's request starts a new helper)."""
    global _helper, _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if _holders == 0 and _helper is not None:
            _stop(_helper)
            _helper = None


def _stop(helper: subprocess.Popen[str], *, kill: bool = False) -> None:
    """End the helper: its stdin closed, it returns (killed if it does not, or at once)."""
    if kill:
        helper.kill()
    for pipe in (helper.stdin, helper.stdout):
        with contextlib.suppress(OSError):
            if pipe is not None:
                pipe.close()
    try:
        helper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()


@atexit.register
def _stop_helper() -> None:
    global _helper
    with _lock:
        if _helper is not None:
            _stop(_helper)
            _helper = None
