"""Shared fixtures: real executors that tear down what they start, and a leak check."""

from __future__ import annotations

import os
import select
import shutil
import signal
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from tests.support import procs
from tests.support.gateway import Gateway
from tests.support.skips import Guard

_TEMP_ROOT: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Give each test process its own temp root, so leak checks see only their own dirs."""
    global _TEMP_ROOT
    _TEMP_ROOT = tempfile.mkdtemp(prefix="kxtest-")
    tempfile.tempdir = _TEMP_ROOT
    # No test may build venvs in the user's cache: by default they go under the temp root.
    os.environ["KERNELEXEC_CACHE_DIR"] = os.path.join(_TEMP_ROOT, "cache")
    # Nor register attachable sessions in the user's runtime directory.
    os.environ["KERNELEXEC_RUNTIME_DIR"] = os.path.join(_TEMP_ROOT, "runtime")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _TEMP_ROOT is not None:
        shutil.rmtree(_TEMP_ROOT, ignore_errors=True)


_SKIPS = Guard()
"""The run's skips (``tests/support/skips.py``): counted and checked where the run is reported,
on the xdist controller (an xdist worker has ``workerinput``)."""


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _SKIPS.note(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SKIPS.note(report)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report ends with the logs of the gateways running then: a gateway's
    log goes with its directory when its fixture ends, and a start that failed under load
    said only that it took too long."""
    report = yield
    if report.failed:
        for gw in sorted(Gateway.running, key=lambda g: g.port):
            report.sections.append((f"gateway {gw.url}: the end of its log", gw.log[-4000:]))
    return report


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        _SKIPS.finish(session)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not hasattr(terminalreporter.config, "workerinput"):
        _SKIPS.report(terminalreporter)


def kernel_children() -> set[int]:
    """Pids of the kernels this test process started: kernels whose parent is this process,
    or kernelexec's launcher (isolation "process"/"bwrap") whose child the kernel is; a
    launcher without its kernel counts itself; so do kernels forked by a fork server (see
    :func:`forked_kernels`). Processes are told apart by their titles
    (``tests.support.procs.kind``)."""
    found = set()
    for child in psutil.Process().children():
        try:
            what = procs.kind(child)
            if what == "fork server":
                found |= forked_kernels(child)
            elif what == "launcher":
                kernels = {k.pid for k in child.children()}
                found |= kernels or {child.pid}
            elif what == "kernel":
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


FORK_SERVER = procs.FORK_SERVER


def forked_kernels(server: psutil.Process) -> set[int]:
    """The kernels under a fork server: its children, or, for a child that is a launcher, the
    launcher's first child (a launcher without its kernel counts itself). A child not titled
    yet still shows the server's title: a launcher is then told by being single-threaded."""
    found = set()
    for child in server.children():
        try:
            what = procs.kind(child)
            if what == "kernel" or (what != "launcher" and child.num_threads() > 1):
                found.add(child.pid)
                continue
            with open(f"/proc/{child.pid}/task/{child.pid}/children") as fh:
                kids = fh.read().split()
            found.add(int(kids[0]) if kids else child.pid)
        except (psutil.Error, OSError):
            continue
    return found


def fork_servers() -> set[int]:
    """Pids of the fork servers this test process started."""
    return procs.of_kind(os.getpid(), "fork server")


def our_temp_dirs() -> set[str]:
    tmp = Path(tempfile.gettempdir())
    return {p.name for p in tmp.iterdir() if p.name.startswith(("kx-", "kernelexec-"))}


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves kernel processes or kernelexec temp dirs behind.

    Tests on the shared module executor are checked when that executor closes instead.
    """
    if "executor" in request.fixturenames:
        yield
        return
    before_dirs = our_temp_dirs()
    before = kernel_children()
    before_servers = fork_servers()
    before_mounts = set(our_mounts())
    yield
    leaked = kernel_children() - before
    assert not leaked, f"kernel processes left running: {leaked}"
    servers = fork_servers() - before_servers
    assert not servers, f"fork servers left running: {servers}"
    new_dirs = our_temp_dirs() - before_dirs
    assert not new_dirs, f"temporary directories left behind: {new_dirs}"
    mounts = set(our_mounts()) - before_mounts
    assert not mounts, f"capped directories left mounted: {mounts}"


@pytest.fixture
def ctrl_c_default() -> Iterator[None]:
    """Programs the test starts get SIGINT at its default, as a terminal's shell starts them:
    a test run as a background job of a non-interactive shell (a CI script's ``make test &``)
    ignores SIGINT, which its children would inherit, and Python then never raises
    ``KeyboardInterrupt``. A handler set here is reset to the default by ``exec``."""
    old = signal.getsignal(signal.SIGINT)
    if old == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if old == signal.SIG_IGN:
            signal.signal(signal.SIGINT, old)


def our_mounts() -> dict[str, str]:
    """This process's capped-directory mounts (``kernelexec._sandbox._disk``)."""
    from kernelexec._sandbox import _disk

    mine = f"kx-work:{os.getpid()}:"
    return {path: src for path, src in _disk.mounts().items() if src.startswith(mine)}


@pytest.fixture(scope="module")
def executor() -> Iterator[kx.KernelExecutor]:
    """One executor per test module; tests use distinct agent ids."""
    before, before_dirs = kernel_children(), our_temp_dirs()
    before_servers, before_mounts = fork_servers(), set(our_mounts())
    with kx.KernelExecutor(default_timeout=30, max_kernels=8) as ex:
        yield ex
    assert not kernel_children() - before, "the shared executor left kernels running"
    assert not fork_servers() - before_servers, "the shared executor left fork servers running"
    assert not our_temp_dirs() - before_dirs, "the shared executor left temp dirs"
    assert not set(our_mounts()) - before_mounts, "the shared executor left capped directories"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _add(a: int, b: int = 2) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@pytest.fixture
def add_tool() -> kx.Tool:
    return kx.Tool.from_function(_add)


def wait_exited(pid: int, timeout: float = 15.0) -> bool:
    """Wait until process ``pid`` has exited (a zombie counts), without reaping it.

    Event-driven where Linux has pidfds (the fd turns readable when the process ends); else
    psutil's own wait. Returns whether it exited within ``timeout``.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        try:
            psutil.Process(pid).wait(timeout)
        except psutil.NoSuchProcess:
            return True
        except psutil.TimeoutExpired:
            return False
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)


def kernels_matching(text: str) -> list[psutil.Process]:
    """Every running kernel or launcher on the machine whose command line, working directory
    or environment mentions ``text`` (kernels show a title, not their paths, in their command
    line); an exited process its new parent, init, has not reaped yet does not count."""
    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if procs.kind(proc) not in ("kernel", "launcher"):
                continue
            places = [procs.title(proc), proc.cwd(), *proc.environ().values()]
        except psutil.Error:
            continue
        if any(text in place for place in places):
            found.append(proc)
    return found
