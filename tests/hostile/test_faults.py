"""Hostile: code that crashes, hangs, floods or returns what cannot be returned. Each case asserts
its exact outcome and that the session works on the next call."""

from __future__ import annotations

import asyncio
import os
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernelexec as kx
from tests.conftest import kernel_children, our_temp_dirs
from tests.support.deadlines import after_output, started_before

pytestmark = pytest.mark.usefixtures("executor")


@pytest.fixture(scope="module")
def executor() -> Iterator[kx.KernelExecutor]:
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(default_timeout=30, interrupt_grace=1, max_kernels=12) as ex:
        yield ex
    assert not kernel_children() - before
    assert not our_temp_dirs() - before_dirs


@pytest.mark.slow
def test_200_mb_of_output_is_capped(executor: kx.KernelExecutor) -> None:
    s = executor.session("flood")
    result = s.run_code("print('x' * 200_000_000)")
    assert result.ok
    assert len(result.stdout) < 1_100_000
    assert "[kernelexec: output truncated at 1000000 characters]" in result.stdout
    assert s.run_code("'after'").result == "'after'"


def test_deep_recursion(executor: kx.KernelExecutor) -> None:
    s = executor.session("recursion")
    result = s.run_code("def f(n):\n    return f(n + 1)\nf(0)")
    assert result.error is not None and result.error.kind == "exception"
    assert result.error.ename == "RecursionError"
    assert s.run_code("'ok'").result == "'ok'"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import ctypes; ctypes.string_at(0)", "killed by SIGSEGV"),
        ("import os; os._exit(3)", "exit code 3"),
        ("import os; os.abort()", "killed by SIGABRT"),
    ],
    ids=["segfault", "os_exit", "abort"],
)
def test_crashes_are_reported_and_recovered(
    executor: kx.KernelExecutor, code: str, reason: str
) -> None:
    s = executor.session(f"crash-{reason}")
    s.run_code("before = 1")
    result = s.run_code(code)
    assert result.error is not None and result.error.kind == "kernel_died"
    assert result.error.evalue == f"the kernel died ({reason})"
    assert result.kernel_restarted and result.lost_variables == ["before"]
    assert s.run_code("'back'").result == "'back'"


def test_blocking_on_stdin(executor: kx.KernelExecutor) -> None:
    s = executor.session("stdin")
    for code in ("input('? ')", "import getpass; getpass.getpass()"):
        result = s.run_code(code)
        assert result.error is not None and result.error.kind == "exception"
        assert result.error.ename == "StdinNotImplementedError"
    assert s.run_code("import sys; sys.stdin.read()").result in ("''", None)


def test_ignored_sigint_with_the_gil_held(executor: kx.KernelExecutor) -> None:
    s = executor.session("sigint")
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "print('ignoring', time.monotonic(), flush=True)\n"
        "while True: pass"
    )

    def attempt(deadline: float) -> tuple[kx.Execution, float]:
        # An interrupt that reaches code started late (after its deadline) is raised before
        # the code ignores SIGINT: that run stops and keeps its state, and is tried again.
        s.run_code("kept = 1")
        sent = time.monotonic()
        result = s.run_code(code, timeout=deadline)
        assert result.error is not None and result.error.kind == "timeout"
        return result, sent + deadline

    (result, _), _ = after_output(attempt, started_before("ignoring"))
    assert result.error is not None
    assert "did not stop when interrupted" in result.error.evalue
    assert result.kernel_restarted and result.lost_variables == ["kept"]
    assert s.run_code("'back'").result == "'back'"


def test_threads_that_keep_printing_after_the_call(executor: kx.KernelExecutor) -> None:
    s = executor.session("threads")
    first = s.run_code(
        "import threading, time\n"
        "def spam():\n"
        "    while True:\n"
        "        print('tick', flush=True)\n"
        "        time.sleep(0.001)\n"
        "threading.Thread(target=spam, daemon=True).start()\n"
        "'started'"
    )
    assert first.ok and first.result == "'started'"
    # Ticks fall anywhere around each call: before the kernel side starts counting the call's
    # output, one made the host end the call without its result (up to 2 calls in 5 under load).
    for _ in range(20):
        second = s.run_code("21 * 2")
        assert second.ok and second.result == "42", second
        assert second.lost_outputs == 0
        assert len(second.stdout) <= 1_000_100  # bounded by max_output_chars however long it runs
    s.restart()
    third = s.run_code("'quiet'")
    assert third.result == "'quiet'" and "tick" not in third.stdout


def test_non_utf8_bytes_on_fd_1(executor: kx.KernelExecutor) -> None:
    s = executor.session("bytes")
    # Written while ipykernel's capture thread cannot forward it (the code holds the buffer
    # lock): the thread reads the bytes and holds them, often until after the code has ended,
    # and the run must wait for it (test_output_held_by_the_capture_thread_comes_with_the_run
    # holds them until the run waits, every time).
    result = s.run_code(
        "import os, sys\nwith sys.stdout._buffer_lock:\n"
        "    os.write(1, b'\\xff\\xfe ok\\n' + b'z' * 60_000 + b'|end\\n')"
    )
    assert result.ok, result.error
    assert result.stdout == "\ufffd\ufffd ok\n" + "z" * 60_000 + "|end\n"
    assert s.run_code("'after'").result == "'after'"


