"""Hostile: a tenant changes its own tree while the host (root) copies, archives, hands over or
removes it: links planted where the host writes, files and directories swapped for links to
root-only files while the host reads, trees too deep or too wide to walk, sparse files, names
that are not UTF-8.

The rule under test (``docs/security.md``, "Tenant data"; :mod:`kernelexec._trees`): the host
touches a tenant's tree only through directory descriptors, one name at a time, never following
a link, iteratively and within bounds. Each race below runs long enough that it won on the code
before the rule (a path-based ``shutil.copytree``, ``os.walk`` and ``open``).
"""

from __future__ import annotations

import os
import resource
import tarfile
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from kernelexec import _trees
from kernelexec._durable._store import agent_key
from tests.hostile.conftest import needs_bwrap, needs_root

pytestmark = [pytest.mark.slow, needs_root]

SECRET = "root-only secret 7f3a"

LEVELS = ["process", pytest.param("bwrap", marks=needs_bwrap)]

# Planted in the tenant's directory while the host writes there: "d" becomes a link to the
# host's root-only vault whenever it is not one.
PLANT = r"""
import os, shutil, threading
def _plant(vault):
    while True:
        try:
            if not os.path.islink('d'):
                if os.path.isdir('d'):
                    shutil.rmtree('d', ignore_errors=True)
                os.symlink(vault, 'd')
        except OSError:
            pass
threading.Thread(target=_plant, args=(VAULT,), daemon=True).start()
"""

# Swapped while the host reads: each file of "many" turns into a link to the root-only secret
# and back, and the directory "a" into a link to the vault and back.
SWAP = r"""
import os, shutil, threading, time
for p in ('a', 'a.real', 'many'):
    if os.path.islink(p):
        os.unlink(p)
    shutil.rmtree(p, ignore_errors=True)
os.makedirs('many')
os.makedirs('a')
for i in range(200):
    open(f'many/f{i}', 'w').write('mine')
    open(f'a/f{i}', 'w').write('mine')
def _swap(secret, vault):
    n = 0
    while True:
        n += 1
        i = n % 200
        try:
            os.symlink(secret, f'many/.l{i}')
            os.replace(f'many/.l{i}', f'many/f{i}')
            open(f'many/.r{i}', 'w').write('mine')
            os.replace(f'many/.r{i}', f'many/f{i}')
        except OSError:
            pass
def _swap_dir(vault):
    while True:
        try:
            os.rename('a', 'a.real')
            os.symlink(vault, 'a')
            time.sleep(0.002)
            os.unlink('a')
            os.rename('a.real', 'a')
            time.sleep(0.002)
        except OSError:
            pass
threading.Thread(target=_swap, args=(SECRET, VAULT), daemon=True).start()
threading.Thread(target=_swap_dir, args=(VAULT,), daemon=True).start()
"""


def _vault(tmp_path: Path) -> tuple[Path, Path]:
    """A root-only directory holding a root-only file."""
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "f7"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    return vault, secret


def _holds_secret(top: Path) -> list[str]:
    """Files under ``top`` (walked by the test, as root) whose content is the secret."""
    found = []
    for root, _, files in os.walk(top):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                if SECRET.encode() in f.read(1 << 20):
                    found.append(path)
    return found


def test_restore_never_writes_through_a_link_the_tenant_plants(tmp_path: Path) -> None:
    vault, _ = _vault(tmp_path)
    with kx.KernelExecutor() as ex:
        s = ex.session("planter")
        # Many files, then "d": the host removes "d" first and the rest after, a long window.
        s.run_code(
            "import os\nfor i in range(2000):\n    open(f'n{i}', 'w').close()\n"
            "os.makedirs('d')\nopen('d/dropped.txt', 'w').write('tenant')"
        ).raise_for_error()
        snap = s.snapshot()
        try:
            for _ in range(6):
                s.run_code(PLANT.replace("VAULT", repr(str(vault)))).raise_for_error()
                s.restore(snap)
            # The restored session is whole: its files are the snapshot's.
            assert s.run_code("print(open('d/dropped.txt').read())").stdout in ("tenant\n", "")
        finally:
            snap.close()
    assert sorted(p.name for p in vault.iterdir()) == ["f7"]  # nothing written as root there


