"""What a kernel gets at an isolation level on this host: which mechanism enforces each limit
and draws each boundary, decided once per launch, with a ConfigError for what cannot be done.

Limits asked for explicitly are enforced or refused; kernelexec's defaults (:data:`DEFAULTS`)
use the best mechanism the host has and are reported as not enforced where it has none.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import psutil

from kernelexec import _proctitle
from kernelexec._exceptions import ConfigError, KernelStartError
from kernelexec._models import IsolationLevel, check_isolation
from kernelexec._sandbox import _bwrap, _cgroups, _disk, _mounts, _seccomp, _users
from kernelexec._sandbox._launcher import launcher_argv, launcher_config


def default_limits() -> dict[str, float]:
    """kernelexec's limits when none are given, and why each is what it is.

    * ``memory_mb``: half the host's memory, so one runaway kernel leaves the host (and the
      other kernels) the other half instead of summoning the host's OOM killer.
    * ``max_processes``: 512 processes and threads, so a fork storm stops long before the
      host's process table (ipykernel itself needs about 12 threads).
    * ``max_open_files``: 4096, a common hard limit; below 128 ipykernel cannot start.

    * ``memory_budget_mb``: three quarters of the host's memory for all of an executor's
      kernels together, so sixteen kernels at the per-kernel default cannot commit eight
      times the host's memory; a quarter stays for the host.
    * ``max_disk_mb``: a quarter of the smaller of the temp dir's free space and the host's
      memory (the scratch space is a tmpfs: memory, then swap), at least 64 MiB.

    No CPU limit (the scheduler shares cores between spinning kernels; ask for ``cpus`` to
    cap one) and no file size limit (it bounds one file, not the disk; give ``max_file_mb``).
    """
    total = psutil.virtual_memory().total
    half = total // (2 * 1024 * 1024)
    try:
        free = shutil.disk_usage(tempfile.gettempdir()).free
    except OSError:
        free = total
    disk = max(64, min(free, total) // (4 * 1024 * 1024))
    return {
        "memory_mb": float(half),
        "max_processes": 512.0,
        "max_open_files": 4096.0,
        "max_disk_mb": float(disk),
        "memory_budget_mb": float(total * 3 // (4 * 1024 * 1024)),
    }


AS_FLOOR_MB = 384
"""Least address space ipykernel starts in with ``MALLOC_ARENA_MAX=2`` (measured: 384 MB 5/5;
below that start-up fails or the first allocation does)."""


@dataclass(frozen=True)
class DiskShares:
    """How a kernel's ``max_disk_mb`` is shared among its writable places, in MiB: together
    never more than the total. At ``"bwrap"`` the scratch share is halved between ``/tmp``
    and ``/dev/shm``."""

    workdir: int
    home: int
    scratch: int


def disk_shares(total: int) -> DiskShares:
    """``max_disk_mb`` shared out: half for the session directory the kernel works in, a
    quarter for its own directory (``HOME``), a quarter for its scratch (``/tmp``, ``/var/tmp``
    and ``/dev/shm``)."""
    workdir, home = total // 2, total // 4
    return DiskShares(workdir=workdir, home=home, scratch=total - workdir - home)


@dataclass(frozen=True)
class SandboxPlan:
    """How kernels of one launch are confined (see the module docstring)."""

    level: IsolationLevel
    network: bool
    cgroup_limits: dict[str, float] = field(default_factory=dict)
    rlimits: list[tuple[int, int]] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    own_user: bool = False
    bridge: bool = False
    reach: tuple[str, ...] = ()
    use_cgroup: bool = False
    readonly: tuple[str, ...] = ()
    limits_text: dict[str, str] = field(default_factory=dict)
    boundaries: dict[str, str] = field(default_factory=dict)
    given: dict[str, float] = field(default_factory=dict)
    scratch_mb: int = 0
    """Size of the kernel's private ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (0: the host's)."""
    no_userns: bool = False
    """Whether the launcher takes user namespaces away (:mod:`kernelexec._sandbox._seccomp`)."""
    budget_mb: float = 0
    """Memory of all of an executor's kernels together (0: no budget)."""

    @property
    def confined(self) -> bool:
        """Whether kernels run under kernelexec's launcher (every level but ``"none"``)."""
        return self.level != "none"

    def prepare(
        self,
        python: str,
        env: dict[str, str],
        kdir: str,
        workdir: str | None,
        *,
        uid: int | None = None,
        procs: list[str] | None = None,
    ) -> KernelSetup:
        """Everything one kernel's launch takes from the plan, once its own directory
        ``kdir``, its user ``uid`` (when :attr:`own_user`) and its cgroup's ``procs`` files
        (when :attr:`use_cgroup`) exist: the kernel's whole environment (``env`` and what the
        level adds), its title, the launcher's configuration with what it bridges and its
        scratch space, and bubblewrap's command line at ``"bwrap"``.

        Raises:
            KernelStartError: a path the kernel needs is no longer reachable.
        """
        full = dict(env)
        if self.confined:
            full["HOME"] = kdir
            full.update(self.extra_env)
        full["PATH"] = _users.kernel_path(python, full.get("PATH"), own_user=self.own_user)
        full["IPYTHONDIR"] = os.path.join(kdir, "ipython")
        full.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        title = _proctitle.kernel_title(None, self.level)
        if not self.confined:
            return KernelSetup(self.level, full, title)
        bwrap = self.level == "bwrap"
        launcher = {
            "procs": procs or [],
            "rlimits": self.rlimits,
            "uid": None if bwrap else uid,  # under bwrap, setpriv drops the user
            "bridges": self.bridges(kdir, workdir),
            "scratch": self.scratch(kdir, workdir),
            "no_userns": self.no_userns,
        }
        prefix: tuple[str, ...] = ()
        if bwrap:
            prefix = tuple(
                _bwrap.bwrap_argv(
                    readonly=list(self.readonly),
                    writable=[kdir, *([workdir] if workdir else [])],
                    env=full,
                    chdir=kdir,
                    network=self.network,
                    uid=uid,
                    tmp_mb=disk_shares(self.scratch_mb).scratch // 2,
                )
            )
        return KernelSetup(self.level, full, title, launcher, prefix)

    def limit_of(self, name: str) -> str:
        """``"memory_mb=256"``: a limit with its value, for errors."""
        value = self.cgroup_limits.get(name)
        return f"{name}={value:g}" if value is not None else name

    def bridges(self, *handed: str | None) -> list[tuple[str, list[str]]]:
        """What the launcher bridges for a kernel given the directories ``handed`` to it (its
        own directory, the sessions' root): see :mod:`kernelexec._sandbox._mounts`.

        Raises:
            KernelStartError: a path the kernel needs is no longer reachable.
        """
        if not self.bridge:
            return []
        dirs = [d for d in handed if d]
        try:
            found = _mounts.plan([*self.reach, *dirs], dirs)
        except _mounts.CannotBridge as exc:
            raise KernelStartError(f"the kernel's user cannot reach what it needs: {exc}") from None
        if self.scratch_mb and self.level == "process":
            # The private /tmp brings back what the kernel needs under /tmp itself.
            found = [(top, paths) for top, paths in found if not _under_tmp(top)]
        return found

    def disk_cap_mb(self, *, home: bool = False) -> int:
        """The size of the tmpfs made for a working directory the kernel enters, or with
        ``home`` for its own directory (:mod:`kernelexec._sandbox._disk`; kernels with users
        of their own, at "process" or "bwrap"); 0 when there is none. ``max_disk_mb`` is the
        kernel's total: see :func:`disk_shares`."""
        if not self.scratch_mb or self.level == "none" or not self.own_user:
            return 0
        shares = disk_shares(self.scratch_mb)
        if _disk.support() is not None:
            return 0
        return shares.home if home else shares.workdir

    def scratch(self, *handed: str | None) -> dict[str, Any] | None:
        """The launcher's private scratch space for a kernel given ``handed`` directories: the
        size, the paths under ``/tmp`` it needs back (its interpreter, its directories) and
        whether it gets its own IPC namespace; None when the host's are kept (see
        :mod:`kernelexec._sandbox._mounts`)."""
        if not self.scratch_mb or self.level != "process":
            return None
        needed = sorted({os.path.realpath(p) for p in [*self.reach, *(d for d in handed if d)]})
        keep = [p for p in needed if _under_tmp(p) and p != "/tmp"]
        keep = [p for p in keep if not any(q != p and p.startswith(q + "/") for q in keep)]
        size = disk_shares(self.scratch_mb).scratch
        return {"size": size * 1024 * 1024, "keep": keep, "ipc": True}


