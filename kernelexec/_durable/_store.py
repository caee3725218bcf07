"""``StateStore``: the on-disk home of hibernated agents under a ``state_dir``.

Layout (private: directories 0700, files 0600, owned by the host's user)::

    state_dir/
        LOCK                      flock()ed shared by every executor using the directory
                                  (exclusively by ``kernelexec sessions --delete``)
        leases/, holders/         which executor holds which agent (see ``_leases``)
        agents/<key>/             key = sha256 of the agent id (and environment): an id is
            manifest.json         never a path, so no id can escape the directory
            manifest.prev.json    the checkpoint before, kept as a fall-back
            since.json            calls ran after the checkpoint (removed by the next one):
                                  found on resume, its host ended without saving them
            r<random>.rec         record files (see ``_kernel_state``), shared by manifests
            f<random>.tar         the working directory's files

A manifest is JSON with a CRC-32 over its body and names the agent and environment it
belongs to; a manifest that does not check out, or names another agent, is never used.
Writes are atomic (a temporary file, ``fsync``, ``rename``, ``fsync`` of the directory).
Record files are moved in from the kernel's staging directory, where the kernel controls what
lies: only a plain file with one link and the expected size is taken.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelexec import _trees
from kernelexec._exceptions import ConfigError
from kernelexec._models import HibernatedAgent

FORMAT = 1
_RECORD = re.compile(r"^r[0-9a-f]{24}\.rec$")
_FILES = re.compile(r"^f[0-9a-f]{24}\.tar$")
MANIFEST = "manifest.json"
PREVIOUS = "manifest.prev.json"
SINCE = "since.json"


@dataclass
class Manifest:
    """One agent's checkpoint as the manifest describes it."""

    agent_id: str
    env: str
    gen: int
    saved_at: str
    records: list[dict[str, Any]] = field(default_factory=list)
    unsaved: dict[str, str] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=dict)
    files: dict[str, Any] | None = None
    unfinished: bool = False
    """A marker written before the session's first checkpoint (no records): found on resume,
    the host ended before it could save; ``unsaved`` holds the names the session had."""

    @property
    def names(self) -> list[str]:
        """The saved names."""
        return sorted(str(n) for r in self.records for n in r.get("names", []))

    @property
    def size(self) -> int:
        """Bytes of every record and the files archive."""
        total = sum(int(r.get("size", 0)) for r in self.records)
        return total + (int(self.files["size"]) if self.files else 0)

    def referenced(self) -> set[str]:
        """The files this manifest needs."""
        found = {str(r["file"]) for r in self.records if r.get("file")}
        if self.files:
            found.add(str(self.files["file"]))
        return found


def agent_key(agent_id: str, env: str) -> str:
    """The directory name of an agent's state (never derived from the id's characters)."""
    return hashlib.sha256(f"{agent_id}\0{env}".encode()).hexdigest()[:40]


