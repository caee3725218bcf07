"""Per-kernel control groups: cgroup v2, or the v1 controllers a host mounts, for memory, CPU
share and process count, and for killing every process of a kernel at once.

A kernel's group is made under the host process's own group of each hierarchy, named
``kx-<host pid>-<n>``; a host killed before it could remove its groups leaves them empty
(the launcher kills their processes), and :func:`sweep_stale` removes them later.

An executor's memory budget is a parent group (:class:`BudgetGroup`, ``kx-<host pid>-b<n>``)
in the memory hierarchy, holding the memory groups of all of its kernels: when they reach it
together, the kernel OOM killer picks the largest process among them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import psutil

ROOT = Path("/sys/fs/cgroup")
_counter = itertools.count(1)

# Limit name -> (v1 controller, v2 file that enforces it).
CONTROLLERS = {"memory_mb": "memory", "cpus": "cpu", "max_processes": "pids"}
_PERIOD_US = 100_000


@dataclass(frozen=True)
class Hierarchy:
    """Where a controller lives: a v1 mount, or the v2 unified tree."""

    version: int
    base: Path  # the host process's own group in this hierarchy


@dataclass(frozen=True)
class CgroupSupport:
    """What this host lets kernelexec do with cgroups (probed once per process)."""

    v2: Hierarchy | None = None  # for cgroup.kill, and limits on a v2 host
    v1: dict[str, Hierarchy] = field(default_factory=dict)  # controller -> hierarchy
    v2_controllers: frozenset[str] = frozenset()
    v2_kill: bool = False

    def mechanism(self, limit: str) -> str | None:
        """How ``limit`` is enforced with cgroups here, or None when it cannot be."""
        ctrl = CONTROLLERS.get(limit)
        if ctrl is None:
            return None
        if ctrl in self.v2_controllers:
            return f"cgroup v2 {_V2_FILES[ctrl]}"
        if ctrl in self.v1:
            return f"cgroup v1 {_V1_FILES[ctrl]}"
        return None

    @property
    def kill(self) -> str | None:
        """How every process of a kernel is killed at once, or None."""
        if self.v2 is not None and self.v2_kill:
            return "cgroup v2 cgroup.kill"
        if self.v1:
            return "cgroup v1 (every pid in cgroup.procs killed until empty)"
        return None


_V2_FILES = {"memory": "memory.max", "cpu": "cpu.max", "pids": "pids.max"}
_V1_FILES = {"memory": "memory.limit_in_bytes", "cpu": "cpu.cfs_quota_us", "pids": "pids.max"}


def _own_groups() -> dict[str, str]:
    """This process's group per hierarchy: controller name (or ``""`` for v2) -> path."""
    groups: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(",") if names else [""]:
                groups[name] = path
    return groups


def _writable_child(base: Path, file: str = "cgroup.procs") -> bool | None:
    """Whether a child group can be made (and removed) under ``base`` (None: it can't), and
    whether the child has ``file``."""
    probe = base / f"kx-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        pass
    except OSError:
        return None
    has = (probe / file).exists()
    with contextlib.suppress(OSError):
        probe.rmdir()
    return has


@lru_cache(maxsize=1)
def support() -> CgroupSupport:
    """Probe the host's cgroups once: which hierarchy holds what, and whether it is writable."""
    if not ROOT.is_dir():
        return CgroupSupport()
    own = _own_groups()
    unified = ROOT if (ROOT / "cgroup.controllers").exists() else ROOT / "unified"
    v2 = None
    v2_controllers: frozenset[str] = frozenset()
    v2_kill = False
    if (unified / "cgroup.controllers").exists() and "" in own:
        base = unified / own[""].lstrip("/")
        kill = _writable_child(base, "cgroup.kill")
        if kill is not None:
            v2, v2_kill = Hierarchy(2, base), kill
            if unified == ROOT:
                v2_controllers = _enable_v2(base)
    v1: dict[str, Hierarchy] = {}
    for ctrl in ("memory", "cpu", "pids"):
        if ctrl in v2_controllers or ctrl not in own:
            continue
        mount = ROOT / ctrl
        if not (mount / "cgroup.procs").exists():
            continue
        base = mount / own[ctrl].lstrip("/")
        if _writable_child(base) is not None:
            v1[ctrl] = Hierarchy(1, base)
    return CgroupSupport(v2=v2, v1=v1, v2_controllers=v2_controllers, v2_kill=v2_kill)