NO_SANDBOX = SandboxPlan(level="none", network=True)
"""The plan of a kernel at ``"none"``: a plain process of the host's user."""


@dataclass(frozen=True)
class KernelSetup:
    """What one kernel's launch takes from its plan (:meth:`SandboxPlan.prepare`)."""

    level: IsolationLevel
    env: dict[str, str]
    """The kernel's whole environment."""
    title: str
    """The kernel's title in ``ps`` until a session takes it."""
    launcher_args: dict[str, Any] | None = None
    """:func:`~kernelexec._sandbox._launcher.launcher_config`'s arguments but the parent (see
    :meth:`launcher`); None: no launcher (at ``"none"``)."""
    bwrap: tuple[str, ...] = ()
    """bubblewrap's command-line prefix (empty: not under bubblewrap)."""

    @property
    def interrupt_mode(self) -> Literal["signal", "message"]:
        """How jupyter-client interrupts the kernel: under bwrap a SIGINT to the process group
        would hit bwrap, which dies of it."""
        return "message" if self.bwrap else "signal"

    def launcher(self, parent: int) -> dict[str, Any] | None:
        """The launcher's configuration when ``parent`` starts it (this process, or a fork
        server); None without a launcher."""
        if self.launcher_args is None:
            return None
        return launcher_config(**self.launcher_args, host_pid=parent)

    def argv(self, kernel: list[str], parent: int) -> list[str]:
        """The command line of a plain launch by ``parent`` of the ``kernel`` command: under
        the launcher, and inside bubblewrap at ``"bwrap"``."""
        launcher = self.launcher(parent)
        if launcher is None:
            return kernel
        return launcher_argv([*self.bwrap, *kernel], launcher)


