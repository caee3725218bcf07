"""``async def`` tools: awaited on the kernel's own event loop, like sync tools in every way
(timeouts, interrupts, output, agent_state, env, recording, replay, the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import kernelexec as kx
from tests.support.deadlines import after_output, started_before


async def fetch_twice(url: str, agent_state=None) -> dict:
    """Pretend to fetch a URL twice, concurrently.

    Args:
        url: Where to fetch from.
    """
    import asyncio
    import os
    import threading

    async def one(i: int) -> str:
        await asyncio.sleep(0.01)
        return f"{url}#{i}"

    print("fetching", url)
    pages = await asyncio.gather(one(1), one(2))
    loop = asyncio.get_running_loop()
    global first_loop
    first_loop = globals().get("first_loop", id(loop))
    if agent_state is not None:
        agent_state["fetched"] = agent_state.get("fetched", 0) + 1
    return {
        "pages": pages,
        "thread": threading.current_thread().name,
        "same_loop": first_loop == id(loop),
        "token": os.environ.get("TOKEN"),
    }


SLEEPER = '''
async def sleeper(seconds: float) -> str:
    """Sleep (after leaving a mark).

    Args:
        seconds: How long.
    """
    import asyncio
    global mark
    mark = "set before the sleep"
    await asyncio.sleep(seconds)
    return "woke"
'''

SPINNER = '''
async def spinner() -> int:
    """Spin without awaiting."""
    import time
    while True:
        time.sleep(0.01)
'''


def test_async_function_tool_is_awaited_on_the_kernels_loop(executor: kx.KernelExecutor) -> None:
    tool = kx.Tool.from_function(fetch_twice)
    assert tool.is_async
    assert "agent_state" not in tool.json_schema["parameters"]["properties"]
    first = executor.call_tool(
        tool, {"url": "u"}, agent_id="async-1", agent_state={}, env_vars={"TOKEN": "t"}
    )
    assert first.ok, first.error
    assert first.func_return == {
        "pages": ["u#1", "u#2"],
        "thread": "MainThread",
        "same_loop": True,
        "token": "t",
    }
    assert first.stdout == "fetching u\n"
    assert first.agent_state == {"fetched": 1}
    second = executor.call_tool(tool, {"url": "v"}, agent_id="async-1", agent_state={"fetched": 1})
    assert second.func_return["same_loop"] is True  # the kernel's one loop, across calls
    assert second.func_return["token"] is None  # per-call variables are gone
    assert second.agent_state == {"fetched": 2}


def test_stored_async_tool_returns_its_awaited_value(executor: kx.KernelExecutor) -> None:
    source = (
        "async def later(x: int) -> int:\n"
        "    import asyncio\n"
        "    await asyncio.sleep(0)\n"
        "    return x * 2\n"
    )
    schema = {
        "name": "later",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    }
    stored = kx.Tool(name="later", source_code=source, json_schema=schema)
    result = executor.call_tool(stored, {"x": 21}, agent_id="async-stored")
    assert result.ok, result.error
    assert result.func_return == 42


LOUD_SLEEPER = '''
async def sleeper(seconds: float) -> str:
    """Say so, then sleep."""
    import asyncio
    import time
    print("started", time.monotonic(), flush=True)
    await asyncio.sleep(seconds)
    return "woke"
'''

LOUD_SPINNER = '''
async def spinner() -> int:
    """Say so, then spin without awaiting."""
    import time
    print("started", time.monotonic(), flush=True)
    while True:
        time.sleep(0.01)
'''


@pytest.mark.parametrize(("source", "name"), [(LOUD_SLEEPER, "sleeper"), (LOUD_SPINNER, "spinner")])
def test_timeout_interrupts_an_async_tool_and_keeps_state(source: str, name: str) -> None:
    tool = kx.Tool.from_source(source)
    args = {"seconds": 60} if name == "sleeper" else {}
    with kx.KernelExecutor() as ex:

        def attempt(deadline: float) -> tuple[kx.ToolResult, float]:
            # A served call announces no start: an interrupt sent before the kernel took it
            # is lost, and the call ends stuck, on a fresh kernel. So the deadline must pass
            # after the tool started (CLOCK_MONOTONIC is the machine's, the kernel's too).
            ex.run_code("kept = 1", agent_id="a")
            sent = time.monotonic()
            result = ex.call_tool(tool, args, agent_id="a", timeout=deadline)
            assert result.error is not None and result.error.kind == "timeout"
            return result, sent + deadline

        (result, _), _ = after_output(attempt, started_before("started"))
        assert result.error is not None
        assert result.error.evalue.endswith("interrupted, kernel state kept")
        assert not result.kernel_restarted
        assert ex.run_code("kept", agent_id="a").result == "1"
        woke = ex.call_tool(kx.Tool.from_source(SLEEPER), {"seconds": 0}, agent_id="a")
        assert woke.func_return == "woke"  # the loop still runs tools


def test_generator_tools_are_refused() -> None:
    for source in (
        "def items():\n    yield 1\n",
        "async def items():\n    yield 1\n",
        "def items():\n    yield from range(3)\n",
    ):
        with pytest.raises(kx.ToolDefinitionError, match="generator function"):
            kx.Tool.from_source(source)
    # yield in a nested function does not make the tool a generator
    nested = kx.Tool.from_source(
        "def outer() -> list:\n    def g():\n        yield 1\n    return list(g())\n"
    )
    assert not nested.is_async


def test_stored_generator_and_unawaited_awaitable_are_invalid_tools(
    executor: kx.KernelExecutor,
) -> None:
    stored = kx.Tool(name="items", source_code="def items():\n    yield 1\n", json_schema={})
    result = executor.call_tool(stored, {}, agent_id="async-gen")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "generator function" in result.error.evalue
    sneaky = kx.Tool(
        name="sneaky",
        source_code="def sneaky():\n    import asyncio\n    return asyncio.sleep(0, 'x')\n",
        json_schema={},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        result = executor.call_tool(sneaky, {}, agent_id="async-gen")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "returned an awaitable" in result.error.evalue


def test_invalid_args_have_one_ename_wherever_they_are_found(
    executor: kx.KernelExecutor,
) -> None:
    tool = kx.Tool.from_source(SLEEPER)
    host = executor.call_tool(tool, {"seconds": "x"}, agent_id="async-args")
    loose = kx.Tool(
        name="sleeper",
        source_code=SLEEPER,
        json_schema={"name": "sleeper", "parameters": {"type": "object", "properties": {}}},
        args_json_schema={"type": "object", "additionalProperties": True},
    )
    kernel = executor.call_tool(loose, {"minutes": 1}, agent_id="async-args")
    for result in (host, kernel):
        assert result.error is not None and result.error.kind == "invalid_args"
        assert result.error.ename == "InvalidArguments"
        assert result.error.traceback == []
    assert "missing a required argument: 'seconds'" in kernel.error.evalue  # type: ignore[union-attr]


def test_async_tool_is_recorded_as_await_and_replays(tmp_path: Path) -> None:
    tool = kx.Tool.from_source(SLEEPER)
    with kx.KernelExecutor(record_dir=tmp_path) as ex:
        result = ex.call_tool(tool, {"seconds": 0}, agent_id="rec")
        assert result.func_return == "woke"
        assert result.outputs == []  # the displayed value is only in the recording
    cells = json.loads((tmp_path / "rec.ipynb").read_text())["cells"]
    assert "".join(cells[1]["source"]) == "await sleeper(seconds=0)"
    assert cells[1]["outputs"][0]["data"]["text/plain"] == "'woke'"
    report = kx.replay(tmp_path / "rec.ipynb")
    assert report.cells_run == 2 and report.differences == []


def test_cli_runs_an_async_tool(tmp_path: Path) -> None:
    path = tmp_path / "sleeper.py"
    path.write_text(textwrap.dedent(SLEEPER))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernelexec",
            "run",
            str(path),
            "--args",
            '{"seconds": 0}',
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["func_return"] == "woke"