def now_iso() -> str:
    """Now, ISO 8601 in UTC."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


class StateStore:
    """A ``state_dir``, locked (shared) while an executor uses it.

    Args:
        root: The directory (made, mode 0700, if missing).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock_fd: int | None = None

    def open(self, exclusive: bool = False) -> None:
        """Make the directory private and take its lock: shared (executors, any number), or
        ``exclusive`` (no executor may use it meanwhile).

        Raises:
            ConfigError: it cannot be made, is not private to this user, or (``exclusive``)
                an executor uses it now.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = os.lstat(self.root)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise ConfigError(f"state_dir {self.root} is not a directory of this user")
            os.chmod(self.root, 0o700)
            (self.root / "agents").mkdir(exist_ok=True, mode=0o700)
            fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ConfigError(f"state_dir {self.root}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"state_dir {self.root} is in use by "
                + ("an executor" if exclusive else "kernelexec sessions --delete")
            ) from None
        self._lock_fd = fd

    def close(self) -> None:
        """Let the lock go."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def agent_dir(self, agent_id: str, env: str) -> Path:
        """Where the agent's state lives (made on demand by :meth:`commit`)."""
        return self.root / "agents" / agent_key(agent_id, env)

    def load(self, agent_id: str, env: str) -> tuple[Manifest | None, list[str]]:
        """The agent's newest intact checkpoint, falling back to the one before; and what was
        wrong with those skipped."""
        where = self.agent_dir(agent_id, env)
        problems: list[str] = []
        for name in (MANIFEST, PREVIOUS):
            try:
                found = read_manifest(where / name)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                problems.append(f"{name}: {exc}")
                continue
            if found.agent_id != agent_id or found.env != env:
                problems.append(f"{name}: belongs to another agent; not used")
                continue
            missing = [f for f in found.referenced() if not (where / f).is_file()]
            if missing:
                problems.append(f"{name}: {len(missing)} record file(s) missing")
                continue
            return found, problems
        return None, problems

    def commit(self, manifest: Manifest, staging: Path | None) -> int:
        """Move the new records in from ``staging`` and make ``manifest`` the agent's
        checkpoint (the current one becomes the fall-back); return the bytes moved in.

        Raises:
            OSError: a staged file is missing, not a plain file, or not the size announced.
        """
        where = self.agent_dir(manifest.agent_id, manifest.env)
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        moved = 0
        staged_fd = _open_staging(staging) if staging is not None else None
        try:
            for rec in manifest.records:
                name = rec.get("file")
                if not name:
                    continue
                if not _RECORD.match(str(name)):
                    raise OSError(errno.EINVAL, f"bad record name {name!r}")
                if (where / name).exists():
                    continue
                if staged_fd is None:
                    raise OSError(errno.ENOENT, f"record {name} is missing")
                _take(staged_fd, str(name), where / name, rec.get("size"))
                moved += int(rec["size"])
        finally:
            if staged_fd is not None:
                os.close(staged_fd)
        current = where / MANIFEST
        with contextlib.suppress(FileNotFoundError):
            # A crash between the two steps leaves only the fall-back: still a whole state.
            os.replace(current, where / PREVIOUS)
        write_atomic(current, encode_manifest(manifest))  # syncs the directory (both renames)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where / SINCE)  # what ran since the older checkpoint is in this one
        self._collect(where)
        return moved

    def mark(self, manifest: Manifest) -> None:
        """Make ``manifest`` (a marker, no records) the agent's only manifest. Not synced: it
        is rewritten on every call that changes the names (an ``fsync`` there cost 10 ms a
        call, measured), and a killed host's page cache is kept; a machine that loses power
        may lose it (the next host then says nothing)."""
        where = self.agent_dir(manifest.agent_id, manifest.env)
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where / PREVIOUS)
        write_atomic(where / MANIFEST, encode_manifest(manifest), sync=False)

    def mark_since(self, agent_id: str, env: str, gen: int, names: list[str]) -> None:
        """Note that calls ran after checkpoint ``gen``, the kernel holding ``names`` now (not
        synced, as :meth:`mark`: rewritten when the names change)."""
        body = json.dumps({"gen": gen, "names": names, "at": now_iso()}).encode()
        write_atomic(self.agent_dir(agent_id, env) / SINCE, body, sync=False)

    def since(self, agent_id: str, env: str, gen: int) -> tuple[list[str], str] | None:
        """The names and time :meth:`mark_since` noted after checkpoint ``gen``, if any."""
        try:
            fd = os.open(self.agent_dir(agent_id, env) / SINCE, os.O_RDONLY | os.O_NOFOLLOW)
            with open(fd, "rb") as f:
                data = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("gen") != gen:
            return None
        names = data.get("names")
        if not isinstance(names, list):
            return None
        return [str(n) for n in names], str(data.get("at", "?"))

    def invalidate(self, agent_id: str, env: str) -> None:
        """Forget the agent's checkpoints (a failed save, a kernel lost: never bring back
        stale values)."""
        where = self.agent_dir(agent_id, env)
        for name in (MANIFEST, PREVIOUS, SINCE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where / name)
        _fsync_dir(where)

    def delete(self, agent_id: str, env: str = "") -> bool:
        """Delete the agent's state; whether there was any."""
        where = self.agent_dir(agent_id, env)
        if not where.exists():
            return False
        _trees.remove(where)
        return True

    def new_files_path(self, agent_id: str, env: str) -> Path:
        """A new path for the working directory's archive."""
        where = self.agent_dir(agent_id, env)
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        return where / f"f{os.urandom(12).hex()}.tar"

    def agents(self) -> list[HibernatedAgent]:
        """Every agent with a usable checkpoint, newest first."""
        found = []
        now = dt.datetime.now(dt.timezone.utc)
        for entry in sorted((self.root / "agents").iterdir()):
            try:
                manifest = read_manifest(entry / MANIFEST)
            except (OSError, ValueError):
                continue
            if manifest.unfinished:
                continue
            if entry.name != agent_key(manifest.agent_id, manifest.env):
                continue
            age = (now - dt.datetime.fromisoformat(manifest.saved_at)).total_seconds()
            found.append(
                HibernatedAgent(
                    agent_id=manifest.agent_id,
                    env=manifest.env,
                    names=manifest.names,
                    bytes=manifest.size,
                    saved_at=manifest.saved_at,
                    age_s=max(0.0, age),
                )
            )
        return sorted(found, key=lambda a: a.age_s)

    def _collect(self, where: Path) -> None:
        """Delete files neither manifest needs."""
        keep: set[str] = set()
        for name in (MANIFEST, PREVIOUS):
            with contextlib.suppress(OSError, ValueError):
                keep |= read_manifest(where / name).referenced()
        for entry in os.listdir(where):
            if (_RECORD.match(entry) or _FILES.match(entry)) and entry not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where / entry)


