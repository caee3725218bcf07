"""smolagents through ``kernelexec.compat.smolagents`` (issue 27): smolagents' own executor suite
(``CommonDockerExecutorIntegration`` from its sdist, fetched by ``make test``), and offline agent
runs with a scripted model on real kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import sys
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

smolagents = pytest.importorskip("smolagents")

from rich.console import Console  # noqa: E402
from smolagents import CodeAgent, Tool  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402
from smolagents.monitoring import AgentLogger, LogLevel  # noqa: E402
from smolagents.utils import AgentError  # noqa: E402

import kernelexec as kx  # noqa: E402
from kernelexec.compat.smolagents import KernelPythonExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / ".cache" / "suites" / f"smolagents-{metadata.version('smolagents')}" / "tests"


def _upstream() -> type:
    """smolagents' ``CommonDockerExecutorIntegration``, loaded as package ``smolagents_suite``
    (its folder is called ``tests``, like ours). Its module imports the Docker client for the
    Docker executor's tests, which do not run here: a stand-in module satisfies the import."""
    if not (SUITE / "test_remote_executors.py").exists():
        pytest.skip(f"smolagents' suite was not fetched into {SUITE} (make test fetches it)")
    sys.modules.setdefault("docker", types.ModuleType("docker"))
    spec = importlib.util.spec_from_file_location(
        "smolagents_suite", SUITE / "__init__.py", submodule_search_locations=[str(SUITE)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["smolagents_suite"] = package
    spec.loader.exec_module(package)
    module = importlib.import_module("smolagents_suite.test_remote_executors")
    return module.CommonDockerExecutorIntegration  # type: ignore[no-any-return]


def _quiet_logger() -> AgentLogger:
    return AgentLogger(LogLevel.INFO, Console(file=io.StringIO()))


try:
    CommonDockerExecutorIntegration: Any = _upstream()
except pytest.skip.Exception:
    CommonDockerExecutorIntegration = None


if CommonDockerExecutorIntegration is not None:

    class TestKernelPythonExecutorUpstreamSuite(CommonDockerExecutorIntegration):  # type: ignore[misc]
        """smolagents' own integration tests for remote executors, run on kernelexec."""

        @pytest.fixture
        def custom_executor(self) -> Any:
            executor = KernelPythonExecutor(
                additional_imports=["pillow", "numpy"], logger=_quiet_logger(), isolation="none"
            )
            yield executor
            executor.delete()

else:

    def test_upstream_suite_is_present() -> None:
        pytest.skip(f"smolagents' suite was not fetched into {SUITE} (make test fetches it)")


class ScriptedModel(Model):  # type: ignore[misc]
    """A model that answers with the next code step, as smolagents' own FakeCodeModel does."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.steps = list(steps)

    def generate(self, messages: Any, stop_sequences: Any = None, **kwargs: Any) -> ChatMessage:
        code = self.steps.pop(0)
        return ChatMessage(
            role=MessageRole.ASSISTANT, content=f"Thought: next step.\n<code>\n{code}\n</code>"
        )


class KernelPid(Tool):  # type: ignore[misc]
    name = "kernel_pid"
    description = "The process id of the Python running this tool."
    inputs: dict[str, Any] = {}
    output_type = "integer"

    def forward(self) -> int:
        import os

        return os.getpid()


def test_an_agent_keeps_its_state_across_steps_and_tools_run_in_the_kernel(
    tmp_path: Path,
) -> None:
    steps = [
        "pid = kernel_pid()\ntotal = 21\nopen('note.txt', 'w').write('mine')",
        "final_answer({'total': total * 2, 'pid': pid, 'note': open('note.txt').read()})",
    ]
    with kx.KernelExecutor(isolation="none") as ex:
        executor = KernelPythonExecutor([], _quiet_logger(), agent_id="smol-a", executor=ex)
        agent = CodeAgent(
            tools=[KernelPid()], model=ScriptedModel(steps), executor=executor, max_steps=4
        )
        answer = agent.run("Compute it.")
        agent.cleanup()
        assert answer["total"] == 42
        assert answer["note"] == "mine"
        assert answer["pid"] != __import__("os").getpid()  # the tool ran in the kernel
        assert ex.sessions == {}  # the adapter closed its session; the shared executor stays


def test_an_agent_runs_in_a_kernel_without_numpy() -> None:
    """numpy is no dependency of smolagents, but the final answer's code it sends imports it at
    its top: on a clean ``kernelexec[smolagents]`` install the docs' example failed with
    ``No module named 'numpy'`` (issue 36). The kernel here cannot import it."""
    hide = "import sys\nsys.modules['numpy'] = None  # as if it were not installed"
    with kx.KernelExecutor(isolation="none", setup_code=hide) as ex:
        executor = KernelPythonExecutor([], _quiet_logger(), agent_id="smol-np", executor=ex)
        steps = [
            "rows = [3, 4, 5]",
            "import sys\nfinal_answer([sum(rows), 'numpy' in sys.modules])",
        ]
        agent = CodeAgent(tools=[], model=ScriptedModel(steps), executor=executor, max_steps=3)
        try:
            assert agent.run("Sum the rows.") == [12, True]  # True: the None that hides it
            missing = executor._kernel.run_code("import numpy")
            assert missing.error is not None and missing.error.ename == "ModuleNotFoundError"
        finally:
            agent.cleanup()


def test_two_agents_do_not_see_each_others_state_or_files() -> None:
    with kx.KernelExecutor() as ex:  # the default isolation: a uid per kernel where possible
        one = KernelPythonExecutor([], _quiet_logger(), agent_id="smol-1", executor=ex)
        two = KernelPythonExecutor([], _quiet_logger(), agent_id="smol-2", executor=ex)
        one("secret = 'one'\nopen('secret.txt', 'w').write('one')")
        with pytest.raises(Exception, match="NameError"):
            two("print(secret)")
        session = ex.session("smol-1")
        if not session.isolation.boundaries["user"].startswith("its own"):
            pytest.skip(f"kernels share a user here: {session.isolation.boundaries['user']}")
        where = f"{session.workdir}/secret.txt"
        out = two(f"import os\nprint(os.access({where!r}, os.R_OK))")
        assert out.logs.strip() == "False"
        assert one("print(secret)").logs == "one\n"
        one.cleanup()
        two.cleanup()


def test_tools_come_back_after_the_kernel_is_replaced() -> None:
    executor = KernelPythonExecutor([], _quiet_logger(), isolation="none")
    try:
        executor.send_tools({"kernel_pid": KernelPid()})
        first = executor("print(kernel_pid())").logs
        with pytest.raises(Exception, match="kernel"):
            executor("import os; os._exit(1)")  # the kernel dies; the step's error says so
        second = executor("print(kernel_pid())").logs
        assert first.strip().isdigit() and second.strip().isdigit()
        assert first != second  # a new kernel, with the tool defined again
    finally:
        executor.cleanup()


def test_bad_construction_is_refused_clearly() -> None:
    with kx.KernelExecutor(isolation="none") as ex, pytest.raises(TypeError, match="not both"):
        KernelPythonExecutor([], _quiet_logger(), executor=ex, isolation="none")
    with pytest.raises(kx.ConfigError, match="isolaton"):
        KernelPythonExecutor([], _quiet_logger(), isolaton="none")


def test_the_model_gets_plain_tracebacks_and_what_a_death_lost() -> None:
    """Issue 36: ANSI colours went to the model, and after a kernel death it was not told
    which variables were lost."""
    executor = KernelPythonExecutor([], _quiet_logger(), isolation="none")
    try:
        executor.send_tools({"kernel_pid": KernelPid()})
        executor("rows = [1, 2]\ndef total():\n    return sum(rows) / 0")
        with pytest.raises(AgentError) as raised:
            executor("print('before')\ntotal()")
        said = str(raised.value)
        assert "\x1b" not in said
        assert said.startswith("before\n")
        assert "----> 3     return sum(rows) / 0" in said
        assert said.endswith("ZeroDivisionError: division by zero")
        with pytest.raises(AgentError) as raised:
            executor("import os\nos._exit(3)")
        assert str(raised.value).endswith(
            "(the interpreter was restarted: these variables were lost: rows, total; "
            "the tools were defined again)"
        )
        assert executor("print(kernel_pid())").logs.strip().isdigit()
    finally:
        executor.cleanup()
