"""Tool calls served by the kernel-side helper (``kernelexec_call_request``) and the execute
path they fall back to: what goes over the wire for each, and that both give the same results.

The wire is watched by a second, independent client subscribed to the kernel's iopub (real
jupyter-client over the kernel's own connection info). iopub is one ordered stream, so once
that client sees the idle of a later ``run_code``, it has seen everything the call published.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from jupyter_client.asynchronous import AsyncKernelClient

import kernelexec as kx
from kernelexec._protocol import _host as protocol
from kernelexec._protocol._kernel_side import CALL_REQUEST

PRINTS = kx.Tool.from_source(
    '''
def shout(text: str, times: int = 1) -> str:
    """Print and return a text.

    Args:
        text: What to print.
        times: How often.
    """
    for _ in range(times):
        print(text)
    return text.upper()
'''
)

FAILS = kx.Tool.from_source(
    '''
def fails(x: int) -> int:
    """Divide one by x.

    Args:
        x: The divisor.
    """
    return 1 // x
'''
)

AWAITS = kx.Tool.from_source(
    '''
async def later(x: int) -> int:
    """Sleep a moment, return x.

    Args:
        x: A number.
    """
    import asyncio
    await asyncio.sleep(0)
    return x
'''
)


pytestmark = pytest.mark.anyio


class Sniffer:
    """An outside client on a session's kernel's iopub: every message with its parent's type."""

    def __init__(self, session: kx.AsyncSession) -> None:
        conn = session.lease.connection
        assert conn is not None
        info = conn.connection_info()
        assert info is not None
        self.client = AsyncKernelClient()
        self.client.load_connection_info(info)
        self.session = session

    async def __aenter__(self) -> Sniffer:
        self.client.start_channels(shell=False, stdin=False, hb=False, control=False)
        # A subscription takes effect asynchronously: wait until a run's idle comes through.
        for _ in range(100):
            if await self._saw_idle_of_a_run(timeout=0.2):
                return self
        raise AssertionError("the sniffer never received iopub")

    async def __aexit__(self, *exc: object) -> None:
        self.client.stop_channels()

    async def _saw_idle_of_a_run(self, timeout: float) -> bool:
        marker = await self.session.run_code("'sniff'")
        assert marker.ok
        try:
            while True:
                msg = await self.client.get_iopub_msg(timeout=timeout)
                if (
                    msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"
                    and msg["parent_header"].get("msg_type") == "execute_request"
                ):
                    return True
        except Exception:  # queue.Empty from jupyter-client
            return False

    async def messages_until_next_run(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(parent msg_type, msg_type, content) of everything up to a fresh run's idle."""
        await self.session.run_code("'fence'")
        seen = []
        while True:
            msg = await self.client.get_iopub_msg(timeout=10)
            parent = msg["parent_header"].get("msg_type", "")
            seen.append((parent, msg["msg_type"], msg["content"]))
            if (
                msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
                and parent == "execute_request"
                and any(c.get("code") == "'fence'" for _, t, c in seen if t == "execute_input")
            ):
                return seen


@pytest.fixture(autouse=True)
def served_calls_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests choose the path themselves, also when the suite runs on the execute path."""
    monkeypatch.delenv("KERNELEXEC_FAST_CALLS", raising=False)


@pytest.fixture
async def executor() -> AsyncIterator[kx.AsyncKernelExecutor]:
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        yield ex


async def test_a_served_call_sends_only_its_outputs_and_streams_them_live(
    executor: kx.AsyncKernelExecutor,
) -> None:
    session = await executor.session("served")
    assert (await session.run_code("1")).ok
    assert session.lease.connection is not None and session.lease.connection.serves_calls
    live: list[str] = []
    async with Sniffer(session) as sniffer:
        result = await session.call_tool(PRINTS, {"text": "hey", "times": 2}, on_stdout=live.append)
        seen = await sniffer.messages_until_next_run()
    assert result.ok and result.func_return == "HEY"
    assert result.stdout == "hey\nhey\n" and "".join(live) == "hey\nhey\n"
    of_call = [(kind, content) for parent, kind, content in seen if parent == CALL_REQUEST]
    assert [kind for kind, _ in of_call] == ["stream"] * len(of_call) and of_call
    assert "".join(c["text"] for _, c in of_call) == "hey\nhey\n"


async def test_a_silent_served_call_publishes_nothing(executor: kx.AsyncKernelExecutor) -> None:
    session = await executor.session("silent")
    assert (await session.run_code("1")).ok
    async with Sniffer(session) as sniffer:
        result = await session.call_tool(PRINTS, {"text": "", "times": 0})
        seen = await sniffer.messages_until_next_run()
    assert result.ok and result.func_return == ""
    assert [kind for parent, kind, _ in seen if parent == CALL_REQUEST] == []


async def test_the_switch_sends_tool_calls_as_execute_requests() -> None:
    async with kx.AsyncKernelExecutor(isolation="none", fast_calls=False) as ex:
        session = await ex.session("execute-path")
        assert (await session.run_code("1")).ok
        assert session.lease.connection is not None
        assert not session.lease.connection.serves_calls
        async with Sniffer(session) as sniffer:
            result = await session.call_tool(PRINTS, {"text": "x"})
            seen = await sniffer.messages_until_next_run()
    assert result.func_return == "X"
    assert [parent for parent, *_ in seen if parent == CALL_REQUEST] == []
    inputs = [c["code"] for _, kind, c in seen if kind == "execute_input"]
    assert any("__kernelexec__" in code and ".call()" in code for code in inputs)


def test_a_kernel_whose_helper_does_not_say_it_serves_calls_gets_execute_requests() -> None:
    # What another ipykernel's install reply looks like: no capabilities payload at all.
    assert not protocol.serves_calls({"status": "ok", "payload": []})
    assert not protocol.serves_calls({"status": "ok"})
    assert not protocol.serves_calls(
        {"payload": [{"source": "kernelexec.capabilities", "serves": []}]}
    )
    assert protocol.serves_calls(
        {"payload": [{"source": "kernelexec.capabilities", "serves": ["call"]}]}
    )


@pytest.mark.parametrize("fast", [True, False], ids=["served", "execute"])
async def test_both_paths_give_the_same_results(fast: bool) -> None:
    async with kx.AsyncKernelExecutor(isolation="none", fast_calls=fast, record=True) as ex:
        s = await ex.session("same")
        ok = await s.call_tool(PRINTS, {"text": "a"})
        bad = await s.call_tool(FAILS, {"x": 0})
        awaited = await s.call_tool(AWAITS, {"x": 7})
        env = await s.call_tool(
            kx.Tool.from_source(
                'def env_of(name: str) -> str | None:\n    """Read a variable.\n\n'
                '    Args:\n        name: Its name.\n    """\n'
                "    import os\n    return os.environ.get(name)\n"
            ),
            {"name": "KX_FAST_VAR"},
            env_vars={"KX_FAST_VAR": "set"},
        )
        after = await s.run_code("import os; 'KX_FAST_VAR' in os.environ")
        stdin = await s.call_tool(
            kx.Tool.from_source('def ask() -> str:\n    """Ask."""\n    return input("? ")\n')
        )
        slow = await s.call_tool(
            kx.Tool.from_source(
                'def nap() -> None:\n    """Sleep."""\n    import time\n    time.sleep(30)\n'
            ),
            timeout=1.0,
        )
        still = await s.call_tool(PRINTS, {"text": "b"})
        nb = s.notebook
    assert ok.func_return == "A" and ok.stdout == "a\n" and ok.result is None
    assert bad.error is not None and bad.error.kind == "exception"
    assert bad.error.ename == "ZeroDivisionError"
    plain = re.sub(r"\x1b\[[0-9;]*m", "", "".join(bad.error.traceback))
    assert "return 1 // x" in plain and "<kernelexec tool fails>" in plain
    assert [o["output_type"] for o in bad.outputs] == ["error"]
    assert awaited.func_return == 7
    assert env.func_return == "set" and after.result == "False"
    assert stdin.error is not None and stdin.error.ename == "StdinNotImplementedError"
    assert slow.error is not None and slow.error.kind == "timeout"
    assert still.func_return == "B" and not still.kernel_restarted
    assert nb is not None
    calls = [c for c in nb.cells if c.metadata["kernelexec"]["kind"] == "tool_call"]
    counts = [c.execution_count for c in calls]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    assert [o["output_type"] for o in calls[0].outputs] == ["stream", "execute_result"]
    assert calls[0].outputs[1]["data"]["text/plain"] == "'A'"
    assert calls[1].outputs[0]["output_type"] == "error"


async def test_an_interrupt_reaches_a_served_call(executor: kx.AsyncKernelExecutor) -> None:
    session = await executor.session("interrupted")
    spin = kx.Tool.from_source(
        'def spin() -> None:\n    """Spin."""\n    print("spinning", flush=True)\n'
        "    while True:\n        pass\n"
    )
    started = asyncio.Event()
    call = asyncio.create_task(
        session.call_tool(spin, on_stdout=lambda text: started.set(), timeout=60)
    )
    await started.wait()
    await session.interrupt()
    result = await call
    assert result.error is not None and result.error.ename == "KeyboardInterrupt"
    assert not result.kernel_restarted
    assert (await session.call_tool(PRINTS, {"text": "after"})).func_return == "AFTER"
