"""Hostile: at ``"process"`` on a root host, a kernel running as its own user reaches what it
needs under directories other users cannot search, and nothing else there; where that cannot
be done, it runs as root and its isolation says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._sandbox import _mounts
from kernelexec._sandbox._plan import make_plan
from kernelexec.backends import LocalBackend
from tests.hostile.conftest import needs_root


@needs_root
def test_a_workdir_under_a_private_directory_is_bridged_and_the_rest_is_hidden(
    tmp_path: Path,
) -> None:
    private = tmp_path / "private"
    (private / "host-only").mkdir(parents=True)
    (private / "host-only" / "secret.txt").write_text("the host's")
    os.chmod(private, 0o700)
    with kx.KernelExecutor(workdir=private / "work") as ex:
        s = ex.session("deep")
        assert s.isolation.boundaries["user"].startswith("its own unprivileged user")
        shown = s.isolation.boundaries["filesystem"]
        assert "the sessions' directory" in shown and "the kernel's own directory" in shown
        assert s.run_code("open('mine.txt', 'w').write('k')").ok
        assert (s.workdir / "mine.txt").read_text() == "k"  # the host sees what it wrote
        listing = s.run_code(f"import os; sorted(os.listdir({str(private)!r}))")
        assert listing.result == "['work']"
        secret = s.run_code(f"open({str(private / 'host-only' / 'secret.txt')!r}).read()")
        assert secret.error is not None and secret.error.ename == "FileNotFoundError"
        # Nothing can be put beside the bridged paths: a read-only bridge, or (under /tmp,
        # which is the kernel's own scratch) the root-owned path rebuilt to reach them.
        planted = s.run_code(f"open({str(private / 'planted')!r}, 'w')")
        assert planted.error is not None
        assert planted.error.ename in ("OSError", "PermissionError")
        assert "Read-only file system" in planted.error.evalue or (
            "Permission denied" in planted.error.evalue
        )
    assert sorted(p.name for p in private.iterdir()) == ["host-only", "work"]  # nothing planted


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can search (outside this suite's 0700 temp root)."""
    path = Path(tempfile.mkdtemp(prefix="kxbridge-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_what_cannot_be_bridged_is_refused_with_the_reason(open_dir: Path) -> None:
    lib = open_dir / "lib"
    needed = lib / "python"
    needed.mkdir(parents=True)
    (lib / "python" / "bin").mkdir()
    lib.chmod(0o700)
    assert _mounts.plan([str(needed), str(needed / "bin")]) == [(str(lib), [str(needed)])]
    assert _mounts.plan([str(open_dir)]) == []
    (needed / "bin").chmod(0o700)  # inside a bridged path: a bridge would not help
    with pytest.raises(_mounts.CannotBridge, match=r"bin \(mode 0700\) blocks it"):
        _mounts.plan([str(needed), str(needed / "bin")])
    needed.chmod(0o700)  # the needed directory itself
    with pytest.raises(_mounts.CannotBridge, match=r"python \(mode 0700\) blocks it"):
        _mounts.plan([str(needed)])
    # Paths the backend hands to the kernel's user need only their parents reachable.
    assert _mounts.plan([str(needed)], [str(needed)]) == [(str(lib), [str(needed)])]


@needs_root
def test_an_interpreter_no_other_user_can_reach_leaves_the_kernel_as_root_saying_why(
    tmp_path: Path,
) -> None:
    home = tmp_path / "hidden"
    home.mkdir(mode=0o700)
    python = home / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # not a Python: its directory is all it needs
    python.chmod(0o755)
    plan = make_plan("process", {}, None, str(python), None)
    assert not plan.own_user and not plan.bridge
    assert plan.boundaries["user"].startswith("the host's user (root): ")
    assert f"{home} (mode 0700) blocks it" in plan.boundaries["user"]


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing")
def test_a_host_refusing_mount_namespaces_runs_kernels_as_root_saying_why() -> None:
    # Root without CAP_SYS_ADMIN (as in a default container): unshare(CLONE_NEWNS) is refused.
    code = (
        "import sys\n"
        "from kernelexec._sandbox._plan import make_plan\n"
        "plan = make_plan('process', {}, None, sys.argv[1], None)\n"
        "print(plan.own_user, plan.boundaries['user'])\n"
    )
    out = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--", sys.executable, "-c", code, sys.executable],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    blocked = _mounts.plan([sys.prefix, sys.base_prefix])
    if not blocked:
        assert out.startswith("True its own unprivileged user")  # nothing to bridge here
        return
    assert out.startswith("False the host's user (root): ")
    assert "refuses the private mount namespace that would bridge it" in out
    assert "unshare(CLONE_NEWNS): Operation not permitted" in out


@needs_root
def test_an_editable_project_under_the_hosts_home_is_importable_and_nothing_else_there(
    open_dir: Path,
) -> None:
    # A venv whose .pth files point at this environment's packages and at a project in the
    # host's home (an editable install), as a developer's root machine has it.
    home = Path(os.path.expanduser("~"))
    project = home / f".kx-project-{os.getpid()}"
    (project / "kxproject").mkdir(parents=True)
    (project / "kxproject" / "__init__.py").write_text("WHERE = 'the home'\n")
    try:
        venv = open_dir / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next(venv.glob("lib/python*/site-packages"))
        (site / "host.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        (site / "project.pth").write_text(f"{project}\n")
        backend = LocalBackend(python=str(venv / "bin" / "python"))
        with kx.KernelExecutor(backend=backend) as ex:
            s = ex.session("editable")
            assert s.isolation.boundaries["user"].startswith("its own unprivileged user")
            found = s.run_code(
                "import kxproject, os; (kxproject.WHERE, os.listdir(os.path.expanduser('~root')))"
            )
            assert found.ok, found.error
            home_view = eval(found.result or "()")[1]
        assert found.result is not None and "'the home'" in found.result
        assert project.name in home_view and len(home_view) <= 2  # the project (and the Python)
    finally:
        shutil.rmtree(project)
