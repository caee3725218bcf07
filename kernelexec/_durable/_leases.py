"""``LeaseBook``: which executor holds which agent of a shared ``state_dir``, kept in the store.

Layout (beside ``agents/``; private as the rest of the directory)::

    state_dir/
        leases/<key>.lock         flock()ed by the executor holding the agent: the guard
        leases/<key>.json         who holds it: agent id, environment, holder token, host, pid
        holders/<token>/          one per open executor (a random token)
            alive.json            its host, pid and the time it last renewed (every few s)
            <key>.<r>.req         a hand-over request another executor dropped here
            <key>.<r>.ans         the holder's answer ("busy", or "refused" with the reason)

The lock decides: an executor runs an agent's kernel only while it holds that agent's
``flock`` on the file the name ``<key>.lock`` links to now, and the kernel releases a lock when
its process ends. The records only say who, for a hand-over request and for ``kernelexec
sessions``; a record of a holder whose lock is free is stale and simply overwritten.

A holder on another host whose heartbeat stops (its host died, or was cut off) may keep its
lock for long: the filesystem's lock manager lets it go only when it declares that host's
locks lost (NFSv4: its lease time; NFSv3: when the host comes back). So an executor that has
seen such a heartbeat unchanged for a while, by its own clock, *breaks* the lease
(:meth:`LeaseBook.break_stale`): under a short guard lock, and only if nothing changed
meanwhile, it unlinks the lock file and leaves a ``<key>.revoked`` note in the holder's inbox;
the next ``try_take`` creates a fresh lock file. A lock is taken only on the file its name
links to after the ``flock`` (checked by inode), so nobody wins on the unlinked one. A holder
that comes back finds its lock file gone or the note (:meth:`LeaseBook.lost`), writes nothing
more to the agent's state and drops its kernel. A holder on this host is never broken: its
lock goes with its process.

    leases/<key>.break        flock()ed for the moment a lease is broken
    holders/<token>/<key>.revoked   the note a breaker leaves

:func:`check_filesystem` refuses, at start, a ``state_dir`` on a filesystem whose locks do not
reach every host that may mount it, and one on which a second lock is not refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kernelexec._durable._store import agent_key, write_atomic
from kernelexec._exceptions import ConfigError

_TOKEN = re.compile(r"^[0-9a-f]{24}$")
_REQUEST = re.compile(r"^([0-9a-f]{40})\.([0-9a-f]{12})\.req$")
_MAX_RECORD = 64 << 10

# The leases this process holds, by (state_dir's device and inode, agent key): on NFS, flock()
# is a POSIX lock on the server, and those never conflict within one process, so two executors
# of one process are kept apart here (executors may run on different threads).
_TAKEN: dict[tuple[int, int, str], str] = {}
_TAKEN_LOCK = threading.Lock()

# Filesystems whose flock() is local to one client, unsupported, or left to a FUSE daemon that
# may not forward it: two hosts would both get the lock.
_LOCAL_LOCKS = frozenset(
    {"cifs", "smb3", "smbfs", "9p", "vboxsf", "vmhgfs", "afs", "coda", "ncpfs", "fuse"}
)


@dataclass(frozen=True)
class Holder:
    """Who holds an agent, as its lease record says."""

    agent_id: str
    env: str
    token: str
    host: str
    pid: int
    since: float
    renewed_at: float | None = None
    """When the holding executor last renewed (None: it has no heartbeat file: gone)."""

    def describe(self) -> str:
        """``process 123 on host 'h'``."""
        return f"process {self.pid} on host {self.host!r}"


@dataclass(frozen=True)
class Request:
    """A hand-over request found in this executor's inbox."""

    name: str
    key: str
    deadline: float
    asker: str


