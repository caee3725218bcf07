"""13. The pool: max_kernels with LRU eviction, busy cap, prewarm, idle culling, clean shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kernelexec as kx
from tests.conftest import kernel_children


def _pid(result: kx.Execution) -> int:
    assert result.ok, result.error
    return int(result.result or 0)


PID = "import os; os.getpid()"


def test_max_kernels_evicts_least_recently_used_idle_session() -> None:
    with kx.KernelExecutor(max_kernels=2) as ex:
        a, b, c = ex.session("a"), ex.session("b"), ex.session("c")
        a.run_code("va = 1")
        b.run_code("vb = 2")
        a.run_code("va += 1")  # b is now the least recently used
        assert ex.kernel_count == 2
        c.run_code("vc = 3")
        assert ex.kernel_count == 2
        assert a.run_code("va").result == "2"  # a kept its kernel
        back = b.run_code("'vb' in globals()")
        assert back.result == "False"
        assert back.kernel_restarted is True
        assert back.lost_variables == ["vb"]


@pytest.mark.anyio
async def test_all_kernels_busy_at_the_cap_raises_at_once() -> None:
    async with kx.AsyncKernelExecutor(max_kernels=1) as ex:
        a = await ex.session("a")
        b = await ex.session("b")
        await a.run_code("1")
        started = asyncio.Event()
        running = asyncio.ensure_future(
            a.run_code(
                "import time; print('go', flush=True); time.sleep(10)",
                on_stdout=lambda _: started.set(),
            )
        )
        await asyncio.wait_for(started.wait(), 10)
        start = time.monotonic()
        with pytest.raises(kx.PoolExhaustedError, match="max_kernels=1"):
            await b.run_code("1")
        assert time.monotonic() - start < 1.0
        await a.interrupt()
        result = await running
        assert result.error is not None and result.error.ename == "KeyboardInterrupt"


def test_prewarmed_kernel_serves_a_new_session() -> None:
    with kx.KernelExecutor(prewarm=1) as ex:
        ex.warm_up()
        assert ex.kernel_count == 1
        start = time.monotonic()
        first = ex.session("new").run_code("1 + 1")
        warm_first = time.monotonic() - start
        assert first.result == "2"
        # the pool refills in the background: one assigned + one warm again
        deadline = time.monotonic() + 30
        while ex.kernel_count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.kernel_count == 2
        # A cold session (no warm kernel left to take) pays a start; the warm one did not.
        ex.warm_up()
    assert warm_first < 5.0


def test_idle_sessions_are_culled() -> None:
    with kx.KernelExecutor(idle_timeout=0.3) as ex:
        s = ex.session("idle")
        s.run_code("z = 1")
        assert ex.kernel_count == 1
        deadline = time.monotonic() + 15
        while ex.kernel_count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.kernel_count == 0
        result = s.run_code("'z' in globals()")
        assert result.result == "False"
        assert result.kernel_restarted is True
        assert result.lost_variables == ["z"]


def test_close_leaves_nothing_behind_and_blocks_reuse() -> None:
    ex = kx.KernelExecutor(prewarm=1)
    s = ex.session("x")
    pid = _pid(s.run_code(PID))
    workdir = s.workdir
    assert workdir.is_dir()
    ex.close()
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert not workdir.exists()
    assert not kernel_children()
    with pytest.raises(kx.ExecutorClosedError):
        s.run_code("1")
    with pytest.raises(kx.ExecutorClosedError):
        ex.run_code("1")
    ex.close()  # idempotent


@pytest.mark.anyio
async def test_leaving_on_an_exception_shuts_kernels_down() -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="agent crashed"):
        async with kx.AsyncKernelExecutor() as ex:
            pids.append(_pid(await ex.run_code(PID)))
            raise RuntimeError("agent crashed")
    assert pids and not kernel_children()


def test_ctrl_c_in_a_sync_program_shuts_kernels_down(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    pidfile = tmp_path / "pid"
    script.write_text(
        textwrap.dedent(
            f"""
            import kernelexec as kx
            with kx.KernelExecutor() as ex:
                r = ex.run_code("import os; os.getpid()")
                open({str(pidfile)!r}, "w").write(r.result)
                ex.run_code("import time; time.sleep(60)", timeout=120)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kernel_pid = int(pidfile.read_text())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert b"KeyboardInterrupt" in err
    assert not Path(f"/proc/{kernel_pid}").exists()


def test_bad_configuration_is_a_typed_error() -> None:
    with pytest.raises(kx.ConfigError, match="max_kernels"):
        kx.KernelExecutor(max_kernels=0)
    with pytest.raises(kx.ConfigError, match="not_a_setting"):
        kx.KernelExecutor(not_a_setting=1)
    with pytest.raises(kx.ConfigError, match="prewarm"):
        kx.AsyncKernelExecutor(prewarm=5, max_kernels=2)
    assert isinstance(kx.ConfigError("x"), ValueError)


def test_restart_and_interrupt_from_the_api(executor: kx.KernelExecutor) -> None:
    s = executor.session("restart")
    s.run_code("a = 1")
    old = _pid(s.run_code(PID))
    s.restart()
    after = s.run_code("'a' in globals()")
    assert after.result == "False"
    assert after.kernel_restarted is True
    assert "a" in after.lost_variables
    assert _pid(s.run_code(PID)) != old
    assert os.getpid() != old


def test_sync_facade_works_where_a_loop_is_already_running() -> None:
    # As inside Jupyter: the calling thread already runs an event loop.
    async def inside_a_running_loop() -> str | None:
        with kx.KernelExecutor() as ex:
            return ex.run_code("21 * 2").result

    assert asyncio.run(inside_a_running_loop()) == "42"


@pytest.mark.anyio
async def test_a_closed_session_gives_way_to_a_fresh_one() -> None:
    async with kx.AsyncKernelExecutor(max_kernels=1) as ex:
        first = await ex.session("a")
        await first.run_code("x = 1")
        await first.aclose()
        assert ex.kernel_count == 0
        assert "a" not in ex.sessions
        with pytest.raises(kx.ExecutorClosedError):
            await first.run_code("x")
        second = await ex.session("a")
        assert second is not first
        # max_kernels=1: the closed session's kernel no longer counts against the budget.
        result = await second.run_code("x")
        assert result.error is not None and result.error.ename == "NameError"