HOLD_THE_CAPTURE_THREAD = """
import os, sys, threading, time

def _hold_capture_thread() -> None:
    # Holds ipykernel's stdout buffer lock from another thread, so that the thread that reads
    # the captured fd 1 reads what is written and cannot hand it over, until the end of the run
    # waits for it (the main thread is in kernelexec's catch_up) or the kernel has moved on to
    # the next request (the streams' parent changed): without the wait the run ended first.
    run = sys.stdout.parent_header.get("msg_id")
    main = threading.main_thread().ident
    held = threading.Event()

    def waited_for() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "catch_up":
                return True
            frame = frame.f_back
        return sys.stdout.parent_header.get("msg_id") != run

    def hold() -> None:
        with sys.stdout._buffer_lock:
            held.set()
            while not waited_for():
                time.sleep(0.001)

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
"""


def test_output_held_by_the_capture_thread_comes_with_the_run(executor: kx.KernelExecutor) -> None:
    """fd-level output that the capture thread has read but not yet handed to the stream when
    the code ends is still the run's: it came after the reply (and was lost) before the run's
    end waited for the thread itself rather than for an empty pipe."""
    s = executor.session("held-fd")
    tail = "\ufffd\ufffd ok\n" + "z" * 60_000 + "|end\n"
    result = s.run_code(
        HOLD_THE_CAPTURE_THREAD
        + "_hold_capture_thread()\n"
        + "os.write(1, b'\\xff\\xfe ok\\n' + b'z' * 60_000 + b'|end\\n')\n"
    )
    assert result.ok, result.error
    assert result.stdout == tail
    tool = kx.Tool.from_source(
        HOLD_THE_CAPTURE_THREAD + "\n\ndef held() -> int:\n"
        '    """Writes to fd 1 while the capture thread cannot forward it."""\n'
        "    _hold_capture_thread()\n"
        "    os.write(1, b'from a tool\\n')\n"
        "    return 7\n"
    )
    called = s.call_tool(tool)
    assert called.func_return == 7, called.error
    assert called.stdout == "from a tool\n"
    assert s.run_code("print('after')").stdout == "after\n"


def recursive() -> Any:
    """Returns a list that contains itself."""
    loop: list[Any] = []
    loop.append(loop)
    return loop


def unconvertible() -> Any:
    """Returns something JSON has no form for."""
    return object()


def test_recursive_and_unconvertible_return_values(executor: kx.KernelExecutor) -> None:
    # The README's conversion rules: a cycle is cut with a marker, what JSON has no form for
    # becomes its repr. (Issue 11 revisits JSON limits; this is what holds on this branch.)
    s = executor.session("returns")
    loop = s.call_tool(kx.Tool.from_function(recursive), {})
    assert loop.ok and loop.func_return == ["<circular reference>"]
    odd = s.call_tool(kx.Tool.from_function(unconvertible), {})
    assert odd.ok and str(odd.func_return).startswith("<object object at 0x")
    assert s.run_code("'ok'").result == "'ok'"


def typed(count: int, ratio: float, name: str, flags: list[bool], extra: dict[str, int]) -> str:
    """Echoes its arguments as text."""
    return repr((count, ratio, name, flags, sorted(extra.items())))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    args=st.dictionaries(
        st.sampled_from(["count", "ratio", "name", "flags", "extra", "zzz"]), _json, max_size=6
    )
)
def test_fuzzed_arguments_never_reach_the_kernel_unvalidated(args: dict[str, Any]) -> None:
    tool = kx.Tool.from_function(typed)
    problems = tool.validate_args(args)
    ok = (
        set(args) == {"count", "ratio", "name", "flags", "extra"}
        and type(args["count"]) is int
        and type(args["ratio"]) in (int, float)
        and isinstance(args["name"], str)
        and isinstance(args["flags"], list)
        and all(type(f) is bool for f in args["flags"])
        and isinstance(args["extra"], dict)
        and all(type(v) is int for v in args["extra"].values())
    )
    assert (problems == []) == ok, (args, problems)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.text(alphabet=string.printable + "\u2028\x00\"'\\{}$", max_size=40))
def test_fuzzed_strings_round_trip_exactly(executor: kx.KernelExecutor, name: str) -> None:
    tool = kx.Tool.from_function(typed)
    result = executor.session("fuzz").call_tool(
        tool, {"count": 1, "ratio": 0.5, "name": name, "flags": [True], "extra": {"a": 1}}
    )
    assert result.ok, result.error
    assert result.func_return == repr((1, 0.5, name, [True], [("a", 1)]))


@pytest.mark.anyio
async def test_50_concurrent_calls_on_one_session() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("concurrent")
        await s.run_code("log = []")
        calls = [s.run_code(f"log.append({i}); len(log)") for i in range(50)]
        results = await asyncio.gather(*calls)
        assert [r.result for r in results] == [str(i + 1) for i in range(50)]
        assert (await s.run_code("log == list(range(50))")).result == "True"


@pytest.mark.slow
@pytest.mark.anyio
async def test_50_sessions_opened_and_closed_in_a_loop(tmp_path: Path) -> None:
    import psutil

    host = psutil.Process()
    async with kx.AsyncKernelExecutor(prewarm=1, record_dir=tmp_path) as ex:
        await (await ex.session("warm")).run_code("1")
        # Both counts with the prewarmed kernel started: a kernel starting (or not) at either
        # moment is five descriptors and more (150 against 145 + 4 once, two suites at once).
        await ex.warm_up()
        fds, threads = host.num_fds(), host.num_threads()
        for i in range(50):
            s = await ex.session(f"loop-{i}")
            assert (await s.run_code(f"{i} * 2")).result == str(i * 2)
            await s.aclose()
        await ex.warm_up()
        assert ex.kernel_count == 2  # "warm" and the prewarmed kernel
        assert host.num_fds() <= fds + 4
        assert host.num_threads() <= threads + 2
    saved = sorted(p.name for p in os.scandir(tmp_path))
    assert [n for n in saved if n.startswith("loop-")] == sorted(
        f"loop-{i}.ipynb" for i in range(50)
    )