def test_snapshot_and_fork_never_read_a_file_swapped_for_a_link(tmp_path: Path) -> None:
    vault, secret = _vault(tmp_path)
    code = SWAP.replace("SECRET", repr(str(secret))).replace("VAULT", repr(str(vault)))
    with kx.KernelExecutor(max_kernels=8) as ex:
        s = ex.session("swapper")
        s.run_code(code).raise_for_error()
        for _ in range(4):
            snap = s.snapshot()
            try:
                files = snap.inner.files  # where the snapshot keeps its copy of the files
                assert files is not None and _holds_secret(Path(files)) == []
            finally:
                snap.close()
            children = s.fork(1)
            try:
                assert _holds_secret(Path(children[0].workdir)) == []
            finally:
                for child in children:
                    child.close()


@pytest.mark.parametrize("level", LEVELS)
def test_hibernate_never_archives_a_file_reached_through_a_swapped_directory(
    tmp_path: Path, level: str
) -> None:
    vault, secret = _vault(tmp_path)
    state = tmp_path / "state"
    code = SWAP.replace("SECRET", repr(str(secret))).replace("VAULT", repr(str(vault)))
    with kx.KernelExecutor(state_dir=state, isolation=level) as ex:  # type: ignore[arg-type]
        s = ex.session("archiver")
        for n in range(6):  # a hibernated kernel ends: each wake gets the swapping again
            s.run_code(f"x = {n}\n" + code).raise_for_error()
            s.hibernate()
    where = state / "agents" / agent_key("archiver", "")
    archives = [p for p in where.iterdir() if p.suffix == ".tar"]
    assert archives, sorted(p.name for p in where.iterdir())
    for path in archives:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile():
                    data = tar.extractfile(member)
                    assert data is not None and SECRET.encode() not in data.read()


DEEP = r"""
import os
top = os.open('.', os.O_RDONLY)
here = os.dup(top)
for _ in range(DEPTH):
    os.mkdir('d', dir_fd=here)
    below = os.open('d', os.O_RDONLY, dir_fd=here)
    os.close(here)
    here = below
os.close(here)
open('keep.txt', 'w').write('kept')
"""


@pytest.mark.parametrize("level", LEVELS)
def test_a_tree_too_deep_to_walk_breaks_nothing(tmp_path: Path, level: str) -> None:
    with kx.KernelExecutor(isolation=level, workdir=tmp_path / "w") as ex:  # type: ignore[arg-type]
        s = ex.session("deep")
        s.run_code(DEEP.replace("DEPTH", "1200")).raise_for_error()
        s.restart()
        assert s.run_code("print(open('keep.txt').read())").stdout == "kept\n"
        s.run_code("x = 1").raise_for_error()
        workdir = Path(s.workdir)
    assert (workdir / "keep.txt").read_text() == "kept"  # back on the disk
    # A later host process's first session is not held up by what this one left.
    with kx.KernelExecutor(isolation=level) as ex:  # type: ignore[arg-type]
        assert ex.session("next").run_code("print(2)").stdout == "2\n"


@pytest.mark.parametrize("level", LEVELS)
def test_a_tree_too_deep_to_walk_is_hibernated_without_its_depths(
    tmp_path: Path, level: str
) -> None:
    with kx.KernelExecutor(state_dir=tmp_path / "state", isolation=level) as ex:  # type: ignore[arg-type]
        s = ex.session("deep-state")
        s.run_code(DEEP.replace("DEPTH", "1200") + "x = 1\n").raise_for_error()
        saved = s.hibernate()  # the part past the walk's depth is left out, nothing raised
        assert "x" in saved.saved
        assert s.run_code("print(x, open('keep.txt').read())").stdout == "1 kept\n"
        s.restart()
        s.run_code("y = 2").raise_for_error()
    # closing the executor hibernated it again, without an error


@pytest.mark.parametrize("level", LEVELS)
def test_a_very_wide_tree_is_copied_back_and_unmounted(tmp_path: Path, level: str) -> None:
    with kx.KernelExecutor(isolation=level, workdir=tmp_path / "w") as ex:  # type: ignore[arg-type]
        s = ex.session("wide")
        s.run_code(
            "import os\nfor i in range(25000):\n    os.mkdir(f'w{i}')\n"
            "open('keep.txt', 'w').write('kept')"
        ).raise_for_error()
        s.restart()
        r = s.run_code("import os\nprint(open('keep.txt').read(), len(os.listdir('.')))")
        assert r.stdout == "kept 25001\n"
        workdir = Path(s.workdir)
    # On the disk, not in a tmpfs left mounted (the autouse leak check also looks for one).
    assert (workdir / "keep.txt").read_text() == "kept"
    assert len(os.listdir(workdir)) == 25001


def _written() -> int:
    """Bytes this process has handed to write calls so far."""
    return int(psutil.Process().io_counters().write_chars)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("level", LEVELS)
