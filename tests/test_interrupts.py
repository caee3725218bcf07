"""Interrupts that reach a run before its code starts.

ipykernel ignores SIGINT between shell requests and installs the default handler as a request's
handler starts; until the cell's code runs, a KeyboardInterrupt lands in set-up code (input
transformers, ``pre_execute`` callbacks) where IPython catches and prints it, and the code then
runs to its deadline. Each test sends the interrupt in one of those gaps and asserts that the
run ends with ``KeyboardInterrupt``, well before its deadline, with the kernel's state kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

import kernelexec as kx

SPIN = "while True: pass"
DEADLINE = 120.0  # a lost interrupt shows as this deadline's TimeoutError

pytestmark = pytest.mark.anyio


@pytest.fixture
async def executor() -> AsyncIterator[kx.AsyncKernelExecutor]:
    async with kx.AsyncKernelExecutor(default_timeout=60) as ex:
        yield ex


def _interrupted(result: kx.Execution) -> None:
    assert result.error is not None, result
    assert (result.error.kind, result.error.ename) == ("exception", "KeyboardInterrupt"), result


async def _spin_and_interrupt_once_set_up(session: kx.AsyncSession) -> kx.Execution:
    """Run the spin loop; interrupt it once the set-up code has printed (it then sleeps)."""
    reached = asyncio.Event()
    run = asyncio.ensure_future(
        session.run_code(SPIN, timeout=DEADLINE, on_stdout=lambda text: reached.set())
    )
    await reached.wait()
    await session.interrupt()
    return await run


async def test_an_interrupt_during_a_slow_pre_execute_callback_stops_the_code(
    executor: kx.AsyncKernelExecutor,
) -> None:
    session = await executor.session("slow-hook")
    await session.run_code(
        "import time\nx = 1\n"
        "def slow():\n    print('setting up', flush=True)\n    time.sleep(2)\n"
        "get_ipython().events.register('pre_execute', slow)"
    )
    _interrupted(await _spin_and_interrupt_once_set_up(session))
    await session.run_code("get_ipython().events.unregister('pre_execute', slow)")
    assert (await session.run_code("x")).result == "1"  # interrupted, state kept


async def test_an_interrupt_during_a_slow_input_transformer_stops_the_code(
    executor: kx.AsyncKernelExecutor,
) -> None:
    session = await executor.session("slow-transformer")
    await session.run_code(
        "import time\nx = 1\n"
        "def slow(lines):\n    print('transforming', flush=True)\n    time.sleep(2)\n"
        "    return lines\n"
        "get_ipython().input_transformers_post.append(slow)"
    )
    _interrupted(await _spin_and_interrupt_once_set_up(session))
    await session.run_code("get_ipython().input_transformers_post.remove(slow)")
    assert (await session.run_code("x")).result == "1"


async def test_an_interrupt_sent_as_soon_as_the_run_is_sent_stops_the_code(
    executor: kx.AsyncKernelExecutor,
) -> None:
    # The interrupt follows the request at once, so the kernel is still reading its queue
    # (SIGINT ignored) or setting the run up: lost 6 of 6 before the host held it until the
    # run's execute_input and the kernel held it until the code starts.
    session = await executor.session("at-once")
    await session.run_code("x = 1")
    for _ in range(10):
        run = asyncio.ensure_future(session.run_code(SPIN, timeout=DEADLINE))
        await asyncio.sleep(0)  # the run's request goes out in its first step
        await session.interrupt()
        _interrupted(await run)
    assert (await session.run_code("x")).result == "1"


async def test_an_interrupt_while_the_sessions_kernel_starts_stops_the_code(
    executor: kx.AsyncKernelExecutor,
) -> None:
    # The run waits for its kernel to start: there is no kernel to signal yet, and the
    # interrupt was dropped (the code then ran to its deadline). The run now takes it along.
    session = await executor.session("cold")
    run = asyncio.ensure_future(session.run_code(SPIN, timeout=DEADLINE))
    await asyncio.sleep(0)  # the run starts, and waits for its kernel
    assert not session.has_kernel
    await session.interrupt()
    _interrupted(await run)
    assert (await session.run_code("'kept'")).result == "'kept'"


async def test_an_interrupt_before_setup_code_stops_the_setup_and_the_call_does_not_run(
    executor: kx.AsyncKernelExecutor,
) -> None:
    session = await executor.session("cold-setup", setup_code=SPIN)
    run = asyncio.ensure_future(session.run_code("ran = True", timeout=DEADLINE))
    await asyncio.sleep(0)  # the run starts, and waits for its kernel
    assert not session.has_kernel
    await session.interrupt()
    result = await run
    assert result.error is not None, result
    assert (result.error.kind, result.error.ename) == ("setup_failed", "KeyboardInterrupt")
    assert "setup_code raised KeyboardInterrupt" in result.error.evalue


async def test_a_tool_call_interrupted_in_its_set_up_stops(
    executor: kx.AsyncKernelExecutor,
) -> None:
    session = await executor.session("tool-slow-hook")
    await session.run_code(
        "import time\n"
        "def slow():\n    print('setting up', flush=True)\n    time.sleep(2)\n"
        "get_ipython().events.register('pre_execute', slow)"
    )
    spin = kx.Tool.from_source(
        'def spin() -> None:\n    """Spin."""\n    while True:\n        pass\n'
    )
    reached = asyncio.Event()
    call = asyncio.ensure_future(
        session.call_tool(spin, timeout=DEADLINE, on_stdout=lambda text: reached.set())
    )
    await reached.wait()
    await session.interrupt()
    result = await call
    _interrupted(result)
