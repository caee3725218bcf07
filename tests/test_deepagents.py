"""deepagents through ``kernelexec.compat.deepagents`` (issue 27): LangChain's standard sandbox
suite (``SandboxIntegrationTests`` from langchain-tests) against :class:`KernelSandbox`, and
offline agent runs with ``GenericFakeChatModel`` on real kernels.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("deepagents")
pytest.importorskip("langchain_tests.integration_tests")

from deepagents import create_deep_agent
from deepagents.backends.protocol import ExecuteResponse
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_tests.integration_tests import SandboxIntegrationTests

import kernelexec as kx
from kernelexec.compat.deepagents import KernelSandbox
from tests.support.deadlines import after_output

RUN = uuid.uuid4().hex[:12]

# Cases that fail the same way for a plain host-subprocess BaseSandbox (checked 2026-12-04: a
# 20-line BaseSandbox running `bash -c` on the host fails exactly these 7). The suite,
# langchain-tests 1.1.9, is older than deepagents 0.7.32: glob now returns absolute paths where
# these expect paths relative to the search root, and write() now overwrites an existing file
# (documented as "creating it or overwriting it") where test_write_existing_file_fails expects
# an error. They run as strict xfails: a change upstream or in the adapter that makes one pass
# fails the run, so the list is mended rather than left to hide a case.
GLOB_SKEW = "deepagents' glob returns absolute paths; this suite expects them relative to the root"
WRITE_SKEW = "deepagents' write() overwrites an existing file; this suite expects an error"
SKEW = {
    "test_glob": GLOB_SKEW,
    "test_glob_basic_pattern": GLOB_SKEW,
    "test_glob_with_directories": GLOB_SKEW,
    "test_glob_hidden_files_explicitly": GLOB_SKEW,
    "test_glob_with_character_class": GLOB_SKEW,
    "test_glob_with_question_mark": GLOB_SKEW,
    "test_write_existing_file_fails": WRITE_SKEW,
}


class TestKernelSandboxStandard(SandboxIntegrationTests):  # type: ignore[misc]
    """LangChain's standard tests for sandbox backends, on one kernel (``executor`` is the
    module's shared executor from conftest). The suite's default root, ``/tmp/test_sandbox_ops/``,
    is shared by every run on the host, and each kernel at ``"process"`` has its own uid: a root
    unique to this run keeps runs from colliding."""

    # Its async cases run on anyio's plugin (pytest-asyncio stays in strict mode for the rest
    # of the suite); its class-scoped fixtures are instance methods, which pytest 9 warns about.
    pytestmark = [
        pytest.mark.anyio,
        pytest.mark.filterwarnings("ignore::pytest.PytestRemovedIn10Warning"),
    ]

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @property
    def sandbox_root_dir(self) -> str:
        return f"/tmp/kernelexec-deepagents-suite-{RUN}/"

    @pytest.fixture(scope="class")
    @classmethod
    def sandbox(cls, executor: kx.KernelExecutor) -> Iterator[KernelSandbox]:
        sandbox = KernelSandbox(executor=executor, timeout=120)
        yield sandbox
        sandbox.execute(f"rm -rf /tmp/kernelexec-deepagents-suite-{RUN}/")
        sandbox.close()

    @pytest.fixture(autouse=True)
    def _skew(self, request: pytest.FixtureRequest) -> None:
        reason = SKEW.get(request.node.name)
        if reason is not None:
            request.applymarker(
                pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)
            )


class ToolModel(GenericFakeChatModel):  # type: ignore[misc]
    """``GenericFakeChatModel`` that accepts tools (deepagents binds its own)."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ToolModel:
        return self


def _call(name: str, args: dict[str, Any], n: int) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"c{n}"}])


def _tool_outputs(state: dict[str, Any]) -> list[str]:
    return [str(m.content) for m in state["messages"] if isinstance(m, ToolMessage)]