@lru_cache(maxsize=32)
def _interpreter(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An interpreter's needed directories and the other directories on its ``sys.path``
    (an editable install's source tree), asked of the interpreter once."""
    paths = {os.path.dirname(os.path.realpath(python))}
    entries: list[str] = []
    try:
        out = subprocess.run(
            [
                python,
                "-I",
                "-c",
                "import sys, json; print(json.dumps([[sys.prefix, sys.base_prefix], sys.path]))",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        prefixes, entries = json.loads(out)
        paths.update(os.path.realpath(p) for p in prefixes)
    except (OSError, subprocess.SubprocessError, ValueError):
        pass  # not a Python (a test's fake interpreter): its own directory is all we know
    search = {os.path.realpath(p) for p in entries if p and os.path.isdir(p)}
    search = {p for p in search if not any(p == q or p.startswith(q + "/") for q in paths)}
    return tuple(sorted(paths)), tuple(sorted(search))


def interpreter_paths(python: str) -> tuple[str, ...]:
    """The directories an interpreter needs to run: its prefix, base prefix and the directory
    of the executable it resolves to."""
    return _interpreter(python)[0]


def make_plan(
    level: IsolationLevel,
    given: dict[str, float],
    network: bool | None,
    python: str,
    workdir: str | None,
) -> SandboxPlan:
    """Decide the mechanisms for kernels run by ``python`` at ``level`` with ``given`` limits.

    Raises:
        ConfigError: the level, a limit or the network setting cannot be enforced here (the
            message names it and what is missing).
    """
    check_isolation(level, given, network)
    if level == "none":
        return SandboxPlan(level="none", network=True, boundaries=_none_boundaries())
    if level == "bwrap" and _bwrap.bwrap_path() is None:
        raise ConfigError(
            f"isolation='bwrap' needs bubblewrap, which is not installed "
            f"(Debian/Ubuntu: {_bwrap.INSTALL_HINT})"
        )
    root = _users.is_root()
    if level == "bwrap" and root and _bwrap.setpriv_path() is None:
        raise ConfigError(
            "isolation='bwrap' as root needs setpriv (util-linux) to run kernels as their own "
            "user; it is not installed"
        )
    paths = interpreter_paths(python)
    reach = paths
    if level == "process" and root:
        # Import paths beyond the prefixes (editable installs) are bridged when they can be.
        reach += tuple(p for p in _interpreter(python)[1] if _bridgeable(p))
    own_user, user_text, bridges = _user_plan(level, root, reach, workdir)
    # A private /tmp, /var/tmp and /dev/shm: bwrap's own, or at "process" the launcher's mount
    # namespace, which needs a root host that allows one.
    private = level == "bwrap" or (own_user and _mounts.support() is None)
    sup = _cgroups.support()
    limits = {**default_limits(), **given}
    cg: dict[str, float] = {}
    rl: list[tuple[int, int]] = []
    env: dict[str, str] = {}
    text: dict[str, str] = {}
    scratch_mb = 0
    budget_mb = 0.0
    for name, value in sorted(limits.items()):
        explicit = name in given
        mech = sup.mechanism(name)
        shown = f"{value:g}"
        if name == "memory_budget_mb":
            hier = _cgroups.BudgetGroup.hierarchy()
            if hier is None:
                if explicit:
                    raise ConfigError(
                        f"memory_budget_mb={shown} needs a writable cgroup memory controller "
                        "(cgroup v2, or v1 as root), which this host does not offer"
                    )
                continue
            budget_mb = value
            file = "memory.max" if hier.version == 2 else "memory.limit_in_bytes"
            text[name] = (
                f"{shown} (cgroup v{hier.version} {file} of a parent group holding every kernel "
                "of the executor)"
            )
        elif mech is not None:
            cg[name] = value
            text[name] = f"{shown} ({mech})"
        elif name == "memory_mb":
            if value < AS_FLOOR_MB:
                if explicit:
                    raise ConfigError(
                        f"memory_mb={shown}: this host has no usable cgroup memory controller, "
                        f"and under the fallback (RLIMIT_AS) ipykernel needs at least "
                        f"{AS_FLOOR_MB} MB"
                    )
                continue
            rl.append((resource.RLIMIT_AS, int(value) * 1024 * 1024))
            env["MALLOC_ARENA_MAX"] = "2"  # glibc's per-thread arenas are 64 MB of address space
            text[name] = f"{shown} (RLIMIT_AS per process: address space, not resident memory)"
        elif name == "max_processes" and own_user:
            rl.append((resource.RLIMIT_NPROC, int(value)))
            text[name] = f"{shown} (RLIMIT_NPROC of the kernel's own user)"
        elif name in ("max_open_files", "max_file_mb"):
            res = resource.RLIMIT_NOFILE if name == "max_open_files" else resource.RLIMIT_FSIZE
            amount = int(value) * (1024 * 1024 if name == "max_file_mb" else 1)
            hard = resource.getrlimit(res)[1]
            if not root and hard != resource.RLIM_INFINITY and amount > hard:
                if explicit:
                    raise ConfigError(
                        f"{name}={shown} exceeds this user's hard limit ({hard}); "
                        "only root can raise it"
                    )
                amount = hard
                shown = f"{hard}"
            rl.append((res, amount))
            mechanism = "RLIMIT_NOFILE" if name == "max_open_files" else "RLIMIT_FSIZE"
            text[name] = f"{shown} ({mechanism} per process)"
        elif name == "max_disk_mb":
            if not private:
                if explicit:
                    raise ConfigError(
                        f"max_disk_mb={shown} needs a private mount namespace for the kernel's "
                        "scratch space: isolation='bwrap', or 'process' on a root host"
                    )
                continue
            scratch_mb = int(value)
            share = disk_shares(scratch_mb)
            places = (
                f"in all: /tmp and /dev/shm a {share.scratch // 2} MiB tmpfs each"
                if level == "bwrap"
                else f"in all: /tmp, /var/tmp and /dev/shm one {share.scratch} MiB tmpfs"
            )
            refused = "the host is not root" if not own_user else _disk.support()
            if refused is None:
                places += (
                    f"; HOME (the kernel's own directory) a {share.home} MiB tmpfs; the "
                    f"session directory it works in a {share.workdir} MiB tmpfs"
                )
            else:
                places += f"; not HOME or the session directory ({refused})"
            text[name] = f"{shown} ({places})"
        elif explicit:
            raise ConfigError(
                f"{name}={shown} cannot be enforced here: it needs a writable cgroup "
                f"{_cgroups.CONTROLLERS[name]} controller (cgroup v2, or v1 as root), which "
                f"this host does not offer"
                + (
                    ", or kernels running as their own users (a root host)"
                    if name == "max_processes"
                    else ""
                )
            )
    kill = sup.kill
    # Root-run bwrap creates no user namespace of its own, so the filter does not get in its
    # way; an unprivileged bwrap needs one.
    no_userns = _seccomp.supported() and (level == "process" or root)
    bounds = {
        "environment": "only the allowlisted variables and env_vars; HOME is the kernel's own "
        "directory",
        "user": user_text,
    }
    if level == "process":
        bounds["filesystem"] = (
            "the host's, as the kernel's user sees it; its own directory and working directory"
        )
        if bridges:
            names = {_kernel_dir(): "the kernel's own directory"}
            if workdir:
                names[workdir] = "the sessions' directory"
            shown = _mounts.describe(bridges, names)
            bounds["filesystem"] += (
                f"; of the directories other users cannot search, its mount namespace shows "
                f"only what it needs: {shown}"
            )
        if scratch_mb:
            share = disk_shares(scratch_mb)
            bounds["filesystem"] += (
                f"; a private /tmp, /var/tmp and /dev/shm (one {share.scratch} MiB tmpfs, gone "
                "with the kernel)"
            )
            if own_user and _disk.support() is None:
                bounds["filesystem"] += (
                    f"; its own directory a {share.home} MiB tmpfs and its working directory a "
                    f"{share.workdir} MiB tmpfs (copied back to the disk when the kernel ends)"
                )
            env["TMPDIR"] = "/tmp"
        else:
            bounds["filesystem"] += "; the host's /tmp, /var/tmp and /dev/shm (shared)"
        bounds["network"] = "the host's (no network namespace at this level; abstract unix "
        bounds["network"] += "sockets are shared with every process of the host)"
        bounds["processes"] = (
            "a /proc of its own showing only its user's processes (hidepid=invisible; the "
            "host's /proc where the host refuses it)"
            if scratch_mb
            else "the host's /proc"
            + ("; other users' /proc/<pid>/environ unreadable" if own_user else "")
        )
        if scratch_mb:
            bounds["processes"] += "; own IPC namespace (SysV objects end with the kernel)"
        reap = "subreaper launcher (restart, shutdown; host death via PR_SET_PDEATHSIG)"
    else:
        net = network is True
        share = disk_shares(scratch_mb)
        each = share.scratch // 2 if scratch_mb else _bwrap.TMP_MB
        bounds["filesystem"] = (
            "bwrap: read-only system directories and interpreter, the session directories and a "
            f"private {each} MiB /tmp and /dev/shm writable, nothing else of the host"
        )
        if scratch_mb and own_user and _disk.support() is None:
            bounds["filesystem"] += (
                f"; its own directory a {share.home} MiB tmpfs and its working directory a "
                f"{share.workdir} MiB tmpfs (copied back to the disk when the kernel ends)"
            )
        bounds["network"] = (
            "the host's (network=True)" if net else "bwrap: own network namespace, loopback only"
        )
        bounds["processes"] = "bwrap: own PID, IPC and UTS namespaces"
        reap = "PID namespace + --die-with-parent + subreaper launcher (host death: PDEATHSIG)"
    if no_userns:
        bounds["processes"] += "; no user namespaces (seccomp: unshare/clone CLONE_NEWUSER fail)"
    else:
        bounds["processes"] += "; user namespaces allowed (no seccomp filter on this host)"
    bounds["descendants"] = f"{kill} + {reap}" if kill else reap
    return SandboxPlan(
        level=level,
        network=level != "bwrap" or network is True,
        cgroup_limits=cg,
        rlimits=rl,
        extra_env=env,
        own_user=own_user,
        bridge=bool(bridges) or (level == "process" and bool(scratch_mb)),
        reach=reach,
        use_cgroup=bool(cg) or kill is not None or bool(budget_mb),
        readonly=paths,
        limits_text=text,
        boundaries=bounds,
        given=dict(given),
        scratch_mb=scratch_mb,
        no_userns=no_userns,
        budget_mb=budget_mb,
    )


Bridges = list[tuple[str, list[str]]]


def _under_tmp(path: str) -> bool:
    return path == "/tmp" or path.startswith("/tmp/")


def _kernel_dir() -> str:
    """Where a kernel's own directory will be (made at launch: ``kx-XXXXXXXX``)."""
    return os.path.join(tempfile.gettempdir(), "kx-")


def _bridgeable(path: str) -> bool:
    try:
        _mounts.plan([path])
    except _mounts.CannotBridge:
        return False
    return True


def _user_plan(
    level: IsolationLevel, root: bool, paths: tuple[str, ...], workdir: str | None
) -> tuple[bool, str, Bridges]:
    """Whether kernels run as their own users, the text that says so, and the directories
    bridged for them (``"process"`` on a root host)."""
    own = "its own unprivileged user (uid 2000000000 + n, one per kernel)"
    if not root:
        if level == "bwrap":
            text = "the host's user: kernels of one host user are separated by bwrap's namespaces"
            return False, text + ", not by users", []
        text = "the host's user (not root): kernels of one user can reach each other's files"
        return False, text + " and processes at this level; only 'bwrap' separates them", []
    if level == "bwrap":
        return True, own + " through setpriv", []
    fallback = (
        "the host's user (root): {}; put the interpreter and working directories where other "
        "users can search, or use isolation='bwrap'"
    )
    # The kernel's own directory (made at launch under the temp dir) and the sessions' root are
    # handed to the kernel's user or made searchable by the backend: their parents matter.
    handed = [_kernel_dir(), *([workdir] if workdir else [])]
    try:
        bridges = _mounts.plan(paths, handed)
    except _mounts.CannotBridge as exc:
        return False, fallback.format(exc), []
    if not bridges:
        return True, own, []
    refused = _mounts.support()
    if refused is not None:
        top, needed = bridges[0]
        why = (
            f"{needed[0]} is not reachable by other users ({top} is not searchable) and this "
            f"host refuses the private mount namespace that would bridge it: {refused}"
        )
        return False, fallback.format(why), []
    tops = ", ".join(top for top, _ in bridges)
    return True, f"{own}; what it needs under {tops} is bridged to it (mount namespace)", bridges


def _none_boundaries() -> dict[str, str]:
    return {
        "environment": "only the allowlisted variables and env_vars",
        "user": "the host's user",
        "filesystem": "the host's",
        "network": "the host's",
        "processes": "the host's /proc",
        "descendants": "the kernel's process group only (setsid children survive)",
    }
