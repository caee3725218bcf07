"""Finding 5 of the hostile probe: a cancelled call is stopped on its own account (and
recorded), and closing the executor ends calls in flight with ExecutorClosedError."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

import kernelexec as kx

IGNORES_SIGINT = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "print('going', flush=True)\n"
    "while True:\n"
    "    time.sleep(0.01)\n"
)


@pytest.mark.anyio
async def test_a_cancelled_call_that_ignores_sigint_is_replaced_on_its_own_account() -> None:
    async with kx.AsyncKernelExecutor(interrupt_grace=0.5, record=True) as ex:
        s = await ex.session("stubborn")
        await s.run_code("keep = 1")
        started = asyncio.Event()
        call = asyncio.ensure_future(s.run_code(IGNORES_SIGINT, on_stdout=lambda _: started.set()))
        await asyncio.wait_for(started.wait(), 20)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        after = await s.run_code("1 + 1", timeout=5)
        assert after.ok, after.error  # not blamed with a timeout of its own
        assert after.result == "2"
        assert after.kernel_restarted is True and after.lost_variables == ["keep"]
        assert s.notebook is not None
        cancelled = s.notebook.cells[-2]
        meta = cancelled.metadata["kernelexec"]
        assert meta["status"] == "cancelled" and meta["error_kind"] == "cancelled"
        assert cancelled.source == IGNORES_SIGINT
        assert "going" in "".join(o.get("text", "") for o in cancelled.outputs)


@pytest.mark.anyio
async def test_closing_the_executor_ends_calls_in_flight_with_executor_closed() -> None:
    ex = kx.AsyncKernelExecutor()
    await ex.start()
    started = asyncio.Event()
    call = asyncio.ensure_future(
        ex.run_code(
            "import time; print('go', flush=True); time.sleep(60)",
            agent_id="inflight",
            on_stdout=lambda _: started.set(),
        )
    )
    queued = asyncio.ensure_future(ex.run_code("1", agent_id="inflight"))
    await asyncio.wait_for(started.wait(), 20)
    await ex.aclose()
    with pytest.raises(kx.ExecutorClosedError):
        await call
    with pytest.raises(kx.ExecutorClosedError):
        await queued


def test_closing_the_blocking_executor_ends_a_call_in_another_thread() -> None:
    ex = kx.KernelExecutor()
    started = threading.Event()
    outcome: list[object] = []

    def work() -> None:
        try:
            outcome.append(
                ex.run_code(
                    "import time; print('go', flush=True); time.sleep(60)",
                    on_stdout=lambda _: started.set(),
                )
            )
        except Exception as exc:
            outcome.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    assert started.wait(30)
    ex.close()
    worker.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], kx.ExecutorClosedError)


TICKS = "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.01)\n"


def test_a_raising_output_callback_stops_the_run_and_frees_the_kernel() -> None:
    """Issue 22, item 10: the callback's exception reaches the caller, the endless code is
    interrupted (its state kept), and the next call runs at once instead of queueing behind it
    in the kernel until its own timeout."""

    def explode(text: str) -> None:
        raise ValueError(f"callback broke on {text!r}")

    with kx.KernelExecutor(default_timeout=60) as ex:
        s = ex.session("raising-callback")
        s.run_code("kept = 1")
        with pytest.raises(ValueError, match="callback broke") as raised:
            s.run_code(TICKS, on_stdout=explode)
        assert "raised by the on_stdout callback" in "".join(
            getattr(raised.value, "__notes__", [""])
        )
        after = s.run_code("kept + 1", timeout=20)
        assert after.ok, after.error
        assert after.result == "2" and not after.kernel_restarted
        tool = kx.Tool.from_source(
            "def ticks() -> None:\n" + "".join("    " + line + "\n" for line in TICKS.splitlines())
        )
        with pytest.raises(ValueError, match="callback broke"):
            s.call_tool(tool, {}, on_stdout=explode)
        assert s.run_code("kept + 2", timeout=20).result == "3"


def test_a_program_that_exits_without_close_cleans_up_quietly() -> None:
    """An executor left open is closed at exit, before the thread pools end, with nothing on
    stderr (issue 36: four ``cannot schedule new futures after shutdown`` lines a kernel)."""
    program = textwrap.dedent(
        """
        import os
        import kernelexec as kx

        ex = kx.KernelExecutor()
        for agent in ("a", "b"):
            session = ex.session(agent)
            print(session.run_code("import os; os.getpid()").result, session.workdir, flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    started = [line.split() for line in proc.stdout.splitlines()]
    assert len(started) == 2
    for pid, workdir in started:
        assert not psutil.pid_exists(int(pid))
        assert not os.path.exists(workdir)
