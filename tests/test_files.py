"""``session.files`` on real kernels at every isolation level, ``setup_code`` and an isolated
kernel's ``PATH``. Hostile paths and planted links: ``tests/hostile/test_files_hostile.py``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._sandbox import _users
from tests.conftest import kernel_children, our_temp_dirs

LEVELS = [
    "none",
    "process",
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(
            shutil.which("bwrap") is None,
            reason="bubblewrap is not installed (apt-get install -y bubblewrap)",
        ),
    ),
]


@pytest.fixture(scope="module", params=LEVELS)
def executor(request: pytest.FixtureRequest) -> Iterator[kx.KernelExecutor]:
    """One executor per isolation level for this module (checked for leaks when it closes,
    as the shared one is); tests use distinct agent ids."""
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(isolation=request.param, default_timeout=60) as ex:
        yield ex
    assert not kernel_children() - before, "the executor left kernels running"
    assert not our_temp_dirs() - before_dirs, "the executor left temp dirs"


BINARY = bytes(range(256)) * 37 + b"\x00\xff\r\n"


def test_text_and_binary_round_trip_and_the_kernel_sees_them(
    executor: kx.KernelExecutor,
) -> None:
    s = executor.session("round-trip")
    # Before any run: the kernel has not entered the working directory yet.
    info = s.files.write("notes/hello.txt", "héllo wörld\n")
    assert (info.path, info.size, info.is_dir) == ("notes/hello.txt", 14, False)
    s.files.write("blob.bin", BINARY)
    assert s.files.read("notes/hello.txt") == "héllo wörld\n".encode()
    assert s.files.read("blob.bin") == BINARY
    seen = s.run_code(
        "import hashlib; print(open('notes/hello.txt', encoding='utf-8').read(), end='');"
        "print(hashlib.sha256(open('blob.bin', 'rb').read()).hexdigest())"
    )
    assert seen.stdout == "héllo wörld\n" + hashlib.sha256(BINARY).hexdigest() + "\n"
    s.run_code("open('made_by_code.txt', 'w').write('from the kernel')")
    assert s.files.read("made_by_code.txt") == b"from the kernel"
    s.files.write("empty", b"")
    assert s.files.read("empty") == b""


def test_files_are_the_kernels_own(executor: kx.KernelExecutor) -> None:
    """Written as the kernel's user, with the kernel's umask: the code can change them."""
    s = executor.session("owner")
    s.files.write("mine.txt", "x")
    out = s.run_code(
        "import os; st = os.stat('mine.txt'); open('mine.txt', 'a').write('y');"
        "print(st.st_uid == os.getuid())"
    )
    assert out.stdout == "True\n", out.error
    assert s.files.read("mine.txt") == b"xy"
    if executor.session("owner").isolation.level != "none" and _users.is_root():
        assert s.run_code("import os; os.getuid()").result != "0"


def test_listing_stat_mkdir_and_removal(executor: kx.KernelExecutor) -> None:
    s = executor.session("listing")
    s.files.write("b.txt", "bb")
    s.files.write("a/one.txt", "1")
    s.files.write("a/deeper/two.txt", "22")
    s.files.mkdir("empty-dir")
    top = s.files.list()
    assert [(f.path, f.is_dir) for f in top] == [
        ("a", True),
        ("b.txt", False),
        ("empty-dir", True),
    ]
    assert [(f.path, f.size) for f in s.files.list("a/deeper")] == [("a/deeper/two.txt", 2)]
    everything = [f.path for f in s.files.list(recursive=True)]
    assert everything == ["a", "a/deeper", "a/deeper/two.txt", "a/one.txt", "b.txt", "empty-dir"]
    assert s.files.stat("a/one.txt").size == 1
    assert s.files.exists("b.txt") and not s.files.exists("nope.txt")

    s.files.remove("b.txt")
    assert not s.files.exists("b.txt")
    s.files.remove("empty-dir")
    with pytest.raises(kx.SessionFileError) as full:
        s.files.remove("a")
    assert full.value.filename == "a"
    s.files.remove("a", recursive=True)
    assert s.files.list() == []
    assert s.run_code("import os; sorted(os.listdir('.'))").result == "[]"


def test_errors_are_typed_and_name_the_path(executor: kx.KernelExecutor) -> None:
    s = executor.session("errors")
    with pytest.raises(FileNotFoundError) as missing:
        s.files.read("missing/file.txt")
    assert isinstance(missing.value, kx.SessionFileError)
    assert missing.value.filename == "missing/file.txt"
    s.files.mkdir("adir")
    with pytest.raises(IsADirectoryError):
        s.files.read("adir")
    with pytest.raises(IsADirectoryError):
        s.files.write("adir", "x")
    with pytest.raises(FileNotFoundError):
        s.files.remove("gone")
    # The session still works after every refusal.
    assert s.run_code("1 + 1").result == "2"


def test_streams_never_need_the_whole_file(executor: kx.KernelExecutor) -> None:
    s = executor.session("streams")
    pieces = [os.urandom(3_000_000) for _ in range(3)]
    with s.files.open_write("streamed.bin") as w:
        for piece in pieces:
            w.write(piece)
    assert w.info is not None and w.info.size == 9_000_000
    got = []
    with s.files.open_read("streamed.bin") as r:
        assert r.size == 9_000_000
        for chunk in r:
            assert len(chunk) <= 4 << 20
            got.append(chunk)
    assert b"".join(got) == b"".join(pieces)
    # An upload that fails midway leaves nothing behind.
    with pytest.raises(RuntimeError, match="stop"), s.files.open_write("partial.bin") as w:
        w.write(os.urandom(5 << 20))
        raise RuntimeError("stop")
    assert [f.path for f in s.files.list()] == ["streamed.bin"]


def test_upload_and_download_between_host_files(
    executor: kx.KernelExecutor, tmp_path: Path
) -> None:
    s = executor.session("host-files")
    source = tmp_path / "in.bin"
    source.write_bytes(os.urandom(6_000_001))
    assert s.files.upload(source, "copy.bin").size == 6_000_001
    assert s.files.download("copy.bin", tmp_path / "out.bin") == 6_000_001
    assert (tmp_path / "out.bin").read_bytes() == source.read_bytes()


@pytest.mark.slow
def test_a_50_mib_file_round_trips_past_max_result_chars() -> None:
    data = os.urandom(50 << 20)
    with kx.KernelExecutor(max_result_chars=1_000) as ex:
        s = ex.session("big")
        assert s.files.write("big.bin", data).size == len(data)
        assert s.files.read("big.bin") == data
        digest = s.run_code(
            "import hashlib; hashlib.sha256(open('big.bin','rb').read()).hexdigest()"
        )
        assert digest.result == repr(hashlib.sha256(data).hexdigest())


@pytest.mark.anyio
async def test_the_async_api_and_its_order_with_runs() -> None:
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        s = await ex.session("async")
        await s.run_code("x = 1")
        # Calls queue in order: the write waits for the run before it, the read after it.
        run = asyncio.ensure_future(s.run_code("open('order.txt', 'w').write('run')"))
        write = asyncio.ensure_future(s.files.write("order.txt", "files"))
        await asyncio.gather(run, write)
        assert await s.files.read("order.txt") == b"files"
        async with s.files.open_read("order.txt") as r:
            assert [c async for c in r] == [b"files"]
        assert (await s.run_code("x")).result == "1"


def test_a_restart_reported_after_a_file_operation_started_the_new_kernel() -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        s = ex.session("restarted")
        assert s.run_code("kept = 1").ok
        s.restart()
        s.files.write("after.txt", "x")  # attaches the fresh kernel first
        result = s.run_code("'kept' in globals()")
        assert result.result == "False"
        assert result.kernel_restarted and result.lost_variables == ["kept"]


# -- setup_code -----------------------------------------------------------------------------


def test_setup_code_runs_in_every_fresh_kernel() -> None:
    with kx.KernelExecutor(isolation="none", setup_code="helper = 'exec'") as ex:
        s = ex.session("setup", setup_code="other = helper + '+session'")
        assert s.run_code("other").result == "'exec+session'"
        assert s.run_code("del helper, other").ok
        s.restart()
        after = s.run_code("other")
        assert after.result == "'exec+session'" and after.kernel_restarted
        died = s.run_code("import os; os._exit(1)")
        assert died.error is not None and died.error.kind == "kernel_died"
        assert s.run_code("helper").result == "'exec'"
        with pytest.raises(kx.ConfigError):
            ex.session("setup", setup_code="something else")
        assert ex.session("setup") is s


def test_failing_setup_code_is_a_clear_error_on_the_next_call() -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        s = ex.session("bad-setup", setup_code="import os\nif not os.path.exists('ready'): 1/0")
        first = s.run_code("print('never')")
        assert first.error is not None and first.error.kind == "setup_failed"
        assert first.error.ename == "ZeroDivisionError" and "setup_code" in first.error.evalue
        assert first.stdout == ""
        s.files.write("ready", "")
        assert s.run_code("'ran'").result == "'ran'"


@pytest.mark.parametrize(
    ("setup", "what", "timeout"),
    [
        ("import time; time.sleep(60)", "timed out", 2.0),
        # Ends at once: a long deadline, which a loaded host cannot pass before it runs.
        ("import os; os._exit(3)", "killed its kernel", 30.0),
    ],
)
def test_setup_code_that_never_finishes_is_a_setup_code_error(
    setup: str, what: str, timeout: float
) -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        s = ex.session("stuck-setup", setup_code=setup)
        result = s.run_code("print('never')", timeout=timeout)
        assert result.error is not None and result.error.kind == "setup_failed"
        assert result.error.ename == "SetupCodeError"
        assert result.error.evalue == f"the session's setup_code {what}; the call did not run"
        assert result.stdout == ""
        with pytest.raises(kx.ExecutionError, match="setup_failed: SetupCodeError: "):
            result.raise_for_error()
    assert issubclass(kx.SetupCodeError, kx.KernelExecError)
    assert issubclass(kx.SetupCodeError, RuntimeError)


# -- the kernel's PATH ---------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_python_in_a_subprocess_is_the_kernels_own_interpreter(level: str) -> None:
    with kx.KernelExecutor(isolation=level, env_vars={}) as ex:
        out = ex.session("path").run_code(
            "import subprocess, sys\n"
            "p = subprocess.run(['python', '-c', 'import sys; print(sys.executable)'],"
            " capture_output=True, text=True)\n"
            "print(p.stdout.strip() == sys.executable, p.returncode, p.stderr[-300:])"
        )
        assert out.stdout.startswith("True 0"), (out.stdout, out.error)


@pytest.mark.anyio
async def test_many_small_chunks_in_flight_arrive_whole_and_in_order() -> None:
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        s = await ex.session("chunks")
        s.files.chunk_size = 1000
        for size in (0, 999, 1000, 10_000, 10_501):
            data = os.urandom(size)
            assert (await s.files.write("c.bin", data)).size == size
            assert await s.files.read("c.bin") == data
            async with s.files.open_read("c.bin") as r:
                sizes = [len(c) async for c in r]
            assert sizes == [1000] * (size // 1000) + ([size % 1000] if size % 1000 else [])
            async with s.files.open_write("w.bin") as w:
                for start in range(0, size, 300):
                    await w.write(data[start : start + 300])
            assert w.info is not None and w.info.size == size
            same = await s.run_code("open('w.bin', 'rb').read() == open('c.bin', 'rb').read()")
            assert same.result == "True"
