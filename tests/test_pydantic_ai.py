"""pydantic-ai through ``kernelexec.compat.pydantic_ai`` (issue 27): pydantic-ai's own workspace
conformance suite (``WorkspaceBackendSuite``, shipped in its wheel) against
:class:`KernelWorkspace`, and offline agent runs with ``FunctionModel`` on real kernels.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("pydantic_ai.workspaces.conformance")

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.workspaces import (
    Workspace,
    WorkspaceBackend,
    WorkspaceRef,
    WorkspaceUnavailableError,
)
from pydantic_ai.workspaces.conformance import WorkspaceBackendSuite

import kernelexec as kx
from kernelexec.compat.pydantic_ai import KernelWorkspace

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class TestKernelWorkspaceConformance(WorkspaceBackendSuite):
    """pydantic-ai's own rules for workspace backends. Skipped by the suite itself: the
    ``SupportsRealpath`` rule (optional protocol, not implemented; ``Workspace`` resolves
    paths through the shell instead)."""

    @pytest.fixture
    async def backend(self, executor: kx.KernelExecutor) -> AsyncIterator[WorkspaceBackend]:
        workspace = KernelWorkspace(executor=executor)
        yield workspace
        await workspace.aclose()

    @pytest.fixture
    def fresh_backend(
        self, executor: kx.KernelExecutor
    ) -> Iterator[Callable[[], WorkspaceBackend]]:
        made: list[KernelWorkspace] = []

        def fresh() -> WorkspaceBackend:
            made.append(KernelWorkspace(executor=executor))
            return made[-1]

        yield fresh
        for workspace in made:
            workspace.close()

    @pytest.fixture
    def attach_backend(
        self, executor: kx.KernelExecutor
    ) -> Callable[[WorkspaceRef], WorkspaceBackend]:
        return lambda ref: KernelWorkspace.attach(ref, executor)

    @pytest.fixture
    def destroy_environment(self) -> Callable[[WorkspaceBackend], Awaitable[None]]:
        async def destroy(backend: WorkspaceBackend) -> None:
            assert isinstance(backend, KernelWorkspace)
            await backend.aclose()

        return destroy


def _script(*steps: list[Any]) -> FunctionModel:
    """A model that answers with each step in turn: tool calls ``(name, args)`` or final text."""
    queue = list(steps)

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        step = queue.pop(0)
        if isinstance(step, str):
            return ModelResponse(parts=[TextPart(step)])
        return ModelResponse(
            parts=[ToolCallPart(name, args, tool_call_id=f"c{i}") for i, (name, args) in step]
        )

    return FunctionModel(respond)


def _returns(messages: list[ModelMessage]) -> list[Any]:
    return [
        part.content
        for message in messages
        for part in getattr(message, "parts", [])
        if isinstance(part, ToolReturnPart)
    ]


def _shell_agent(model: FunctionModel) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(model)

    @agent.tool
    async def sh(ctx: RunContext[None], command: str) -> str:
        """Run a shell command in the workspace."""
        assert ctx.workspace is not None
        result = await ctx.workspace.run(command, shell=True)
        return f"{result.exit_code}:{result.stdout}{result.stderr}"

    return agent


async def test_agent_state_carries_from_step_to_step_in_one_kernel() -> None:
    """A file the first step's command writes, and a variable its Python sets, are used by the
    next steps; commands and Python share the kernel's directory and process."""
    model = _script(
        [(0, ("sh", {"command": "echo 6 > n.txt; echo $$ > shell.pid"}))],
        [(0, ("python", {"code": "import os\nn = int(open('n.txt').read()) * 7\nos.getpid()"}))],
        [(0, ("python", {"code": "print(n)"})), (1, ("sh", {"command": "cat n.txt"}))],
        "done",
    )
    workspace = KernelWorkspace(isolation="none")
    try:
        agent = _shell_agent(model)
        result = await agent.run("go", workspace=workspace, toolsets=[workspace.toolset()])
        assert result.output == "done"
        returns = _returns(result.all_messages())
        assert returns[0] == "0:"
        pid_line, state = returns[1].splitlines()
        assert state == "(variables added n, os)"  # one line on what the step bound
        kernel_pid = int(pid_line)
        assert kernel_pid != os.getpid()
        assert returns[2:] == ["42", "0:6\n"]
        shell_parent = await workspace.run(["sh", "-c", "ps -o ppid= -p $(cat shell.pid) || true"])
        assert shell_parent.exit_code == 0
        assert workspace.ref == WorkspaceRef(provider="kernelexec", id=workspace.agent_id)
        root = await workspace.working_dir()
        assert posixpath.isabs(root)
        assert await Workspace(workspace).read_text(posixpath.join(root, "n.txt")) == "6\n"
    finally:
        await workspace.aclose()
    with pytest.raises(WorkspaceUnavailableError):
        await workspace.run(["true"])


