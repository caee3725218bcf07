"""Kernels forked from a fork server: proven by their parentage, working as plain-launched ones
(tool calls, code, timeouts, deaths and restarts, limits, venvs), and the switch that turns the
server off."""

from __future__ import annotations

import asyncio
import os
import resource
from pathlib import Path

import psutil
import pytest

import kernelexec as kx
from kernelexec._sandbox import _cgroups, _users
from kernelexec.backends import LocalBackend
from kernelexec.backends._forkservers import NO_FORK_SERVER_ENV
from tests.conftest import wait_exited
from tests.support.procs import kind, of_kind, title
from tests.support.wheels import make_wheel

pytestmark = pytest.mark.skipif(
    not LocalBackend().fork_server, reason="fork servers are off here (no pidfds, or switched off)"
)


def servers() -> set[int]:
    """This process's fork servers."""
    return of_kind(os.getpid(), "fork server")


def kernel_pid(session: kx.Session) -> int:
    return int(session.run_code("import os; os.getpid()").result or 0)


def forked_from(pid: int, level: str) -> int:
    """The fork server ``pid`` was forked from (directly at "none", under its launcher at
    "process"); fails when it was not."""
    proc = psutil.Process(pid)
    parent = proc.parent()
    assert parent is not None
    if level == "process":
        assert parent.pid != os.getpid() and title(parent) == "kernelexec launcher"
        parent = parent.parent()
        assert parent is not None
    assert parent.pid in servers() and title(parent) == "kernelexec fork server"
    # Forked, never executed: the kernel titled itself (no source in its command line).
    assert title(proc).startswith("kernelexec kernel ") and title(proc).endswith(f" [{level}]")
    return parent.pid


