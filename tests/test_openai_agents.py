"""openai-agents Sandbox Agents through ``kernelexec.compat.openai_agents`` (issue 27). The SDK
ships no conformance suite for sandbox clients: these runs use its scripted model
(``agents.testing.ScriptedModel``) on real kernels.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents.sandbox")

from agents import Runner, set_tracing_disabled
from agents.items import ToolCallOutputItem
from agents.run_config import RunConfig, SandboxRunConfig
from agents.sandbox import Manifest, SandboxAgent
from agents.sandbox.capabilities import Capabilities
from agents.sandbox.entries import File
from agents.sandbox.errors import (
    ExecTimeoutError,
    PtySessionNotFoundError,
    WorkspaceReadNotFoundError,
)
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.testing.model import ModelCall, ModelStep

import kernelexec as kx
from kernelexec.compat.openai_agents import (
    KernelPython,
    KernelSandboxClient,
    KernelSandboxClientOptions,
)

pytestmark = pytest.mark.anyio

set_tracing_disabled(True)  # no trace export (it would need an API key and the network)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _calls(*steps: tuple[str, dict[str, Any]] | str) -> ScriptedModel:
    items: list[Any] = []
    for n, step in enumerate(steps):
        if isinstance(step, str):
            items.append([assistant_message(step)])
        else:
            items.append([function_call(step[0], step[1], call_id=f"c{n}")])
    return ScriptedModel(items)


def _outputs(result: Any) -> list[str]:
    return [str(i.output) for i in result.new_items if isinstance(i, ToolCallOutputItem)]


async def test_agent_state_carries_from_step_to_step_in_one_kernel(
    executor: kx.KernelExecutor,
) -> None:
    """A manifest file, a file a command writes and a variable the python tool sets are all
    used by later steps: commands and Python share the kernel's directory and process."""
    client = KernelSandboxClient(executor=executor)
    agent = SandboxAgent(
        name="kx",
        model=_calls(
            ("exec_command", {"cmd": "cat seed.txt; echo 6 > n.txt; id -u"}),
            ("python", {"code": "import os\nn = int(open('n.txt').read()) * 7\nos.getpid()"}),
            ("python", {"code": "open('out.txt', 'w').write(str(n)); print(n)"}),
            ("exec_command", {"cmd": "cat out.txt"}),
            "done",
        ),
        instructions="test",
        default_manifest=Manifest(entries={"seed.txt": File(content=b"seeded\n")}),
        capabilities=[*Capabilities.default(), KernelPython()],
    )
    try:
        result = await Runner.run(
            agent, "go", run_config=RunConfig(sandbox=SandboxRunConfig(client=client))
        )
        assert result.final_output == "done"
        outputs = _outputs(result)
        assert "seeded" in outputs[0]
        if os.geteuid() == 0 and executor.config.isolation == "process":
            assert f"\n{os.geteuid()}\n" not in outputs[0]  # the kernel's own uid, not root
        assert outputs[1].splitlines()[1] == "(variables added n, os)"
        assert int(outputs[1].splitlines()[0]) != os.getpid()
        assert outputs[2] == "42" and "42" in outputs[3]
    finally:
        await client.aclose()
    assert not [a for a in executor.sessions if a.startswith("openai-agents-")]


async def test_a_command_longer_than_its_yield_goes_on_and_a_later_command_reads_it(
    executor: kx.KernelExecutor,
) -> None:
    """The model's ``exec_command`` waits ``yield_time_ms`` for a command; one that takes
    longer goes on running (as in the SDK's own local sandbox), the model gets a session id,
    reads the rest with ``write_stdin`` and a later command sees what it wrote."""

    def poll_the_running_command(call: ModelCall) -> ModelStep:
        said = str(call.input[-1]["output"])
        found = re.search(r"Process running with session ID (\d+)", said)
        assert found, said
        args = {"session_id": int(found.group(1)), "chars": "", "yield_time_ms": 30_000}
        return ModelStep(output=[function_call("write_stdin", args, call_id="c1")])

    client = KernelSandboxClient(executor=executor)
    agent = SandboxAgent(
        name="kx",
        model=ScriptedModel(
            [
                [
                    function_call(
                        "exec_command",
                        {
                            "cmd": "echo begun; sleep 3; echo late > late.txt; echo finished",
                            "yield_time_ms": 1000,
                        },
                        call_id="c0",
                    )
                ],
                ModelStep.respond(poll_the_running_command),
                [function_call("exec_command", {"cmd": "cat late.txt"}, call_id="c2")],
                [assistant_message("done")],
            ]
        ),
        instructions="test",
        capabilities=Capabilities.default(),
    )
    try:
        result = await Runner.run(
            agent, "go", run_config=RunConfig(sandbox=SandboxRunConfig(client=client))
        )
        started, polled, read = _outputs(result)
        assert "Process running with session ID" in started, started
        assert started.endswith("begun\n") and "finished" not in started
        assert "Process exited with code 0" in polled and polled.endswith("finished\n")
        assert "begun" not in polled  # each output is shown once
        assert "Process exited with code 0" in read and read.endswith("late\n")
    finally:
        await client.aclose()