def test_agent_state_carries_from_step_to_step_in_one_kernel(executor: kx.KernelExecutor) -> None:
    """A file the first command writes and a variable the Python tool sets are used by later
    steps; the shell, deepagents' file tools and Python share the kernel's directory."""
    sandbox = KernelSandbox(executor=executor)
    try:
        root = sandbox.working_dir()
        model = ToolModel(
            messages=iter(
                [
                    _call("execute", {"command": "echo 6 > n.txt && id -u"}, 0),
                    _call("python", {"code": "n = int(open('n.txt').read()) * 7\nn"}, 1),
                    _call("python", {"code": "open('out.txt', 'w').write(str(n)); print(n)"}, 2),
                    _call("read_file", {"file_path": f"{root}/out.txt"}, 3),
                    _call("execute", {"command": "cat out.txt; exit 3"}, 4),
                    AIMessage(content="done"),
                ]
            )
        )
        agent = create_deep_agent(model=model, backend=sandbox, tools=[sandbox.python_tool()])
        state = agent.invoke({"messages": [{"role": "user", "content": "go"}]})
        outputs = _tool_outputs(state)
        assert state["messages"][-1].content == "done"
        assert outputs[1] == "42\n(variables added n)" and outputs[2] == "42"
        assert "42" in outputs[3]
        assert "42" in outputs[4] and "exit code 3" in outputs[4].lower().replace("_", " ")
        got = sandbox.download_files([f"{root}/n.txt", f"{root}/missing", "rel.txt"])
        assert [(r.content, r.error) for r in got] == [
            (b"6\n", None),
            (None, "file_not_found"),
            (None, "invalid_path"),
        ]
    finally:
        sandbox.close()


def test_two_agents_see_neither_files_nor_state_of_the_other(executor: kx.KernelExecutor) -> None:
    a = KernelSandbox(agent_id="da-a", executor=executor)
    b = KernelSandbox(agent_id="da-b", executor=executor)
    try:
        assert a.execute("echo secret > mine.txt").exit_code == 0
        a.python_tool().invoke({"code": "token = 'only-a'"})
        assert a.working_dir() != b.working_dir()
        theirs = f"{a.working_dir()}/mine.txt"
        assert b.execute("cat mine.txt").exit_code != 0
        assert b.download_files([theirs])[0].content is None
        assert "NameError" in b.python_tool().invoke({"code": "token"})
        assert a.python_tool().invoke({"code": "token"}) == "'only-a'"
    finally:
        a.close()
        b.close()
    assert "da-a" not in executor.sessions


def test_timeouts_outputs_and_paths_outside_the_working_dir(executor: kx.KernelExecutor) -> None:
    sandbox = KernelSandbox(executor=executor)
    outside = f"/tmp/kernelexec-deepagents-{uuid.uuid4().hex[:8]}"
    try:

        def attempt(timeout: float) -> ExecuteResponse:
            slow = sandbox.execute("echo started; sleep 60", timeout=int(timeout))
            assert slow.exit_code == 124
            return slow

        slow, _ = after_output(attempt, lambda r: r.output.startswith("started"))
        assert slow.output.startswith("started\n")
        mixed = sandbox.execute("echo out; echo err >&2; echo out2")
        assert (mixed.output, mixed.exit_code) == ("out\nerr\nout2\n", 0)
        up = sandbox.upload_files([(f"{outside}/d/f.bin", bytes(range(256)))])
        assert up[0].error is None
        down = sandbox.download_files([f"{outside}/d/f.bin", f"{outside}/d", f"{outside}/no"])
        assert [(r.content, r.error) for r in down] == [
            (bytes(range(256)), None),
            (None, "is_directory"),
            (None, "file_not_found"),
        ]
        assert ".kernelexec" not in sandbox.execute("ls -A").output
    finally:
        sandbox.execute(f"rm -rf {outside}")
        sandbox.close()


def test_an_owned_executor_is_closed_with_the_sandbox() -> None:
    sandbox = KernelSandbox(isolation="none")
    assert sandbox.execute("printf hi").output == "hi"
    ex = sandbox._kernel.executor
    sandbox.close()
    with pytest.raises(kx.ExecutorClosedError):
        ex.session("x").run_code("1")


def test_the_model_gets_plain_tracebacks_its_directory_and_what_was_lost(
    executor: kx.KernelExecutor,
) -> None:
    """Issue 36: the error's last line only, with ANSI colours elsewhere; no word of the
    working directory (the model wrote ``/notes.md`` and was refused); a raw docstring."""
    sandbox = KernelSandbox(executor=executor)
    try:
        tool = sandbox.python_tool()
        root = sandbox.working_dir()
        assert tool.description.startswith("Run Python code in a persistent interpreter")
        assert "\n" not in tool.description and "  " not in tool.description
        assert f"The working directory is {root}" in tool.description
        assert f"{root}/notes.md" in sandbox.system_prompt()
        tool.invoke({"code": "keep = 1"})
        said = tool.invoke({"code": "def f():\n    return 1 / 0\nf()"})
        assert "\x1b" not in said
        assert "----> 3 f()" in said and "----> 2     return 1 / 0" in said
        assert said.endswith("ZeroDivisionError: division by zero\n(variables added f)")
        died = tool.invoke({"code": "import os\nos._exit(3)"})
        assert died.endswith("(the interpreter was restarted: these variables were lost: keep)")
    finally:
        sandbox.close()
