"""Live attach: the registry of attachable sessions, one pair of files per session.

An executor made with ``attachable=True`` registers each of its sessions in a per-user runtime
directory (mode 0700): ``<id>.json`` says who it is (agent id, environment fingerprint, kernel
and host pids, start time, calls) and ``<id>.connection.json`` is a Jupyter connection file for
its current kernel (holding the kernel's HMAC key, hence mode 0600 for both). The files are
rewritten when the session's kernel changes and after every run, and removed when the session
closes. ``kernelexec sessions`` reads them; ``kernelexec attach`` opens a console with the
connection file. Anyone who can read a connection file can run code in that kernel: that is why
attaching is off by default.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs

from kernelexec._exceptions import ConfigError
from kernelexec._models import Restored, now_iso
from kernelexec._tempdirs import process_alive, process_start_time
from kernelexec.backends._base import KernelConnection

if TYPE_CHECKING:
    from kernelexec._core._lease import Arrival, LeasedKernel, Leaving

ENV_VAR = "KERNELEXEC_RUNTIME_DIR"


def runtime_dir(create: bool = True) -> Path:
    """Where attachable sessions are registered: ``$KERNELEXEC_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/kernelexec``, else ``kernelexec/runtime`` in the user's state directory.

    Raises:
        ConfigError: the directory belongs to another user, or cannot be made private.
    """
    if os.environ.get(ENV_VAR):
        path = Path(os.environ[ENV_VAR])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "kernelexec"
    else:
        path = Path(platformdirs.user_state_dir("kernelexec")) / "runtime"
    path = path.expanduser() / "sessions"
    if not create:
        return path
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
        if info.st_uid != os.getuid():
            raise ConfigError(f"the session registry {path} belongs to another user")
        if info.st_mode & 0o077:
            path.chmod(0o700)
    except OSError as exc:
        raise ConfigError(f"the session registry {path}: {exc.strerror}") from None
    return path


def _write_private(path: Path, data: dict[str, Any]) -> None:
    """Write JSON readable by this user only, replacing ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


class SessionRegistration:
    """One attachable session's files; a watcher of its lease (rewritten when the kernel
    changes and after every run, removed when the session is gone).

    Args:
        agent_id: The session's agent id.
        fingerprint: Its environment's fingerprint.
        backend: The backend's name (``local``).
    """

    def __init__(self, agent_id: str, fingerprint: str, backend: str) -> None:
        self._dir = runtime_dir()
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = self._dir / f"{name}.json"
        self.connection_path = self._dir / f"{name}.connection.json"
        pid = os.getpid()
        self._entry: dict[str, Any] = {
            "agent_id": agent_id,
            "fingerprint": fingerprint,
            "backend": backend,
            "kernel_pid": None,
            "host_pid": pid,
            "host_start": process_start_time(pid),
            "started": now_iso(),
            "calls": 0,
            "connection_file": None,
        }
        self._closed = False
        self._save()

    async def attaching(self) -> None:
        """No kernel yet: nothing to write."""

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        """The session's kernel is now ``kernel``: its connection file is written."""
        self._kernel_changed(kernel.conn)
        return None

    async def before_use(self, kernel: LeasedKernel) -> None:
        """Using the kernel changes nothing live attach shows."""

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        """The kernel goes: its connection file too (a lost one's is rewritten by the next
        ``attached``)."""
        if why != "lost":
            self._kernel_changed(None)
        return False

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        """Count the call (the registry shows how busy a session is)."""
        if self._closed:
            return
        self._entry["calls"] += 1
        with contextlib.suppress(OSError):
            self._save()

    def gone(self) -> None:
        """Remove the session's files."""
        self._closed = True
        for path in (self.connection_path, self.path):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def _kernel_changed(self, conn: KernelConnection | None) -> None:
        if self._closed:
            return
        info = conn.connection_info() if conn is not None else None
        with contextlib.suppress(OSError):
            if info is None:
                self.connection_path.unlink(missing_ok=True)
                self._entry["connection_file"] = None
            else:
                _write_private(self.connection_path, info)
                self._entry["connection_file"] = str(self.connection_path)
            self._entry["kernel_pid"] = conn.kernel_pid() if conn is not None else None
            self._save()

    def _save(self) -> None:
        _write_private(self.path, self._entry)


def live_sessions() -> list[dict[str, Any]]:
    """The registered sessions whose host process still runs, oldest first.

    Entries of hosts that are gone (killed before they could clean up) are removed.
    """
    found = []
    directory = runtime_dir(create=False)
    if not directory.is_dir():
        return []
    for path in sorted(directory.glob("*.json")):
        if path.name.endswith(".connection.json"):
            continue
        try:
            entry = json.loads(path.read_text())
            host = int(entry["host_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not process_alive(host, str(entry.get("host_start") or "")):
            for stale in (path, path.with_name(path.name[: -len(".json")] + ".connection.json")):
                with contextlib.suppress(OSError):
                    stale.unlink(missing_ok=True)
            continue
        found.append(entry)
    return sorted(found, key=lambda e: str(e.get("started")))