async def test_two_agents_see_neither_files_nor_state_of_the_other(
    executor: kx.KernelExecutor,
) -> None:
    a = KernelWorkspace(agent_id="pa-a", executor=executor)
    b = KernelWorkspace(agent_id="pa-b", executor=executor)
    try:
        await a.run("echo secret > mine.txt", shell=True)
        await a.run_python("token = 'only-a'")
        assert await a.working_dir() != await b.working_dir()
        assert (await b.run(["cat", "mine.txt"])).exit_code != 0
        seen = await b.run_python("token")
        assert seen.error is not None and seen.error.ename == "NameError"
        assert (await a.run_python("token")).result == "'only-a'"
    finally:
        await a.aclose()
        await b.aclose()
    assert "pa-a" not in executor.sessions and "pa-b" not in executor.sessions


async def test_python_errors_reach_the_model_and_timeouts_interrupt(
    executor: kx.KernelExecutor,
) -> None:
    workspace = KernelWorkspace(executor=executor)
    try:
        tool = workspace.toolset(timeout=1)
        model = _script(
            [(0, ("python", {"code": "x = 1\n1 / 0"}))],
            [(0, ("python", {"code": "import time\ntime.sleep(60)"}))],
            [(0, ("python", {"code": "x + 1"}))],
            "ok",
        )
        result = await Agent(model, toolsets=[tool]).run("go", workspace=workspace)
        returns = _returns(result.all_messages())
        # The whole traceback, plain (issue 36: the last line only, no line number), and what
        # the run bound (issue 38).
        assert "\x1b" not in returns[0]
        assert "----> 2 1 / 0" in returns[0]
        assert returns[0].endswith("ZeroDivisionError: division by zero\n(variables added x)")
        assert "imeout" in returns[1] or "KeyboardInterrupt" in returns[1], returns[1]
        assert returns[2] == "2"  # an interrupt keeps the kernel and its variables
    finally:
        await workspace.aclose()


async def test_an_async_executor_on_the_same_loop_is_shared() -> None:
    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        workspace = KernelWorkspace(executor=ex)
        result = await workspace.run(["sh", "-c", "printf hi; exit 3"])
        assert (result.exit_code, result.stdout) == (3, "hi")
        await workspace.aclose()
        assert workspace.agent_id not in ex.sessions


async def test_an_async_executor_not_started_yet_starts_on_first_use() -> None:
    """As everywhere in the core API (issue 36: the adapters refused it)."""
    ex = kx.AsyncKernelExecutor(isolation="none")
    try:
        workspace = KernelWorkspace(executor=ex)
        result = await workspace.run(["sh", "-c", "printf hi"])
        assert (result.exit_code, result.stdout) == (0, "hi")
        assert ex.loop is not None and workspace.agent_id in ex.sessions
        await workspace.aclose()
    finally:
        await ex.aclose()


def test_building_does_nothing_and_bad_settings_are_refused() -> None:
    workspace = KernelWorkspace(isolation="none")
    assert workspace.ref is None
    assert not workspace._kernel.started and workspace._kernel._executor is None
    workspace.close()
    with pytest.raises(kx.ConfigError, match="isolaton"):
        KernelWorkspace(isolaton="none")
    with kx.KernelExecutor(isolation="none") as ex, pytest.raises(TypeError, match="not both"):
        KernelWorkspace(executor=ex, isolation="none")


async def test_new_files_inside_the_working_dir_move_through_session_files(
    executor: kx.KernelExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads, and writes of new files, in the working directory never touch the shell path;
    an existing file, or one outside the directory, does."""
    workspace = KernelWorkspace(executor=executor)
    try:
        root = await workspace.working_dir()
        data = bytes(range(256)) * 40_000  # 10 MB, binary
        shell = workspace._shell

        def refuse() -> Any:
            raise AssertionError("went through the shell")

        monkeypatch.setattr(workspace, "_shell", refuse)
        await workspace.write_bytes(f"{root}/sub/big.bin", data)
        assert await workspace.read_bytes(f"{root}/sub/big.bin") == data
        with pytest.raises(AssertionError, match="shell"):
            await workspace.write_bytes(f"{root}/sub/big.bin", b"again")
        with pytest.raises(AssertionError, match="shell"):
            await workspace.read_bytes("/etc/hostname")
        monkeypatch.setattr(workspace, "_shell", shell)
        await workspace.write_bytes(f"{root}/sub/big.bin", b"again")
        assert await workspace.read_bytes(f"{root}/sub/big.bin") == b"again"
    finally:
        await workspace.aclose()
