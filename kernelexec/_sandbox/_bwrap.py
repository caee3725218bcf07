"""The bubblewrap command line of a kernel at ``isolation="bwrap"``.

The kernel sees a read-only view of the system directories and of its interpreter (the venv and
the Python it was made from), its own directory (connection file, ipc sockets) and the
executor's session directories writable, a private size-capped ``/tmp`` and ``/dev/shm``, and
nothing else of the
host: no home, no ``/run`` (a read-only bind does not stop ``connect()`` on a unix socket), no
other kernel's directory. It gets its own PID, IPC, UTS and (unless ``network=True``) network
namespaces, dies with its launcher, and on a root host runs as its own user through ``setpriv``
(``bwrap --uid`` as root only renames root inside a user namespace).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

INSTALL_HINT = "apt-get install -y bubblewrap"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
TMP_MB = 256
"""Size of the kernel's private ``/tmp`` and ``/dev/shm`` when none is given (a tmpfs is host
memory)."""


def bwrap_path() -> str | None:
    """The bubblewrap executable, or None when it is not installed."""
    return shutil.which("bwrap")


def setpriv_path() -> str | None:
    """The setpriv executable (util-linux), or None."""
    return shutil.which("setpriv")


def bwrap_argv(
    *,
    readonly: list[str],
    writable: list[str],
    env: dict[str, str],
    chdir: str,
    network: bool,
    uid: int | None,
    tmp_mb: int = TMP_MB,
) -> list[str]:
    """The command-line prefix that runs a command inside the sandbox (append the command)."""
    bwrap = bwrap_path()
    assert bwrap is not None
    argv = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if not network:
        argv.append("--unshare-net")
    argv += ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "kernelexec"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    size = str((tmp_mb or TMP_MB) * 1024 * 1024)
    argv += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    argv += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    mounted = {"/", "/tmp", "/dev", "/proc"}
    targets = sorted({os.path.realpath(p) for p in readonly + writable})
    made: set[str] = set()
    for target in targets:
        # Directories bwrap would make on its own tmpfs are root-only (0700): a dropped user
        # could not pass them.
        for parent in reversed(Path(target).parents):
            name = str(parent)
            if name in mounted or name in made or _under(name, set(SYSTEM_DIRS)):
                continue
            made.add(name)
            argv += ["--perms", "0755", "--dir", name]
    for path in sorted({os.path.realpath(p) for p in readonly}):
        argv += ["--ro-bind", path, path]
    for path in sorted({os.path.realpath(p) for p in writable}):
        argv += ["--bind", path, path]
    for key, value in sorted(env.items()):
        argv += ["--setenv", key, value]
    argv += ["--chdir", chdir, "--"]
    if uid is not None:
        setpriv = setpriv_path()
        assert setpriv is not None
        argv += [
            setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]
    return argv


def _under(path: str, roots: set[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)