def _enable_v2(base: Path) -> frozenset[str]:
    """Turn memory, cpu and pids on for the children of ``base`` (v2 host); return those on."""
    try:
        available = set((base / "cgroup.controllers").read_text().split())
    except OSError:
        return frozenset()
    wanted = available & {"memory", "cpu", "pids"}
    for ctrl in wanted:
        with contextlib.suppress(OSError):
            (base / "cgroup.subtree_control").write_text(f"+{ctrl}")
    try:
        on = set((base / "cgroup.subtree_control").read_text().split())
    except OSError:
        return frozenset()
    return frozenset(on & wanted)


class KernelCgroup:
    """The groups of one kernel (one per hierarchy used), with its limits written."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    @classmethod
    def create(cls, limits: dict[str, float], budget: BudgetGroup | None = None) -> KernelCgroup:
        """Make the kernel's groups and write ``limits`` (names of :class:`kernelexec.Limits`);
        its memory group goes under ``budget``'s when one is given.

        Raises:
            OSError: a group could not be made or a limit written.
        """
        sup = support()
        name = f"kx-{os.getpid()}-{next(_counter)}"
        paths: list[Path] = []
        made = cls(paths)
        under = budget.path if budget is not None else None
        try:
            if sup.v2 is not None:
                memory_here = "memory" in sup.v2_controllers and under is not None
                path = (under if memory_here and under else sup.v2.base) / name
                path.mkdir()
                paths.append(path)
                for limit, value in limits.items():
                    ctrl = CONTROLLERS.get(limit)
                    if ctrl in sup.v2_controllers:
                        (path / _V2_FILES[ctrl]).write_text(_v2_value(limit, value))
            for ctrl, hier in sup.v1.items():
                values = {k: v for k, v in limits.items() if CONTROLLERS.get(k) == ctrl}
                if not values and sup.v2 is not None:
                    continue  # v2 kills; a v1 group is only needed for a limit
                base = under if ctrl == "memory" and under is not None else hier.base
                path = base / name
                path.mkdir()
                paths.append(path)
                for limit, value in values.items():
                    _write_v1(path, limit, value)
        except BaseException:
            made.remove()
            raise
        return made

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to, to join every group."""
        return [str(p / "cgroup.procs") for p in self.paths]

    def pids(self) -> set[int]:
        """Every process in the kernel's groups."""
        found: set[int] = set()
        for path in self.paths:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(x) for x in (path / "cgroup.procs").read_text().split())
        return found

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed in this group so far."""
        for path in self.paths:
            for name in ("memory.events", "memory.oom_control"):
                with contextlib.suppress(OSError, ValueError):
                    for line in (path / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
        return 0

    def reached_own_limit(self) -> bool:
        """Whether the group's memory use ever came to its own limit (v1: the peak within
        4 MiB of ``memory.limit_in_bytes``; v2: a ``max`` event): False when an OOM kill came
        from a budget above it. (v1 ``memory.failcnt`` is not kept by recent kernels.)"""
        for path in self.paths:
            with contextlib.suppress(OSError, ValueError):
                peak = int((path / "memory.max_usage_in_bytes").read_text())
                limit = int((path / "memory.limit_in_bytes").read_text())
                return peak >= limit - 4 * 1024 * 1024
            with contextlib.suppress(OSError, ValueError):
                for line in (path / "memory.events").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value) > 0
        return True

    def kill(self, timeout: float = 5.0) -> bool:
        """Kill every process in the groups; return True once they are empty."""
        for path in self.paths:
            if (path / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    (path / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left and remove the groups."""
        if not self.paths:
            return
        self.kill()
        for path in self.paths:
            with contextlib.suppress(OSError):
                for child in path.iterdir():  # a budget's kernel groups a dead host left
                    if child.is_dir() and child.name.startswith("kx-"):
                        KernelCgroup([child]).remove()
            for _ in range(100):  # a killed process leaves its group a moment after it died
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
        self.paths = []


