"""``session.files`` against paths and links meant to escape the session's working directory.

The kernel's code is the attacker: it plants links and FIFOs, and the host must never read or
write anything outside the directory, nor anything the kernel's own user could not.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from tests.conftest import kernel_children, our_temp_dirs
from tests.hostile.conftest import HAVE_BWRAP, needs_root

LEVELS = [
    "none",
    "process",
    pytest.param("bwrap", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="no bubblewrap")),
]


@pytest.fixture(scope="module", params=LEVELS)
def executor(request: pytest.FixtureRequest) -> Iterator[kx.KernelExecutor]:
    """One executor per isolation level for this module (checked for leaks when it closes)."""
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(isolation=request.param, default_timeout=30) as ex:
        yield ex
    assert not kernel_children() - before, "the executor left kernels running"
    assert not our_temp_dirs() - before_dirs, "the executor left temp dirs"


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A directory outside every session, holding a private host file, reachable by name."""
    os.chmod(tmp_path, 0o755)  # searchable, so a kernel could name (not read) what is in it
    (tmp_path / "secret.txt").write_text("host secret")
    os.chmod(tmp_path / "secret.txt", 0o600)
    yield tmp_path


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../escape.txt", "'..'"),
        ("a/../../escape.txt", "'..'"),
        ("a\x00b", "NUL"),
    ],
)
def test_escaping_paths_are_refused_naming_the_path(
    executor: kx.KernelExecutor, path: str, why: str
) -> None:
    files = executor.session("syntax").files
    calls = [
        lambda: files.read(path),
        lambda: files.write(path, "x"),
        lambda: files.list(path),
        lambda: files.remove(path),
        lambda: files.stat(path),
        lambda: files.open_read(path),
    ]
    for call in calls:
        with pytest.raises(kx.PathRefusedError) as refused:
            call()
        assert isinstance(refused.value, ValueError)
        assert refused.value.path == path and repr(path) in str(refused.value)
        assert why in refused.value.reason


def plant(session: kx.Session, code: str) -> None:
    result = session.run_code(code)
    assert result.ok, result.error


def test_planted_links_to_a_host_file_are_refused(
    executor: kx.KernelExecutor, outside: Path
) -> None:
    s = executor.session("links-file")
    secret = outside / "secret.txt"
    plant(s, f"import os; os.symlink({str(secret)!r}, 'leak')")
    for call in (
        lambda: s.files.read("leak"),
        lambda: s.files.write("leak", "overwritten"),
        lambda: s.files.stat("leak"),
        lambda: s.files.list("leak"),
    ):
        with pytest.raises(kx.PathRefusedError, match="outside the working directory"):
            call()
    assert secret.read_text() == "host secret"
    # Removing the link removes the link, never its target.
    s.files.remove("leak")
    assert secret.read_text() == "host secret"
    assert s.files.list() == []


def test_planted_directory_links_and_dangling_links_are_refused(
    executor: kx.KernelExecutor, outside: Path
) -> None:
    s = executor.session("links-dir")
    target = outside / "not-yet"
    plant(
        s,
        f"import os; os.symlink({str(outside)!r}, 'out'); os.symlink({str(target)!r}, 'dangle');"
        "os.mkdir('sub'); os.symlink('../..', 'sub/up')",
    )
    for call in (
        lambda: s.files.read("out/secret.txt"),
        lambda: s.files.write("out/new.txt", "x"),
        lambda: s.files.write("dangle", "x"),
        lambda: s.files.list("out"),
        lambda: s.files.mkdir("out/made"),
        lambda: s.files.remove("out/secret.txt"),
        lambda: s.files.read("sub/up/secret.txt"),
        lambda: s.files.write("sub/up/x.txt", "x"),
    ):
        with pytest.raises(kx.PathRefusedError):
            call()
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "host secret"
    # A listing shows links as links, without following them.
    entries = {f.path: f for f in s.files.list(recursive=True)}
    assert entries["out"].is_symlink and not entries["out"].is_dir
    assert "out/secret.txt" not in entries


def test_a_link_inside_the_directory_is_followed(executor: kx.KernelExecutor) -> None:
    s = executor.session("links-inside")
    s.files.write("data/real.txt", "inside")
    plant(s, "import os; os.symlink('data/real.txt', 'alias'); os.symlink('data', 'd')")
    assert s.files.read("alias") == b"inside"
    assert s.files.read("d/real.txt") == b"inside"
    s.files.write("alias", "changed")
    assert s.files.read("data/real.txt") == b"changed"


def test_a_planted_fifo_is_refused_without_blocking(executor: kx.KernelExecutor) -> None:
    s = executor.session("fifo")
    plant(s, "import os; os.mkfifo('pipe')")
    # Opening it for reading would block the kernel's shell until the request timed out and
    # the kernel was replaced (FileTransferError); it is refused instead, and the kernel kept.
    with pytest.raises(kx.PathRefusedError, match="not a regular file"):
        s.files.read("pipe")
    assert s.run_code("import os; os.path.exists('pipe')").result == "True"
    assert s.run_code("'alive'").result == "'alive'"


@needs_root
def test_the_host_reads_with_the_kernels_rights_only() -> None:
    """A host file inside the session directory that the kernel's user may not read is not
    readable through ``session.files`` either (root on the host could read it)."""
    with kx.KernelExecutor(isolation="process") as ex:
        s = ex.session("rights")
        assert s.run_code("import os; os.getuid()").result != "0"
        private = Path(s.workdir) / "root-only.txt"
        private.write_text("root's")
        os.chown(private, 0, 0)
        os.chmod(private, 0o600)
        with pytest.raises(PermissionError) as denied:
            s.files.read("root-only.txt")
        assert isinstance(denied.value, kx.SessionFileError)
        written = s.files.write("kernel.txt", "x")
        assert written.size == 1
        st = os.stat(Path(s.workdir) / "kernel.txt")
        assert st.st_uid != 0 and stat.S_IMODE(st.st_mode) & 0o077 == 0
