"""Hostile: a directory lent to a kernel with a user of its own (Letta's ``sandbox_dir``, the
run's ``PYTHONPATH``) must not become a way out for the kernel, or into another's files.

The helper that mounts runs as root in the kernel's mount namespace and writes into the
kernel's session directory: each probe here plants what a tenant could before or while it
works (links on the way, a moved layer folder, setuid files, devices) and checks that nothing
outside the kernel's own view changed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from kernelexec._core._session import AsyncSession
from kernelexec._sandbox import _disk
from kernelexec._tempdirs import make_owned_dir
from tests.hostile.conftest import needs_bwrap, needs_root

pytestmark = [
    pytest.mark.anyio,
    needs_root,
    pytest.mark.skipif(
        _disk.support() is not None, reason=f"no mount namespaces here: {_disk.support()}"
    ),
]


@pytest.fixture
def target() -> Iterator[Path]:
    """A root-owned directory outside every kernel's reach that must stay empty."""
    path = Path(tempfile.mkdtemp(prefix="kxlend-target-", dir="/run"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def lent() -> Iterator[Path]:
    """A host directory only root may enter (under the host's /tmp, which kernels do not see),
    holding a file only root may read."""
    path = Path(tempfile.mkdtemp(prefix="kxlend-"))
    (path / "secret.txt").write_text("s3cret")
    (path / "secret.txt").chmod(0o600)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def public() -> Iterator[Path]:
    """A host directory any local user may reach, outside /tmp, holding a file only root may
    read and one anyone may."""
    path = Path(tempfile.mkdtemp(prefix="kxlend-pub-", dir="/run"))
    path.chmod(0o755)
    (path / "secret.txt").write_text("s3cret")
    (path / "secret.txt").chmod(0o600)
    (path / "public.py").write_text("X = 1\n")
    (path / "public.py").chmod(0o644)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
async def executor() -> AsyncIterator[kx.AsyncKernelExecutor]:
    async with kx.AsyncKernelExecutor(isolation="process") as ex:
        yield ex


async def run(session: AsyncSession, code: str) -> str:
    result = await session.run_code(code)
    assert result.ok, result.error
    return result.result or ""


async def test_a_link_planted_as_the_layer_folder_is_not_followed(
    executor: kx.AsyncKernelExecutor, lent: Path, target: Path
) -> None:
    session = await executor.session("plant-before")
    # The session's directory is the kernel's: it plants the folder the layers will go to.
    await run(session, f"import os; os.symlink({str(target)!r}, '.kx-lent')")
    with pytest.raises(kx.KernelStartError, match="could not lend"):
        await session.lease.lend(str(lent), mode="own")
    assert await asyncio.to_thread(os.listdir, target) == []
    assert (await run(session, f"os.path.exists({str(lent)!r})")) == "False"


async def test_a_layer_folder_moved_away_while_lent_still_takes_the_changes(
    executor: kx.AsyncKernelExecutor, lent: Path, target: Path
) -> None:
    session = await executor.session("plant-after")
    await session.lease.lend(str(lent), mode="own")
    code = (
        "import os\n"
        "os.rename('.kx-lent', 'moved'); os.symlink({!r}, '.kx-lent')\n"
        "open({!r}, 'w').write('new')\n"
        "(open({!r}).read(), sorted(os.listdir({!r})))"
    ).format(str(target), str(lent / "new.txt"), str(lent / "new.txt"), str(lent))
    assert await run(session, code) == "('new', ['new.txt', 'secret.txt'])"
    assert await asyncio.to_thread(os.listdir, target) == []
    assert sorted(await asyncio.to_thread(os.listdir, lent)) == ["secret.txt"]


async def test_a_link_on_the_way_in_the_kernels_view_is_not_followed(
    executor: kx.AsyncKernelExecutor, target: Path
) -> None:
    outer = Path(tempfile.mkdtemp(prefix="kxlend-way-", dir="/tmp"))  # the kernel has its own
    try:
        (outer / "inner").mkdir()
        session = await executor.session("way")
        # In its private /tmp the kernel makes the same name a link to a host directory.
        await run(session, f"import os; os.symlink({str(target)!r}, {str(outer)!r})")
        with pytest.raises(kx.KernelStartError, match="not a directory in the kernel's view"):
            await session.lease.lend(str(outer / "inner"), mode="own")
        assert await asyncio.to_thread(os.listdir, target) == []
        assert (await run(session, f"os.path.exists({str(target / 'inner')!r})")) == "False"
    finally:
        shutil.rmtree(outer)


async def test_what_a_tenant_makes_in_a_lent_directory_is_its_own_never_the_hosts(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("suid")
    await session.lease.lend(str(lent), mode="own")
    code = (
        "import os, shutil, stat\n"
        f"os.chdir({str(lent)!r})\n"
        "shutil.copy('/bin/true', 'escalate'); os.chmod('escalate', 0o4755)\n"
        "try:\n"
        "    os.mknod('disk', stat.S_IFBLK | 0o666, os.makedev(8, 0)); dev = 'made'\n"
        "except OSError as exc:\n"
        "    dev = exc.errno\n"
        "opts = [f[5] for f in map(str.split, open('/proc/self/mountinfo'))"
        f" if f[4] == {str(lent)!r}]\n"
        "(os.stat('escalate').st_uid == os.getuid(), open('secret.txt').read(), dev, opts)"
    )
    own, secret, dev, opts = eval(await run(session, code))
    assert own is True and secret == "s3cret"  # the directory is as if its own
    assert dev == 1  # EPERM: no devices
    assert "nosuid" in opts[-1] and "nodev" in opts[-1]
    # On the host: nothing new in the directory, and the copy in the layers is the kernel's.
    assert sorted(await asyncio.to_thread(os.listdir, lent)) == ["secret.txt"]
    copies = await asyncio.to_thread(
        lambda: list(Path(session.workdir, ".kx-lent").glob("*/upper/escalate"))
    )
    assert len(copies) == 1
    st = await asyncio.to_thread(copies[0].stat)
    assert st.st_uid >= 2_000_000_000


ATTEMPT = (
    "import errno, os\n"
    "def attempt(f):\n"
    "    try:\n"
    "        return f()\n"
    "    except OSError as exc:\n"
    "        return errno.errorcode[exc.errno]\n"
)


async def test_a_read_only_loan_keeps_owners_and_refuses_writes(
    executor: kx.AsyncKernelExecutor, public: Path
) -> None:
    session = await executor.session("ro")
    await session.lease.lend(str(public), mode="read")
    code = ATTEMPT + (
        f"(attempt(lambda: open({str(public / 'public.py')!r}).read()),"
        f" attempt(lambda: open({str(public / 'secret.txt')!r}).read()),"
        f" attempt(lambda: open({str(public / 'new.txt')!r}, 'w')))"
    )
    assert await run(session, code) == "('X = 1\\n', 'EACCES', 'EROFS')"


async def test_a_copy_loan_keeps_owners_and_writes_only_to_the_sessions_layer(
    executor: kx.AsyncKernelExecutor, public: Path
) -> None:
    session = await executor.session("copy")
    await session.lease.lend(str(public), mode="copy")
    code = ATTEMPT + (
        f"(attempt(lambda: open({str(public / 'public.py')!r}).read()),"
        f" attempt(lambda: open({str(public / 'secret.txt')!r}).read()),"
        f" attempt(lambda: open({str(public / 'public.py')!r}, 'a').write('Y = 2')),"
        f" attempt(lambda: open({str(public / 'new.txt')!r}, 'w').write('new')))"
    )
    assert await run(session, code) == "('X = 1\\n', 'EACCES', 'EACCES', 3)"
    assert sorted(await asyncio.to_thread(os.listdir, public)) == ["public.py", "secret.txt"]


async def test_only_a_directory_any_user_may_reach_is_lent_other_than_as_the_kernels_own(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("reach")
    for mode in ("copy", "read"):
        with pytest.raises(kx.ConfigError, match="keeps other users out"):
            await session.lease.lend(str(lent), mode=mode)  # type: ignore[arg-type]


async def test_the_layer_folder_stays_the_hosts_across_restarts(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("layers")
    await session.lease.lend(str(lent), mode="own")
    await run(session, f"open({str(lent / 'mine.txt')!r}, 'w').write('mine')")
    await session.restart()
    # The new kernel (another uid) still owns what it wrote, through the mount only.
    code = ATTEMPT + (
        f"(open({str(lent / 'mine.txt')!r}).read(),"
        f" os.stat({str(lent / 'mine.txt')!r}).st_uid == os.getuid(),"
        " attempt(lambda: os.listdir('.kx-lent')),"
        " os.stat('.kx-lent').st_uid)"
    )
    assert await run(session, code) == "('mine', True, 'EACCES', 0)"


async def test_a_layer_folder_the_kernel_made_is_refused(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("made")
    await run(session, "import os; os.makedirs('.kx-lent', mode=0o700)")
    with pytest.raises(kx.KernelStartError, match="not the host's alone"):
        await session.lease.lend(str(lent), mode="own")
    # Only this session's loan failed; the kernel works on, and the next attempt says why.
    assert await run(session, "1 + 1") == "2"
    with pytest.raises(kx.KernelStartError, match="not the host's alone"):
        await session.lease.lend(str(lent), mode="own")


async def test_a_loan_never_hides_another(executor: kx.AsyncKernelExecutor, lent: Path) -> None:
    (lent / "inner").mkdir()
    session = await executor.session("nested")
    await session.lease.lend(str(lent / "inner"), mode="own")
    await session.lease.lend(str(lent), mode="own")  # holds the first: left as it is
    code = ATTEMPT + (
        f"(attempt(lambda: open({str(lent / 'inner' / 'w.txt')!r}, 'w').write('w')),"
        f" os.path.exists({str(lent / 'secret.txt')!r}))"
    )
    assert await run(session, code) == "(1, False)"


async def test_other_sessions_do_not_see_a_directory_lent_to_one(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    mine = await executor.session("owner")
    other = await executor.session("other")
    await mine.lease.lend(str(lent), mode="own")
    assert await run(mine, f"import os; os.path.isdir({str(lent)!r})") == "True"
    assert await run(other, f"import os; os.path.exists({str(lent)!r})") == "False"
    # A fresh kernel of the session gets it again.
    await mine.restart()
    assert await run(mine, f"import os; open({str(lent / 'secret.txt')!r}).read()") == "'s3cret'"


async def test_the_executors_own_directories_and_the_temp_root_are_never_lent(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with kx.AsyncKernelExecutor(isolation="process", state_dir=state) as ex:
        session = await ex.session("refused")
        kdir = make_owned_dir("kx-")  # a kernel's own directory: kernelexec's marker in it
        try:
            for path, why in [
                ("/", "holds"),
                (tempfile.gettempdir(), "holds"),
                (kdir, "lies in a directory of kernelexec's"),
                (str(state), "overlaps"),
                (str(Path(session.workdir).parent), "overlaps|lies in"),
                (session.workdir, "overlaps|lies in"),
                (str(tmp_path / f"missing-{uuid.uuid4().hex}"), "not a directory"),
            ]:
                with pytest.raises(kx.ConfigError, match=why):
                    await session.lease.lend(path, mode="own")
        finally:
            shutil.rmtree(kdir)


@pytest.fixture
def named_like_ours() -> Iterator[tuple[Path, Path]]:
    """A user's ``kx-work`` under the temp dir holding a file, and a ``kx-linked`` whose
    ``.owner`` is a link to the marker of a real kernelexec directory."""
    work = Path(tempfile.gettempdir(), "kx-work")
    work.mkdir()
    (work / "data.txt").write_text("mine")
    real = Path(make_owned_dir("kx-"))
    linked = Path(tempfile.gettempdir(), "kx-linked")
    linked.mkdir()
    (linked / ".owner").symlink_to(real / ".owner")
    try:
        yield work, linked
    finally:
        for path in (work, real, linked):
            shutil.rmtree(path)


async def test_a_users_directory_named_like_kernelexecs_is_lent(
    executor: kx.AsyncKernelExecutor, named_like_ours: tuple[Path, Path]
) -> None:
    """Issue 36: any ``kx-*`` directory under the temp dir was refused as kernelexec's; only
    kernelexec's marker (a plain ``.owner`` file, not a link) makes it so."""
    work, linked = named_like_ours
    session = await executor.session("user-dir")
    assert await session.lease.lend(work, mode="own") == str(work)
    assert await run(session, f"open({str(work / 'data.txt')!r}).read()") == "'mine'"
    # A link planted as the marker, to a real marker, does not make it kernelexec's either.
    assert await session.lease.lend(linked, mode="own") == str(linked)


async def test_a_directory_lent_while_the_kernel_is_dead_reaches_the_one_replacing_it(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("dead")
    await run(session, "x = 1")
    conn = session.lease.connection
    assert conn is not None
    pid = conn.kernel_pid()
    assert pid is not None
    victim = psutil.Process(pid)
    victim.kill()
    await asyncio.to_thread(victim.wait)
    await session.lease.lend(str(lent), mode="own")  # no error: nothing to lend to yet
    first = await session.run_code(f"open({str(lent / 'secret.txt')!r}).read()")
    if first.error is not None:  # the run that found the kernel dead
        assert first.error.kind == "kernel_died", first.error
        first = await session.run_code(f"open({str(lent / 'secret.txt')!r}).read()")
    assert first.result == "'s3cret'", first.error


async def test_a_directory_under_one_the_kernel_cannot_pass_through_shows_only_the_way(
    executor: kx.AsyncKernelExecutor,
) -> None:
    parent = Path(tempfile.mkdtemp(prefix="kxlend-home-", dir="/run"))  # 0700, like /root
    try:
        (parent / "sibling-secret.txt").write_text("hidden")
        inner = parent / "a" / "inner"
        inner.mkdir(parents=True)
        (inner / "file.txt").write_text("lent")
        session = await executor.session("bridged")
        before = await run(session, f"import os; os.access({str(parent)!r}, os.X_OK)")
        assert before == "False"
        await session.lease.lend(str(inner), mode="own")
        code = (
            "import errno, os\n"
            "def attempt(f):\n"
            "    try:\n"
            "        return f()\n"
            "    except OSError as exc:\n"
            "        return errno.errorcode[exc.errno]\n"
            f"(open({str(inner / 'file.txt')!r}).read(), sorted(os.listdir({str(parent)!r})),"
            f" attempt(lambda: open({str(parent / 'planted')!r}, 'w')),"
            f" [f[5] for f in map(str.split, open('/proc/self/mountinfo'))"
            f" if f[4] == {str(parent)!r}])"
        )
        text, listing, planted, opts = eval(await run(session, code))
        assert (text, listing) == ("lent", ["a"])  # the way to it, nothing else
        assert planted in ("EROFS", "EACCES")
        assert opts and opts[-1].split(",")[0] == "ro"
        assert sorted(await asyncio.to_thread(os.listdir, parent)) == ["a", "sibling-secret.txt"]
    finally:
        shutil.rmtree(parent)


async def test_a_session_with_a_loan_can_be_branched(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("family")
    await session.lease.lend(str(lent), mode="own")
    # A removed file leaves overlayfs's whiteout (a 0:0 device) in the session's layers.
    await run(session, f"import os; os.remove({str(lent / 'secret.txt')!r}); x = 7")
    (child,) = await session.fork()
    assert await run(child, "x") == "7"
    # A branch lives in its family's mount namespace: it sees the loan as its parent does.
    assert await run(child, f"os.path.exists({str(lent / 'secret.txt')!r})") == "False"
    assert sorted(await asyncio.to_thread(os.listdir, lent)) == ["secret.txt"]


async def test_a_loan_that_fails_for_a_fresh_kernel_is_dropped_and_the_kernel_works(
    executor: kx.AsyncKernelExecutor, lent: Path
) -> None:
    session = await executor.session("dropped")
    await session.lease.lend(str(lent), mode="own")
    # The kernel swaps the host's layer folder for a link to one of its own.
    await run(session, "import os; os.rename('.kx-lent', 'gone'); os.symlink('gone', '.kx-lent')")
    await session.restart()
    assert await run(session, f"import os; os.path.exists({str(lent)!r})") == "False"
    with pytest.raises(kx.KernelStartError, match=r"could not lend.*kx-lent"):
        await session.lease.lend(str(lent), mode="own")


@needs_bwrap
async def test_a_loan_reaches_a_kernel_in_bubblewrap_too(lent: Path) -> None:
    async with kx.AsyncKernelExecutor(isolation="bwrap") as ex:
        session = await ex.session("bwrap")
        await session.lease.lend(str(lent), mode="own")
        code = f"import os; (open({str(lent / 'secret.txt')!r}).read(), os.getuid() != 0)"
        assert await run(session, code) == "('s3cret', True)"
        await run(session, f"open({str(lent / 'new.txt')!r}, 'w').write('n')")
    assert sorted(await asyncio.to_thread(os.listdir, lent)) == ["secret.txt"]