class LeaseBook:
    """The lease files of one ``state_dir`` as one executor sees them.

    Args:
        root: The ``state_dir`` (already made private by :class:`~._store.StateStore`).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = os.urandom(12).hex()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._fds: dict[str, int] = {}
        self._dir = (0, 0)

    @property
    def leases(self) -> Path:
        """``state_dir/leases``."""
        return self.root / "leases"

    @property
    def inbox(self) -> Path:
        """This executor's directory under ``holders/``."""
        return self.root / "holders" / self.token

    def open(self) -> None:
        """Check the filesystem, make the directories, and announce this executor.

        Raises:
            ConfigError: the filesystem's locks cannot be trusted, or the directories cannot
                be made.
        """
        try:
            self.leases.mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"state_dir {self.root}: {exc.strerror or exc}") from None
        check_filesystem(self.root)
        st = os.stat(self.root)
        self._dir = (st.st_dev, st.st_ino)
        try:
            (self.root / "holders").mkdir(exist_ok=True, mode=0o700)
            self.inbox.mkdir(mode=0o700)
            self.renew()
        except OSError as exc:
            raise ConfigError(f"state_dir {self.root}: {exc.strerror or exc}") from None
        self._sweep()

    def close(self) -> None:
        """Let every lease go and take this executor's inbox away."""
        for key in list(self._fds):
            self.release(key)
        with contextlib.suppress(OSError):
            for entry in os.listdir(self.inbox):
                os.unlink(self.inbox / entry)
            os.rmdir(self.inbox)

    def renew(self) -> None:
        """Say this executor is alive now (its heartbeat file)."""
        body = {"host": self.host, "pid": self.pid, "renewed_at": time.time()}
        write_atomic(self.inbox / "alive.json", json.dumps(body).encode(), sync=False)

    # -- one agent's lease --------------------------------------------------------------------

    def try_take(self, agent_id: str, env: str) -> bool:
        """Take the agent's lease if nobody holds it; whether this executor holds it now."""
        key = agent_key(agent_id, env)
        if key in self._fds:
            return True
        with _TAKEN_LOCK:
            if _TAKEN.setdefault((*self._dir, key), self.token) != self.token:
                return False  # another executor of this process holds it
        try:
            if self._lock(key):
                self._record(agent_id, env, key)
                return True
        except BaseException:
            self.release(key)
            raise
        with _TAKEN_LOCK:
            _TAKEN.pop((*self._dir, key), None)
        return False

    def _lock(self, key: str) -> bool:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        path = self.leases / f"{key}.lock"
        for _ in range(8):
            fd = os.open(path, flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False
                raise
            if _same_file(fd, path):
                self._fds[key] = fd
                return True
            os.close(fd)  # a broken lease's file, unlinked meanwhile: lock the new one
        return False

    def _untake(self, key: str) -> None:
        """Take ``key`` out of this process's table of held leases, if this executor is in it."""
        with _TAKEN_LOCK:
            if _TAKEN.get((*self._dir, key)) == self.token:
                del _TAKEN[(*self._dir, key)]

    def mine(self, key: str) -> bool:
        """Whether this executor still holds ``key``'s lease: it locked it, its lock file is
        still the one the name links to, and no breaker left a note (checked on disk)."""
        fd = self._fds.get(key)
        if fd is None or not self.mine_fd(key, fd):
            return False
        return not os.path.lexists(self.inbox / f"{key}.revoked")

    def lost(self) -> list[str]:
        """The keys this executor held whose lease another executor broke (:meth:`mine`)."""
        return [key for key in list(self._fds) if not self.mine(key)]

    def forget(self, key: str) -> None:
        """Let go of a broken lease: its fd is closed, the record (now another's) is kept."""
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.inbox / f"{key}.revoked")
        self._untake(key)

    def lock_id(self, key: str) -> int | None:
        """The inode of ``key``'s lock file now (None: there is none)."""
        try:
            return os.lstat(self.leases / f"{key}.lock").st_ino
        except FileNotFoundError:
            return None

    def break_stale(self, key: str, holder: Holder, lock_id: int) -> bool:
        """Break ``holder``'s lease of ``key``: the caller saw its heartbeat (on another
        host) unchanged for long, by its own clock, and its lock file was inode ``lock_id``.
        Done only if all of that still holds, under the ``.break`` guard (two breakers never
        both unlink); whether it was broken (the caller then takes the lease as usual).
        """
        if holder.host == self.host or holder.token == self.token:
            return False  # a holder on this host lets its lock go with its process
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        guard = os.open(self.leases / f"{key}.break", flags, 0o600)
        try:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False  # another executor breaks it now
                raise
            now = self.holder(key)
            if now is None or now.token != holder.token or now.renewed_at != holder.renewed_at:
                return False
            if self.lock_id(key) != lock_id or not self.locked(key):
                return False
            with contextlib.suppress(OSError):  # a holder that comes back reads it
                note = {"by": f"process {self.pid} on host {self.host!r}", "at": time.time()}
                inbox = self.root / "holders" / holder.token
                write_atomic(inbox / f"{key}.revoked", json.dumps(note).encode())
            os.unlink(self.leases / f"{key}.lock")
            return True
        finally:
            os.close(guard)

    def _record(self, agent_id: str, env: str, key: str) -> None:
        record = Holder(agent_id, env, self.token, self.host, self.pid, time.time())
        write_atomic(self.leases / f"{key}.json", json.dumps(asdict(record)).encode())

    def holds(self, agent_id: str, env: str) -> bool:
        """Whether this executor holds the agent's lease."""
        return agent_key(agent_id, env) in self._fds

    def release(self, key: str) -> None:
        """Let the lease of ``key`` (an agent key) go: the record first, then the lock (while
        the lock is held nobody else writes the record)."""
        fd = self._fds.pop(key, None)
        if fd is not None:
            if self.mine_fd(key, fd):  # a broken lease's record is its new holder's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.leases / f"{key}.json")
            os.close(fd)
        self._untake(key)

    def mine_fd(self, key: str, fd: int) -> bool:
        """Whether ``fd`` is still ``key``'s lock file."""
        try:
            return _same_file(fd, self.leases / f"{key}.lock")
        except OSError:
            return False

    def holder(self, key: str) -> Holder | None:
        """Who the record of ``key`` names (None: no record, or an unreadable one)."""
        data = _read_json(self.leases / f"{key}.json")
        try:
            found = Holder(**data) if data is not None else None
        except TypeError:
            return None
        if found is None or not _TOKEN.match(found.token):
            return None
        alive = _read_json(self.root / "holders" / found.token / "alive.json")
        renewed = alive.get("renewed_at") if alive else None
        return Holder(**{**asdict(found), "renewed_at": renewed if renewed else None})

    def locked(self, key: str) -> bool:
        """Whether some executor holds the lock of ``key`` now (probed: taken and let go)."""
        if key in self._fds:
            return True
        try:
            fd = os.open(self.leases / f"{key}.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def held(self) -> dict[tuple[str, str], Holder]:
        """Every agent an executor holds now (its lock is held), by agent id and environment;
        records whose lock is free (a holder that died) are left out."""
        found = {}
        try:
            entries = os.listdir(self.leases)
        except FileNotFoundError:
            return {}
        for entry in sorted(entries):
            key, dot, ext = entry.partition(".")
            if ext != "json" or not dot:
                continue
            holder = self.holder(key)
            if holder is not None and self.locked(key):
                found[(holder.agent_id, holder.env)] = holder
        return found

    # -- hand-over requests -------------------------------------------------------------------

    def ask(self, holder: Holder, deadline: float) -> str | None:
        """Drop a request for ``holder``'s agent into its inbox; the request's name (None: the
        holder has no inbox, it is gone)."""
        key = agent_key(holder.agent_id, holder.env)
        name = f"{key}.{os.urandom(6).hex()}.req"
        body = {"asker": f"process {self.pid} on host {self.host!r}", "deadline": deadline}
        try:
            write_atomic(self.root / "holders" / holder.token / name, json.dumps(body).encode())
        except (FileNotFoundError, NotADirectoryError):
            return None
        return name

    def answer_to(self, holder: Holder, name: str) -> dict[str, Any] | None:
        """The holder's answer to the request ``name``, if it gave one."""
        return _read_json(self.root / "holders" / holder.token / f"{name[:-4]}.ans")

    def withdraw(self, holder: Holder, name: str) -> None:
        """Remove a request and its answer (the asker is done with them)."""
        for suffix in ("req", "ans"):
            with contextlib.suppress(OSError):
                os.unlink(self.root / "holders" / holder.token / f"{name[:-4]}.{suffix}")

    def requests(self) -> list[Request]:
        """The requests in this executor's inbox for agents it holds; others are removed."""
        found = []
        try:
            entries = os.listdir(self.inbox)
        except FileNotFoundError:
            return []
        for entry in entries:
            match = _REQUEST.match(entry)
            if match is None:
                continue
            data = _read_json(self.inbox / entry) or {}
            deadline = data.get("deadline")
            if not isinstance(deadline, int | float) or match[1] not in self._fds:
                with contextlib.suppress(OSError):
                    os.unlink(self.inbox / entry)
                continue
            found.append(Request(entry, match[1], float(deadline), str(data.get("asker", "?"))))
        return found

    def answer(self, request: Request, status: str, why: str) -> None:
        """Answer ``request`` (``"busy"``: still trying; ``"refused"``: the holder keeps it)."""
        body = json.dumps({"status": status, "why": why}).encode()
        with contextlib.suppress(OSError):
            write_atomic(self.inbox / f"{request.name[:-4]}.ans", body, sync=False)

    def pending(self, request: Request) -> bool:
        """Whether ``request`` is still in the inbox (its asker withdraws it when it stops
        waiting)."""
        return (self.inbox / request.name).exists()

    def done(self, request: Request) -> None:
        """The request is served: take it out of the inbox."""
        with contextlib.suppress(OSError):
            os.unlink(self.inbox / request.name)

    # -- what dead executors left -------------------------------------------------------------

    def _sweep(self) -> None:
        """Remove the inboxes of executors of this host whose process is gone."""
        holders = self.root / "holders"
        for token in os.listdir(holders):
            if token == self.token or not _TOKEN.match(token):
                continue
            alive = _read_json(holders / token / "alive.json")
            if alive is None or alive.get("host") != self.host or _pid_alive(alive.get("pid")):
                continue
            with contextlib.suppress(OSError):
                for entry in os.listdir(holders / token):
                    os.unlink(holders / token / entry)
                os.rmdir(holders / token)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` links to the file open as ``fd`` (False: it is gone, or another)."""
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = json.loads(os.read(fd, _MAX_RECORD))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


# -- the filesystem check ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """The mount a path lies on, from ``/proc/self/mountinfo``."""

    point: str
    fstype: str
    source: str
    options: frozenset[str]


def mount_of(path: str, mountinfo: str) -> Mount | None:
    """The mount of ``path`` (a real path) among the lines of ``mountinfo``: the one with the
    longest mount point above it, the last mounted when several share that point."""
    best: Mount | None = None
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        point = _unescape(fields[4])
        if not (path == point or path.startswith(point.rstrip("/") + "/")):
            continue
        if best is None or len(point) >= len(best.point):
            opts = set(fields[5].split(",")) | set(rest[2].split(",") if len(rest) > 2 else ())
            best = Mount(point, rest[0], _unescape(rest[1]), frozenset(opts))
    return best


def lock_problem(mount: Mount) -> str | None:
    """Why ``flock()`` on ``mount`` cannot keep two hosts from holding one agent (None: it
    can). NFS forwards ``flock`` to the server as a whole-file lock unless mounted ``nolock``
    or ``local_lock=flock|all``; Lustre only with ``flock``; the others named here keep locks
    on one client or leave them to a FUSE daemon."""
    fstype, opts = mount.fstype, mount.options
    base = fstype.split(".", 1)[0]
    if base == "nfs" or base == "nfs4":
        if "nolock" in opts or "local_lock=flock" in opts or "local_lock=all" in opts:
            return "mounted with nolock or local_lock: its locks are local to each host"
        return None
    if fstype == "lustre":
        return None if "flock" in opts else "mounted without flock: locks are local or off"
    if base in _LOCAL_LOCKS or fstype == "sshfs":
        return "its locks are local to each host or not supported"
    return None


def check_filesystem(root: Path, mountinfo: str | None = None) -> None:
    """Refuse a ``state_dir`` whose locks cannot guard an agent: on a filesystem that
    :func:`lock_problem` names, or where a second lock on one file is not refused (probed).
    ``mountinfo``: the mount table to look in (default: this process's).

    Raises:
        ConfigError: naming the filesystem, its mount point and why.
    """
    real = os.path.realpath(root)
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            mountinfo = ""
    mount = mount_of(real, mountinfo)
    if mount is not None:
        problem = lock_problem(mount)
        if problem is not None:
            raise ConfigError(
                f"state_dir {root} is on a {mount.fstype} filesystem ({mount.source} at "
                f"{mount.point}): {problem}, so two executors could run one agent at once; "
                "use a local filesystem, or NFS with locking (see docs/durable.md)"
            )
    if not _locks_enforced(root):
        what = f"{mount.fstype} filesystem at {mount.point}" if mount else "filesystem"
        raise ConfigError(
            f"state_dir {root}: the {what} does not refuse a second lock on one file, so two "
            "executors could run one agent at once"
        )


def _locks_enforced(root: Path) -> bool:
    """Whether a second open of a file is refused the lock the first holds (probed)."""
    probe = root / "leases" / "probe.lock"
    if not probe.parent.is_dir():
        probe = root / "LOCK"
    first = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    second = os.open(probe, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        # Another executor probes (or, on LOCK, uses the directory) now: locks work.
        os.close(first)
        os.close(second)
        return True
    try:
        fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        return False
    finally:
        os.close(second)
        os.close(first)


def _unescape(text: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), text)