def _open_staging(staging: Path) -> int | None:
    """The kernel's staging directory, opened without following a link (the kernel may have
    put one there); None when there is none."""
    try:
        return os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None


def _take(staging_fd: int, name: str, target: Path, size: object) -> None:
    """Copy a file the kernel staged into the private directory, accepting only a plain file
    with one link of exactly ``size`` bytes (a number the kernel announced: checked, never
    trusted), holes kept; it is the host's, 0600 and synced afterwards.

    The file is copied, never moved: a kernel holding it open could still write to a file it
    had moved in.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise OSError(errno.EINVAL, f"staged record {name}: bad size {size!r}")
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=staging_fd)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != size:
            raise OSError(errno.EINVAL, f"staged record {name} is not a plain file of {size} bytes")
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            for start, end in _trees.data_segments(src, size):
                while start < end:
                    chunk = os.pread(src, min(8 << 20, end - start), start)
                    if not chunk:
                        break
                    os.pwrite(dst, chunk, start)
                    start += len(chunk)
            os.ftruncate(dst, size)
            os.fsync(dst)
        except BaseException:
            os.close(dst)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            raise
        os.close(dst)
    finally:
        os.close(src)
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=staging_fd)


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as written: its body as JSON text and a CRC-32 of that text."""
    body = json.dumps({"format": FORMAT, **manifest.__dict__}, sort_keys=True)
    return json.dumps({"crc": zlib.crc32(body.encode()), "body": body}).encode()


def read_manifest(path: Path) -> Manifest:
    """Read and check a manifest.

    Raises:
        FileNotFoundError: there is none.
        ValueError: it is damaged or of another format.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as f:
        raw = f.read(64 << 20)
    try:
        outer = json.loads(raw)
        body = outer["body"]
        if zlib.crc32(body.encode()) != outer["crc"]:
            raise ValueError("checksum differs")
        data = json.loads(body)
        if data.pop("format") != FORMAT:
            raise ValueError("another format")
        return Manifest(**data)
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"damaged manifest ({type(exc).__name__})") from None


def write_atomic(path: Path, data: bytes, sync: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new file, whole
    (without ``sync``, a killed process does; a machine that loses power may not)."""
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