def test_a_sparse_file_is_refused_by_the_checkpoint_bound_unread(
    tmp_path: Path, level: str
) -> None:
    with kx.KernelExecutor(
        state_dir=tmp_path / "state",
        isolation=level,  # type: ignore[arg-type]
        max_checkpoint_bytes=64 << 20,
    ) as ex:
        s = ex.session("sparse")
        s.run_code("f = open('big', 'wb')\nf.truncate(2 << 30)\nf.close()\nx = 1")
        before = _peak_mb()
        with pytest.raises(kx.CheckpointTooLargeError, match="max_checkpoint_bytes=67108864"):
            s.hibernate()
        assert _peak_mb() - before < 256  # the 2 GiB were never read
        assert s.run_code("print(x)").stdout == "1\n"


_FORGE = (
    "import os, sys\n"
    "st = sys.modules['__kernelexec_state__']\n"
    "staging = os.path.join(os.getcwd(), st.STAGING)\n"
    "def forged(*a, **k):\n"
    "    os.makedirs(staging, exist_ok=True)\n"
    "    with open(os.path.join(staging, NAME), 'wb') as f:\n"
    "        f.truncate(2 << 30)\n"
    "    return st._Answer({'gen': 1, 'records': [{'kind': 'raw', 'names': ['big'],\n"
    "        'file': NAME, 'size': SIZE, 'crc': 0}], 'unsaved': {}, 'environ': {}})\n"
    "st.save = forged\n"
)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("size", [-1, -(2 << 30), 2 << 30, "'2147483648'"])
def test_a_forged_record_size_never_makes_the_host_write_past_the_bound(
    tmp_path: Path, size: int | str, level: str
) -> None:
    state = tmp_path / "state"
    with kx.KernelExecutor(
        state_dir=state,
        max_checkpoint_bytes=64 << 20,
        isolation=level,  # type: ignore[arg-type]
    ) as ex:
        s = ex.session("forger")
        s.run_code("x = 1").raise_for_error()
        s.hibernate()  # installs the kernel side of durable state
        name = "r" + "c" * 24 + ".rec"
        code = _FORGE.replace("NAME", repr(name)).replace("SIZE", str(size))
        s.run_code(code).raise_for_error()
        before = _written()
        with pytest.raises(kx.StateError):
            s.hibernate()
        allocated = sum(p.stat().st_blocks * 512 for p in state.rglob("*") if p.is_file())
        assert allocated < 64 << 20
        assert _written() - before < 64 << 20  # not even for a moment
        assert s.run_code("print(x)").stdout == "1\n"


@pytest.mark.parametrize("level", LEVELS)
def test_a_name_that_is_not_utf8_is_listed_and_the_kernel_kept(level: str) -> None:
    with kx.KernelExecutor(isolation=level) as ex:  # type: ignore[arg-type]
        s = ex.session("names")
        s.run_code("open(b'bad\\xff.txt', 'w').write('x')\nkept = 41").raise_for_error()
        entries = s.files.list()
        assert [e.path for e in entries] == ["bad\\xff.txt"]
        assert s.run_code("print(kept)").stdout == "41\n"  # the same kernel answered


@pytest.mark.parametrize("level", LEVELS)
def test_reading_a_sparse_file_whole_is_bounded(level: str) -> None:
    with kx.KernelExecutor(isolation=level) as ex:  # type: ignore[arg-type]
        s = ex.session("reader")
        s.run_code("f = open('big', 'wb')\nf.truncate(1 << 30)\nf.close()").raise_for_error()
        before = _peak_mb()
        with pytest.raises(kx.TreeLimitError) as caught:
            s.files.read("big")
        assert caught.value.bound == "bytes" and caught.value.limit == 64 << 20
        assert _peak_mb() - before < 256
        s.run_code("open('small', 'wb').write(b'y' * 100)").raise_for_error()
        assert s.files.read("small", max_bytes=100) == b"y" * 100


def test_entries_are_bounded_where_the_tenant_makes_them(tmp_path: Path) -> None:
    with kx.KernelExecutor(limits=kx.Limits(max_disk_mb=16)) as ex:
        s = ex.session("many")
        r = s.run_code(
            "import os\nmade = 0\ntry:\n    for i in range(200000):\n"
            "        open(f'f{i}', 'w').close()\n        made += 1\n"
            "except OSError as exc:\n    print(exc.errno)\nprint(made)"
        )
        errno_text, made_text = r.stdout.split()
        made = int(made_text)
        assert errno_text == "28" and made < _trees.MAX_ENTRIES  # ENOSPC at the inode cap
        s.restart()
        assert s.run_code("import os\nprint(len(os.listdir('.')))").stdout == f"{made}\n"
