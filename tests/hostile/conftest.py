"""Shared pieces of the hostile suite: skips with the reason where the host lacks a mechanism,
and a host layout where a kernel's own user can reach its interpreter (for ``"process"``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kernelexec._sandbox import _cgroups, _users
from tests.support.procs import running

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAVE_BWRAP, reason="bubblewrap is not installed (apt-get install -y bubblewrap)"
)
needs_root = pytest.mark.skipif(not _users.is_root(), reason="kernels get own users only as root")


def needs_cgroup(limit: str) -> pytest.MarkDecorator:
    """Skip unless this host lets kernelexec enforce ``limit`` with a cgroup."""
    return pytest.mark.skipif(
        _cgroups.support().mechanism(limit) is None,
        reason=f"no writable cgroup controller for {limit} on this host",
    )


needs_cgroup_kill = pytest.mark.skipif(
    _cgroups.support().kill is None, reason="no writable cgroup to kill a kernel's processes"
)


def gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait for the processes to end (zombies count as ended); return those still running."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if running(p)]


def host_groups(pid: int) -> list[str]:
    """The cgroups that host process ``pid`` made (its kernels' and its memory budget's)."""
    sup = _cgroups.support()
    bases = [h.base for h in sup.v1.values()] + ([sup.v2.base] if sup.v2 else [])
    return [str(p) for base in bases for p in base.glob(f"kx-{pid}-*")]


@pytest.fixture
def reachable_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A host laid out like a server, not this CI machine: an interpreter every user can run
    (a venv of the system Python seeing this venv's packages) and a temporary directory every
    user can search. Yields the interpreter. Needs root and a system Python of our version."""
    if not _users.is_root():
        pytest.skip("kernels get own users only as root")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = f"/usr/bin/python{version}"
    if not os.path.exists(system):
        pytest.skip(f"no {system} to make an interpreter other users can reach")
    packages = sysconfig.get_paths()["purelib"]
    if _users.blocked(packages) is not None:
        pytest.skip(f"kernelexec's packages are not reachable by other users: {packages}")
    root = tempfile.mkdtemp(prefix="kxhost-", dir="/tmp")
    os.chmod(root, 0o755)
    try:
        venv = Path(root, "venv")
        subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = venv / "lib" / f"python{version}" / "site-packages"
        (site / "host.pth").write_text(packages + "\n")
        tmp = Path(root, "tmp")
        tmp.mkdir(mode=0o755)
        os.chmod(tmp, 0o755)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        yield str(venv / "bin" / "python")
    finally:
        shutil.rmtree(root, ignore_errors=True)