@pytest.mark.parametrize("level", ["none", "process"])
def test_new_sessions_get_kernels_forked_from_one_server(
    level: str, add_tool: kx.Tool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KX_FAKE_SECRET", "hunter2")
    with kx.KernelExecutor(isolation=level) as ex:
        first, second = ex.session("a"), ex.session("b")
        assert first.call_tool(add_tool, {"a": 40}).func_return == 42
        assert second.run_code("x = 2\nx * 21").result == "42"
        server = forked_from(kernel_pid(first), level)
        assert forked_from(kernel_pid(second), level) == server
        assert "fork server" in first.isolation.boundaries["launch"]
        # Neither the server nor its kernels carry the host's secrets.
        assert "KX_FAKE_SECRET" not in psutil.Process(server).environ()
        env = first.run_code("import os; sorted(os.environ)").result or ""
        assert "KX_FAKE_SECRET" not in env and "JPY_PARENT_PID" in env
        own = first.run_code("import os; (os.getcwd(), os.environ['IPYTHONDIR'])").result or ""
        other = second.run_code("import os; (os.getcwd(), os.environ['IPYTHONDIR'])").result
        assert own != other
        if level == "process" and first.isolation.boundaries["user"].startswith("its own"):
            uid = psutil.Process(kernel_pid(first)).uids().real
            assert uid >= _users.UID_BASE and uid != psutil.Process(server).uids().real
    assert wait_exited(server)  # the server ends with the executor


@pytest.mark.anyio
async def test_kernels_started_at_once_on_a_new_server(add_tool: kx.Tool) -> None:
    """The first starts race the server's own start: each gets its own kernel, all forked."""
    async with kx.AsyncKernelExecutor(max_kernels=4) as ex:
        sessions = [await ex.session(f"at-once-{i}") for i in range(4)]
        results = await asyncio.gather(
            *(s.call_tool(add_tool, {"a": i}) for i, s in enumerate(sessions))
        )
        assert [r.func_return for r in results] == [2, 3, 4, 5]
        pids = [int((await s.run_code("import os; os.getpid()")).result or 0) for s in sessions]
        assert len(set(pids)) == 4
        assert {forked_from(pid, "process") for pid in pids} == servers()
        assert len(servers()) == 1


def test_timeouts_deaths_and_restarts_of_forked_kernels() -> None:
    with kx.KernelExecutor(default_timeout=30, interrupt_grace=5) as ex:
        s = ex.session("faults")
        s.run_code("kept = 'yes'")
        first = kernel_pid(s)
        server = forked_from(first, "process")
        spin = s.run_code("while True: pass", timeout=1)
        assert spin.error is not None and spin.error.kind == "timeout"
        assert s.run_code("kept").result == "'yes'"  # interrupted by SIGINT, state kept
        died = s.run_code("import os; print('bye', flush=True); os._exit(3)")
        assert died.error is not None and died.error.kind == "kernel_died"
        assert "exit code 3" in died.error.evalue
        assert forked_from(kernel_pid(s), "process") == server
        killed = s.run_code(
            "import os, signal; print('bye', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
        )
        assert killed.error is not None and "SIGKILL" in killed.error.evalue
        after = s.run_code("'back'")
        assert after.result == "'back'"
        assert forked_from(kernel_pid(s), "process") == server
        assert not psutil.pid_exists(first)


def test_limits_and_cgroup_of_a_forked_kernel() -> None:
    with kx.KernelExecutor(limits=kx.Limits(max_open_files=256, max_file_mb=10)) as ex:
        s = ex.session("limits")
        forked_from(kernel_pid(s), "process")
        nofile = s.run_code(f"import resource; resource.getrlimit({resource.RLIMIT_NOFILE})")
        assert nofile.result == "(256, 256)"
        fsize = s.run_code(f"import resource; resource.getrlimit({resource.RLIMIT_FSIZE})")
        assert fsize.result == f"({10 * 1024 * 1024}, {10 * 1024 * 1024})"
        if _cgroups.support().kill is not None:
            groups = s.run_code("open('/proc/self/cgroup').read()").result or ""
            assert f"kx-{os.getpid()}-" in groups


@pytest.mark.slow
def test_a_server_per_interpreter_for_venvs(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    wheel = make_wheel(tmp_path / "wheels", "kxforked", "1.0", "VERSION = '1.0'\n")
    env = kx.VenvEnv(requirements=[str(wheel)])
    with kx.KernelExecutor(cache_dir=tmp_path / "cache") as ex:
        host = ex.session("a")
        venv = ex.session("a", env)
        assert venv.run_code("import kxforked; kxforked.VERSION").result == "'1.0'"
        in_host = forked_from(kernel_pid(host), "process")
        in_venv = forked_from(kernel_pid(venv), "process")
        assert in_host != in_venv and servers() == {in_host, in_venv}
        prefix = venv.run_code("import sys; sys.prefix").result or ""
        backend = ex._async.backend  # the server's title hides its interpreter: ask the host
        assert isinstance(backend, LocalBackend)
        pythons = {server.pid: server.python for server in backend.forks._servers.values()}
        assert pythons[in_venv].startswith(prefix.strip("'"))


def test_the_switch_turns_the_server_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with kx.KernelExecutor(backend_options={"fork_server": False}) as ex:
        s = ex.session("plain")
        pid = kernel_pid(s)
        launcher = psutil.Process(pid).parent()
        assert launcher is not None and kind(launcher) == "launcher"
        assert launcher.pid in of_kind(os.getpid(), "launcher")
        assert not servers()
        assert s.isolation.boundaries["launch"].startswith("a new interpreter")
    monkeypatch.setenv(NO_FORK_SERVER_ENV, "1")
    assert not LocalBackend().fork_server
    with pytest.raises(kx.ConfigError, match="fork_server must be True or False"):
        LocalBackend(fork_server="yes")  # type: ignore[arg-type]


def test_bwrap_uses_the_plain_launch() -> None:
    backend = LocalBackend()
    launch = kx.backends.KernelLaunch(isolation="bwrap")
    assert backend.launch_kind(launch) == "plain"
    assert backend.launch_kind(kx.backends.KernelLaunch(isolation="process")) == "fork server"


KERNEL_SIDE = (
    "__kernelexec__",
    "__kernelexec_budget__",
    "__kernelexec_tuning__",
    "__kernelexec_output__",
    "__kernelexec_namespace__",
)


@pytest.mark.parametrize("level", ["none", "process"])
def test_forked_kernels_run_the_kernel_side_their_server_compiled(level: str) -> None:
    # Every top-level function of each kernel-side module runs one of the server's code
    # objects (compiled once there), not a fresh compile of the source the install carried.
    probe = (
        "import sys\n"
        "codes = sys.modules['__kernelexec_compiled__'].codes.values()\n"
        "shared = {id(c) for code in codes for c in code.co_consts}\n"
        "def served(name):\n"
        "    fns = [f for f in vars(sys.modules[name]).values() if type(f).__name__ == 'function'\n"
        "           and f.__code__.co_filename == '<kernelexec>'\n"
        "           and '<locals>' not in f.__qualname__]\n"
        "    return bool(fns) and all(id(f.__code__) in shared for f in fns)\n"
        f"print([n for n in {KERNEL_SIDE!r} if served(n)], len(codes))"
    )
    with kx.KernelExecutor(isolation=level) as ex:
        s = ex.session("a")
        forked_from(kernel_pid(s), level)
        assert s.run_code(probe).stdout == f"{list(KERNEL_SIDE)!r} 5\n"
        assert s.call_tool(kx.Tool.from_source("def f() -> int:\n    return 7\n"), {}).ok
