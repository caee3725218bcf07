"""openai-agents Sandbox Agents through ``kernelexec.compat.openai_agents`` (issue 27). The SDK
ships no conformance suite for sandbox clients: these runs use its scripted model
(``agents.testing.ScriptedModel``) on real kernels.
"""

from __future__ import annotations

import io
import os
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
from agents.sandbox.errors import ExecTimeoutError, WorkspaceReadNotFoundError
from agents.testing import ScriptedModel, assistant_message, function_call

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
        assert int(outputs[1]) != os.getpid()
        assert outputs[2] == "42" and "42" in outputs[3]
    finally:
        await client.aclose()
    assert not [a for a in executor.sessions if a.startswith("openai-agents-")]


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