async def test_a_running_command_takes_no_input_and_goes_with_its_session(
    executor: kx.KernelExecutor,
) -> None:
    client = KernelSandboxClient(executor=executor)
    try:
        session = await client.create()
        async with session:
            started = await session.pty_exec_start("sleep 60; echo never", yield_time_s=0.3)
            assert started.exit_code is None and started.process_id is not None
            with pytest.raises(RuntimeError, match="read no input"):
                await session.pty_write_stdin(session_id=started.process_id, chars="y\n")
            with pytest.raises(PtySessionNotFoundError):
                await session.pty_write_stdin(session_id=started.process_id + 1, chars="")
            inner = session._inner
            command = inner._processes[started.process_id].command
            await session.pty_terminate_all()
            assert await kx_wait(inner, command) == -9
            with pytest.raises(PtySessionNotFoundError):
                await session.pty_write_stdin(session_id=started.process_id, chars="")
    finally:
        await client.aclose()


async def kx_wait(inner: Any, command: Any) -> int | None:
    """Wait, on the session's loop, for a background command to end; its exit code."""
    return int(await inner.kernel.acall(lambda _: command.wait(30)))


async def test_two_agents_see_neither_files_nor_state_of_the_other(
    executor: kx.KernelExecutor,
) -> None:
    client = KernelSandboxClient(executor=executor)
    try:
        a = await client.create(options=KernelSandboxClientOptions(agent_id="oa-a"))
        b = await client.create(options=KernelSandboxClientOptions(agent_id="oa-b"))
        async with a, b:
            await a.write(Path("mine.txt"), io.BytesIO(b"secret"))
            assert (await a.read(Path("mine.txt"))).read() == b"secret"
            assert a.state.manifest.root != b.state.manifest.root
            with pytest.raises(WorkspaceReadNotFoundError):
                await b.read(Path("mine.txt"))
            theirs = f"{a.state.manifest.root}/mine.txt"
            assert (await b.exec("cat", theirs)).exit_code != 0
            assert a.state.snapshot.id != b.state.snapshot.id
            kernel_a, kernel_b = a._inner.kernel, b._inner.kernel
            await kernel_a.acall(lambda s: s.run_code("token = 'only-a'"))
            missing = await kernel_b.acall(lambda s: s.run_code("token"))
            assert missing.error is not None and missing.error.ename == "NameError"
    finally:
        await client.aclose()
    assert "oa-a" not in executor.sessions and "oa-b" not in executor.sessions


async def test_timeouts_bytes_and_snapshots(executor: kx.KernelExecutor) -> None:
    client = KernelSandboxClient(executor=executor)
    try:
        session = await client.create()
        async with session:
            with pytest.raises(ExecTimeoutError):
                await session.exec("sleep 60", timeout=1)
            raw = await session.exec("printf", "\\377\\000x", shell=False)
            assert (raw.exit_code, raw.stdout) == (0, b"\xff\x00x")
            failed = await session.exec("echo oops >&2; exit 5")
            assert (failed.exit_code, failed.stderr) == (5, b"oops\n")
            await session.write(Path("d/keep.txt"), io.BytesIO(b"kept"))
            with await session.persist_workspace() as packed:  # a temporary file: closed
                archive = packed.read()
            await session.exec("rm -rf d")
            await session.hydrate_workspace(io.BytesIO(archive))
            assert (await session.read(Path("d/keep.txt"))).read() == b"kept"
            assert (await session.exec("ls -A")).stdout.split() == [b"d"]
    finally:
        await client.aclose()


def test_an_owned_executor_is_closed_with_the_client() -> None:
    import asyncio

    client = KernelSandboxClient(isolation="none")

    async def go() -> Any:
        session = await client.create()
        result = await session.exec("printf hi")
        await client.aclose()
        return result

    assert asyncio.run(go()).stdout == b"hi"
    with pytest.raises(kx.ConfigError, match="isolaton"):
        KernelSandboxClient(isolaton="none")


async def test_an_async_executor_not_started_yet_starts_on_first_use() -> None:
    ex = kx.AsyncKernelExecutor(isolation="none")
    client = KernelSandboxClient(executor=ex)
    try:
        session = await client.create()
        async with session:
            assert (await session.exec("printf hi")).stdout == b"hi"
    finally:
        await client.aclose()
        await ex.aclose()


async def test_the_python_tool_gives_the_whole_plain_traceback_and_what_was_lost(
    executor: kx.KernelExecutor,
) -> None:
    """Issue 36: the model got the error's last line only (no line number)."""
    client = KernelSandboxClient(executor=executor)
    agent = SandboxAgent(
        name="kx",
        model=_calls(
            ("python", {"code": "keep = 1\ndef f():\n    return 1 / 0"}),
            ("python", {"code": "f()"}),
            ("python", {"code": "import os\nos._exit(3)"}),
            "done",
        ),
        instructions="test",
        capabilities=[*Capabilities.default(), KernelPython()],
    )
    try:
        result = await Runner.run(
            agent, "go", run_config=RunConfig(sandbox=SandboxRunConfig(client=client))
        )
        outputs = _outputs(result)
        assert "\x1b" not in outputs[1]
        assert "----> 1 f()" in outputs[1] and "----> 3     return 1 / 0" in outputs[1]
        assert outputs[1].endswith("ZeroDivisionError: division by zero")
        assert outputs[2].endswith(
            "(the interpreter was restarted: these variables were lost: f, keep)"
        )
    finally:
        await client.aclose()