class BudgetGroup:
    """The parent memory group of an executor's kernels: made when its first kernel starts,
    removed when its last one has ended (:meth:`enter`, :meth:`leave`)."""

    def __init__(self, budget_mb: float) -> None:
        self.budget_mb = budget_mb
        self.path: Path | None = None
        self._kernels = 0

    @staticmethod
    def hierarchy() -> Hierarchy | None:
        """Where budgets live on this host: the memory hierarchy, or None."""
        sup = support()
        if "memory" in sup.v2_controllers and sup.v2 is not None:
            return sup.v2
        return sup.v1.get("memory")

    def enter(self) -> None:
        """A kernel is about to start in the budget: make the group if it is not there.

        Raises:
            OSError: the group could not be made or its limit written.
        """
        if self.path is None:
            hier = self.hierarchy()
            if hier is None:
                raise OSError("no writable cgroup memory controller for the memory budget")
            path = hier.base / f"kx-{os.getpid()}-b{next(_counter)}"
            path.mkdir()
            try:
                size = str(int(self.budget_mb) * 1024 * 1024)
                if hier.version == 2:
                    _enable_v2(path)
                    (path / "memory.max").write_text(size)
                else:
                    (path / "memory.limit_in_bytes").write_text(size)
                    swap = path / "memory.memsw.limit_in_bytes"
                    if swap.exists():
                        with contextlib.suppress(OSError):
                            swap.write_text(size)
            except BaseException:
                KernelCgroup([path]).remove()
                raise
            self.path = path
        self._kernels += 1

    def leave(self) -> None:
        """A kernel of the budget has ended (its own group removed): the last one removes
        the group."""
        self._kernels -= 1
        if self._kernels <= 0 and self.path is not None:
            path, self.path = self.path, None
            self._kernels = 0
            KernelCgroup([path]).remove()


def _v2_value(limit: str, value: float) -> str:
    if limit == "memory_mb":
        return str(int(value) * 1024 * 1024)
    if limit == "cpus":
        return f"{int(value * _PERIOD_US)} {_PERIOD_US}"
    return str(int(value))


def _write_v1(path: Path, limit: str, value: float) -> None:
    if limit == "memory_mb":
        size = str(int(value) * 1024 * 1024)
        (path / "memory.limit_in_bytes").write_text(size)
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():  # memory plus swap: without it the kernel would page out, not stop
            with contextlib.suppress(OSError):
                swap.write_text(size)
    elif limit == "cpus":
        (path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(int(value * _PERIOD_US)))
    elif limit == "max_processes":
        (path / "pids.max").write_text(str(int(value)))


def sweep_stale() -> list[str]:
    """Remove the kernel groups of host processes that are gone (killing what is left)."""
    sup = support()
    bases = [h.base for h in sup.v1.values()] + ([sup.v2.base] if sup.v2 else [])
    removed: list[str] = []
    for base in bases:
        with contextlib.suppress(OSError):
            for entry in base.iterdir():
                parts = entry.name.split("-")
                if len(parts) != 3 or parts[0] != "kx" or not parts[1].isdigit():
                    continue
                if psutil.pid_exists(int(parts[1])):
                    continue
                KernelCgroup([entry]).remove()
                removed.append(str(entry))
    return removed
