"""Running the part of a venv build that executes code a tool named (the build backends of its
requirements) under the isolation of the kernels that will use the venv.

At ``"process"`` and ``"bwrap"`` on a root host the installer runs under kernelexec's launcher
as a uid of its own (:mod:`kernelexec._sandbox._uids`), with a scrubbed environment (the
installer's own configuration and nothing else of the host's), no user namespaces, every
descendant reaped when it ends, and, where the kernels get no network (``"bwrap"`` without
``network=True``), an empty network namespace: local files, an offline wheel cache and
``file://`` indexes still work. What it needs under directories its user cannot search is
bridged (:mod:`kernelexec._sandbox._mounts`). At ``"none"`` (the tools are trusted) and on a
host that is not root, the installer runs as the host's user; a level that needs the network
taken away cannot then build, and :func:`BuildConfinement.check` says so.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kernelexec._exceptions import EnvSetupError
from kernelexec._models import IsolationLevel
from kernelexec._sandbox import _mounts, _seccomp, _users
from kernelexec._sandbox._launcher import launcher_argv, launcher_config

CARRIED_PREFIXES = ("PIP_", "UV_")
"""Host variables a confined build keeps: the installer's configuration (index, find-links,
certificates), which the host chose; every other variable (secrets) is dropped."""

CARRIED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "SSL_CERT_FILE", "SSL_CERT_DIR")


@dataclass(frozen=True)
class BuildConfinement:
    """How the tool-named part of a build is confined (see the module docstring).

    Attributes:
        level: The isolation level of the kernels that will use the venv.
        network: Whether those kernels get the network.
    """

    level: IsolationLevel = "none"
    network: bool = True

    @property
    def confined(self) -> bool:
        """Whether builds run as a user of their own (a root host, a level above "none")."""
        return self.level != "none" and _users.is_root()

    def check(self) -> None:
        """Refuse a build this host cannot confine as the level asks.

        Raises:
            EnvSetupError: the level takes the network away, and this host cannot do that for
                a build (not root).
        """
        if self.level != "none" and not self.network and not _users.is_root():
            raise EnvSetupError(
                f"building tool-named requirements at isolation={self.level!r} without the "
                "network needs a root host (a network namespace for the installer); build the "
                "venv ahead of time (kernelexec env build) or allow network=True"
            )

    def environment(self, home: str) -> dict[str, str]:
        """The installer's environment: the carried variables, ``HOME`` in the build."""
        env = {
            k: v for k, v in os.environ.items() if k in CARRIED or k.startswith(CARRIED_PREFIXES)
        }
        env.pop("VIRTUAL_ENV", None)
        env["HOME"] = home
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env["UV_CACHE_DIR"] = os.path.join(home, "uv-cache")
        env["PIP_CACHE_DIR"] = os.path.join(home, "pip-cache")
        return env

    def wrap(self, argv: list[str], uid: int, needed: list[str], writable: list[str]) -> list[str]:
        """``argv`` under the launcher as ``uid``, reaching ``needed`` and ``writable``.

        Raises:
            EnvSetupError: a needed path cannot be reached by the build's user.
        """
        bridges: list[tuple[str, list[str]]] = []
        if _mounts.support() is None:
            try:
                bridges = _mounts.plan([*needed, *writable], writable)
            except _mounts.CannotBridge as exc:
                raise EnvSetupError(f"the build's user cannot reach what it needs: {exc}") from None
        for path in writable:
            _users.allow_search(os.path.dirname(path))
        cfg = launcher_config(
            procs=[],
            rlimits=[],
            uid=uid,
            host_pid=os.getpid(),
            bridges=bridges,
            no_userns=_seccomp.supported(),
            netns=not self.network,
        )
        return launcher_argv(argv, cfg)


def take_back(path: Path) -> None:
    """Give everything under ``path`` to the host's user, never following links: readable by
    every user (kernels run as users of their own), writable by none but the host, no set-id
    bits (a build's uid made it, under the launcher's umask 077)."""
    host = os.geteuid()
    for root, dirs, files in os.walk(path):
        for name in [".", *dirs, *files]:
            entry = os.path.join(root, name)
            try:
                st = os.lstat(entry)
                os.chown(entry, host, host, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    continue
                mode = stat.S_IMODE(st.st_mode) & ~0o7022 | 0o644
                if stat.S_ISDIR(st.st_mode) or mode & 0o100:
                    mode |= 0o111
                os.chmod(entry, mode)
            except FileNotFoundError:
                continue
