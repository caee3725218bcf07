"""Conformance: ``AsyncToolSandboxKernel`` driven exactly as Letta's callers drive its local
sandbox, with tools shaped like those of Letta's own sandbox tests, asserting Letta's values."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kernelexec as kx
from kernelexec._sandbox._users import is_root
from kernelexec.compat import letta
from kernelexec.compat._letta_config import read_sandbox_config
from kernelexec.compat.letta import AsyncToolSandboxKernel, ToolExecutionResult
from tests.conftest import kernel_children
from tests.support import letta_tools as tools
from tests.support.deadlines import DEADLINES
from tests.support.letta_models import (
    AgentEnvironmentVariable,
    AgentState,
    LocalSandboxConfig,
    PipRequirement,
    SandboxConfig,
    User,
    agent,
    create_tool_from_func,
)
from tests.support.wheels import make_wheel

ROOT = str(Path(__file__).resolve().parent.parent)
USER = User()

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def executor() -> Iterator[None]:
    """The process-wide executor, shared by this module's tests (named like conftest's shared
    executor, so the leak check runs when it shuts down rather than after each test)."""
    before = kernel_children()
    # The kernels can import tests.support.letta_models.
    letta.configure(env_vars={"PYTHONPATH": ROOT})
    yield
    letta.shutdown()
    letta.configure()
    assert not kernel_children() - before, "the Letta executor left kernels running"


async def run(
    fn: Any,
    args: dict[str, Any] | None = None,
    agent_state: AgentState | None = None,
    **kwargs: Any,
) -> tuple[ToolExecutionResult, AsyncToolSandboxKernel]:
    tool = create_tool_from_func(fn, pip_requirements=kwargs.pop("pip_requirements", None))
    additional = kwargs.pop("additional_env_vars", None)
    sandbox = AsyncToolSandboxKernel(
        tool.name, args or {}, USER, tool_id=tool.id, tool_object=tool, **kwargs
    )
    result = await sandbox.run(agent_state=agent_state, additional_env_vars=additional)
    return result, sandbox


def letta_fingerprint(kind: str, org: str | None, config: dict[str, Any]) -> str:
    text = json.dumps(
        {"type": kind, "organization_id": org, "config": config},
        sort_keys=True,
        separators=(",", ":"),
    )
    return str(int.from_bytes(hashlib.sha256(text.encode()).digest(), "big"))


DEFAULT_PRINT = letta_fingerprint(
    "local",
    USER.organization_id,
    {
        "sandbox_dir": os.path.join(os.path.expanduser("~"), ".letta", "tool_execution_dir"),
        "use_venv": False,
        "venv_name": "venv",
        "pip_requirements": [],
    },
)


# What Letta itself computes: ``SandboxConfig(type=LOCAL, organization_id=..., config=...)
# .fingerprint()`` in a venv of letta==0.11.7 (uv, --exclude-newer 2025-09-05), on 2026-12-05;
# the second config is ``LocalSandboxConfig(...).model_dump(exclude_none=True)`` there.
LETTA_PRINTS = [
    (
        "org-1",
        {
            "sandbox_dir": "/srv/agents/tools",
            "use_venv": False,
            "venv_name": "venv",
            "pip_requirements": [],
        },
        "18212736147508100954062029718740307472325353736112026547164628004760121380739",
    ),
    (
        None,
        {
            "sandbox_dir": "/srv/agents/tools",
            "use_venv": True,
            "venv_name": "venv",
            "pip_requirements": [{"name": "numpy", "version": "2.0.0"}, {"name": "kxtqdm"}],
        },
        "115579338148932311964781696374452986939544694193267008496593228884103372034989",
    ),
]


@pytest.mark.parametrize(("org", "config", "printed"), LETTA_PRINTS)
def test_fingerprints_are_the_ones_letta_computes(
    org: str | None, config: dict[str, Any], printed: str
) -> None:
    sandbox_config = SandboxConfig(organization_id=org, config=config)
    assert read_sandbox_config(sandbox_config, USER).fingerprint == printed
    assert letta_fingerprint("local", org, config) == printed  # the other tests' helper


@pytest.mark.parametrize("fn", [tools.add, tools.async_add])
async def test_default_sandbox_adds(executor: None, fn: Any) -> None:
    result, sandbox = await run(fn, {"x": 10, "y": 5})
    assert result.status == "success" and result.success_flag
    assert result.func_return == 15
    assert result.agent_state is None
    assert result.stdout == [] and result.stderr == []
    assert result.sandbox_config_fingerprint == DEFAULT_PRINT
    assert sandbox.is_async_function is (fn is tools.async_add)
    assert sandbox.inject_agent_state is False


@pytest.mark.parametrize("fn", [tools.add, tools.async_add])
async def test_argument_strings_are_coerced_by_annotation(executor: None, fn: Any) -> None:
    result, _ = await run(fn, {"x": "10", "y": "5"})
    assert result.func_return == 15


async def test_arguments_are_converted_as_letta_converts_them(executor: None) -> None:
    args = {"count": "3", "ratio": "0.5", "flag": "true", "items": "[1, 2]", "opts": {"a": 1}}
    result, _ = await run(tools.typed_args, args)
    assert result.status == "success", result.stderr
    assert result.func_return == {
        "count": 3,
        "ratio": 0.5,
        "flag": True,
        "items": [1, 2],
        "opts": {"a": 1},
    }


@pytest.mark.parametrize(
    ("fn", "expected"), [(tools.create_list, [1] * 5), (tools.async_create_list, [1, 2, 3, 4, 5])]
)
async def test_list_return_values(executor: None, fn: Any, expected: list[int]) -> None:
    result, _ = await run(fn)
    assert result.func_return == expected


async def test_async_complex_computation(executor: None) -> None:
    result, _ = await run(tools.async_complex_computation, {"iterations": 2})
    assert isinstance(result.func_return, dict)
    assert result.func_return["results"] == [0, 2]
    assert result.func_return["iterations"] == 2
    assert result.func_return["average"] == 1.0
    assert result.func_return["duration"] > 0.15


async def test_return_values_are_converted_as_letta_converts_them(executor: None) -> None:
    result, _ = await run(tools.convert_values)
    assert result.func_return == {
        "when": "2024-01-02 03:04:05",
        "set": "{1, 2, 3}",
        "bytes": "b'abc'",
        "tuple": [1, 2],
    }


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (tools.error, "ZeroDivisionError: This is an intentionally weird division!"),
        (tools.async_error, "ValueError: This is an intentional async error!"),
    ],
)
async def test_errors_are_on_stderr_with_letta_friendly_message(
    executor: None, fn: Any, message: str
) -> None:
    result, _ = await run(fn)
    assert result.status == "error" and not result.success_flag
    assert result.stdout == ["Going to error now\n"]
    assert "error" in result.stdout[0]
    assert len(result.stderr) == 1 and isinstance(result.stderr[0], str)
    assert message in result.stderr[0]
    assert "\x1b[" not in result.stderr[0]  # plain text, as a subprocess's stderr
    assert result.func_return == f"Error executing function {fn.__name__}: {message}"
    assert result.agent_state is None
    assert result.sandbox_config_fingerprint == DEFAULT_PRINT


async def test_warnings_do_not_fail_the_run(executor: None) -> None:
    result, _ = await run(tools.warn_hello_world)
    assert result.status == "success"
    assert result.func_return == "Hello World"


@pytest.mark.parametrize("fn", [tools.clear_memory, tools.async_clear_memory])
async def test_agent_state_memory_edits_come_back_as_the_same_class(
    executor: None, fn: Any
) -> None:
    state = agent("agent-memory")
    result, sandbox = await run(fn, agent_state=state)
    assert sandbox.inject_agent_state is True
    assert result.status == "success", result.stderr
    assert isinstance(result.agent_state, AgentState)
    assert result.agent_state.memory.get_block("human").value == ""
    assert result.agent_state.memory.get_block("persona").value == ""
    assert result.func_return is None
    assert state.memory.get_block("human").value == "username: sarah"  # a copy came back


async def test_core_memory_replace_runs_with_typing_names_in_scope(executor: None) -> None:
    state = agent("agent-memory")
    args = {"label": "human", "old_content": "sarah", "new_content": "ada"}
    result, _ = await run(tools.core_memory_replace, args, agent_state=state)
    assert result.status == "success", result.stderr
    assert result.func_return == "username: ada"
    assert result.agent_state.memory.get_block("human").value == "username: ada"
    missing, _ = await run(tools.core_memory_replace, {**args, "old_content": "bob"}, state)
    assert missing.status == "error"
    assert missing.func_return == (
        "Error executing function core_memory_replace: ValueError: "
        "Old content 'bob' not found in memory block 'human'"
    )


@pytest.mark.parametrize("fn", [tools.get_env, tools.async_get_env])
async def test_env_vars_layer_sandbox_then_agent_then_call(executor: None, fn: Any) -> None:
    sandbox_dir = {"sandbox_env_vars": {"secret_word": "from-sandbox"}}
    result, _ = await run(fn, **sandbox_dir)
    assert result.func_return == "from-sandbox"
    assert result.stdout == ["from-sandbox\n"]

    state = agent("agent-env")
    state.secrets = [
        AgentEnvironmentVariable(key="secret_word", value="from-agent", agent_id=state.id)
    ]
    result, _ = await run(fn, agent_state=state, **sandbox_dir)
    assert result.func_return == "from-agent"

    result, _ = await run(
        fn, agent_state=state, additional_env_vars={"secret_word": "from-call"}, **sandbox_dir
    )
    assert result.func_return == "from-call"

    after, _ = await run(fn, agent_state=agent("agent-env"))  # same kernel, nothing lingers
    assert after.func_return is None


async def test_letta_ids_are_in_the_environment(executor: None) -> None:
    result, _ = await run(tools.letta_ids, agent_id="agent-ids", project_id="project-1")
    assert result.func_return == {
        "LETTA_AGENT_ID": "agent-ids",
        "LETTA_PROJECT_ID": "project-1",
        "LETTA_TOOL_ID": "tool-letta_ids",
    }


async def test_agent_id_is_injected_and_client_is_in_scope(
    executor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LETTA_API_KEY", raising=False)
    tool = create_tool_from_func(tools.who_am_i)
    params = tool.json_schema["parameters"]
    del params["properties"]["agent_id"]  # not in the schema: the sandbox supplies it
    params["required"] = []
    sandbox = AsyncToolSandboxKernel(tool.name, {}, USER, tool_id=tool.id, tool_object=tool)
    result = await sandbox.run(agent_state=agent("agent-who"))
    assert result.func_return == {"agent_id": "agent-who", "client_is_none": True}
    assert sandbox.inject_agent_id is True and sandbox.inject_agent_state is False
    assert result.agent_state is None  # the tool takes no agent_state


async def test_state_persists_per_agent(executor: None) -> None:
    first, _ = await run(tools.count_calls, agent_id="agent-counter")
    second, _ = await run(tools.count_calls, agent_id="agent-counter")
    other, _ = await run(tools.count_calls, agent_id="agent-other")
    assert (first.func_return, second.func_return, other.func_return) == (1, 2, 1)


@pytest.mark.parametrize(
    ("fn", "name", "survivor"), [(tools.slow, "slow", 0), (tools.async_slow, "async_slow", 1)]
)
async def test_slow_tool_times_out_and_keeps_the_agents_state(
    executor: None, monkeypatch: pytest.MonkeyPatch, fn: Any, name: str, survivor: int
) -> None:
    # The tool sets its survivor before it sleeps; a deadline that passed before the tool
    # started (a loaded machine) is tried again longer (tests/support/deadlines.py).
    for timeout in DEADLINES:
        monkeypatch.setenv(letta.TOOL_SANDBOX_TIMEOUT, f"{timeout:g}")
        said = f"Executing tool {name} timed out after {timeout} seconds"
        with pytest.raises(kx.ExecutionTimeout, match=re.escape(said)) as raised:
            await run(fn, {"seconds": 60}, agent_id="agent-slow")
        assert isinstance(raised.value, TimeoutError)  # what Letta's own sandbox raises
        monkeypatch.delenv(letta.TOOL_SANDBOX_TIMEOUT)
        survivors, _ = await run(tools.read_survivors, agent_id="agent-slow")
        if survivors.func_return[survivor] == "yes":
            break  # the interrupt worked: the kernel kept its state
    else:
        pytest.fail(f"{name} did not start before any of the deadlines {DEADLINES}")


async def test_bad_timeout_setting_is_a_clear_error(
    executor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(letta.TOOL_SANDBOX_TIMEOUT, "soon")
    with pytest.raises(kx.ConfigError, match="TOOL_SANDBOX_TIMEOUT='soon'"):
        await run(tools.add, {"x": 1, "y": 2})


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory any local user may read, outside /tmp (kernels have their own): a codebase
    as an operator would leave one."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="kxletta-pub-", dir="/run"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


async def test_sandbox_dir_is_the_working_directory_and_config_fingerprint(
    executor: None, public_dir: Path
) -> None:
    tmp_path = public_dir
    await asyncio.to_thread(
        (tmp_path / "helpers.py").write_text, "GREETING = 'hi from the codebase'\n"
    )
    config = SandboxConfig(
        organization_id=USER.organization_id,
        config=LocalSandboxConfig(sandbox_dir=str(tmp_path)).model_dump(exclude_none=True),
    )
    result, _ = await run(tools.read_codebase, sandbox_config=config, agent_id="agent-dir")
    assert result.status == "success", result.stderr
    assert result.func_return == {"cwd": str(tmp_path), "greeting": "hi from the codebase"}
    assert result.sandbox_config_fingerprint == letta_fingerprint(
        "local", USER.organization_id, config.config
    )
    default, _ = await run(tools.where_am_i, agent_id="agent-dir")  # no config: its own dir
    assert default.func_return != str(tmp_path)
    assert Path(default.func_return).name == "agent-dir"


@pytest.mark.skipif(
    not is_root(),
    reason="kernels have users of their own only on a root host (elsewhere a "
    "kernel runs as the host's user and works in sandbox_dir itself, as Letta's tools do)",
)
async def test_sandbox_dir_changes_stay_with_the_agent_and_the_host_directory_is_untouched(
    executor: None, tmp_path: Path
) -> None:
    # A directory only the host's user may enter (pytest's temp dirs are 0700, under the host's
    # /tmp), with a file only it may read.
    helpers = tmp_path / "helpers.py"
    helpers.write_text("GREETING = 'hi'\n")
    helpers.chmod(0o600)
    config = SandboxConfig(config={"sandbox_dir": str(tmp_path)})
    # A tenant may name any directory in its sandbox config: one other users cannot reach is
    # refused unless the operator means it for tools.
    with pytest.raises(kx.ConfigError, match=r"keeps other users out.*sandbox_roots"):
        await run(tools.write_here, {"name": "x", "text": "y"}, sandbox_config=config)
    # Named by the operator, a tool works there as Letta's does, as if the files were its own.
    letta.configure(env_vars={"PYTHONPATH": ROOT}, sandbox_roots=[tmp_path])
    try:
        wrote, _ = await run(
            tools.write_here,
            {"name": "out.txt", "text": "mine"},
            sandbox_config=config,
            agent_id="agent-cow-a",
        )
        assert wrote.status == "success", wrote.stderr
        assert wrote.func_return == "True"  # its own file, as the kernel's user sees it
        mine, _ = await run(
            tools.read_here, {"name": "out.txt"}, sandbox_config=config, agent_id="agent-cow-a"
        )
        assert mine.func_return == ["mine", "GREETING = 'hi'\n# mine\n"]
        # Another agent with the same sandbox_dir sees the directory as the host has it.
        theirs, _ = await run(
            tools.read_here, {"name": "out.txt"}, sandbox_config=config, agent_id="agent-cow-b"
        )
        assert theirs.func_return == [None, "GREETING = 'hi'\n"]
        # The host's directory is never written.
        assert await asyncio.to_thread(os.listdir, tmp_path) == ["helpers.py"]
        assert await asyncio.to_thread(helpers.read_text) == "GREETING = 'hi'\n"
    finally:
        letta.configure(env_vars={"PYTHONPATH": ROOT})


@pytest.fixture
def letta_home() -> Iterator[Path]:
    """A home directory like root's (0700) outside /tmp and outside any directory the kernels
    are given at launch, so nothing under it is bridged for them beforehand."""
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="kxletta-home-", dir="/run"))
    try:
        yield home
    finally:
        shutil.rmtree(home)


async def test_letta_default_layout_under_a_home_only_its_user_may_enter(
    executor: None, letta_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Letta's default sandbox_dir, ~/.letta/tool_execution_dir, in a fresh 0700 home: the host
    # makes it (as Letta does), and the tool runs there, with no configuration.
    monkeypatch.setenv("HOME", str(letta_home))
    sandbox_dir = letta_home / ".letta" / "tool_execution_dir"
    config = SandboxConfig(config={"sandbox_dir": str(sandbox_dir)})
    result, _ = await run(tools.where_am_i, sandbox_config=config, agent_id="agent-home")
    assert result.status == "success", result.stderr
    assert result.func_return == str(sandbox_dir)
    assert await asyncio.to_thread(sandbox_dir.is_dir)


async def test_callers_on_different_event_loops_share_the_executor(executor: None) -> None:
    results: list[Any] = []

    def in_thread() -> None:
        results.append(asyncio.run(run(tools.count_calls, agent_id="agent-threads"))[0])

    threads = [threading.Thread(target=in_thread) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mine, _ = await run(tools.count_calls, agent_id="agent-threads")
    assert sorted(r.func_return for r in results) == [1, 2]
    assert mine.func_return == 3


async def test_missing_tool_object_is_a_clear_error(executor: None) -> None:
    sandbox = AsyncToolSandboxKernel("add", {}, USER, tool_id="t")
    with pytest.raises(kx.ConfigError, match="tool_object is required"):
        await sandbox.run()


async def test_shutdown_is_idempotent_and_the_next_run_starts_again(executor: None) -> None:
    await run(tools.count_calls, agent_id="agent-restart")
    letta.shutdown()
    letta.shutdown()
    again, _ = await run(tools.count_calls, agent_id="agent-restart")
    assert again.func_return == 1  # a new executor, a new kernel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("letta-wheels")
    broken = d / "kxbroken-1.0-py3-none-any.whl"
    broken.write_bytes(b"this is not a zip file")
    return {
        "kxcow": make_wheel(d, "kxcow", "1.0", "def cow(text):\n    print('< ' + text + ' >')\n"),
        "kxtqdm": make_wheel(d, "kxtqdm", "1.0", "def tqdm(items):\n    return iter(items)\n"),
        "kxbroken": broken,
    }


def codebase(root: Path, cow_wheel: Path) -> Path:
    """A small external codebase like Letta's restaurant_management_system test fixture."""
    (root / "core").mkdir(parents=True)
    (root / "core" / "__init__.py").write_text("")
    (root / "core" / "menu.py").write_text(
        "class MenuItem:\n"
        "    def __init__(self, name, price, category):\n"
        "        self.name, self.price, self.category = name, price, category\n\n\n"
        "class Menu:\n"
        "    def __init__(self):\n"
        "        self.items = []\n\n"
        "    def add_item(self, item):\n"
        "        self.items.append(item)\n"
    )
    (root / "core" / "utils.py").write_text(
        "def format_currency(value):\n    return f'${value:.2f}'\n"
    )
    (root / "requirements.txt").write_text(f"# the codebase's own needs\n{cow_wheel}\n")
    return root


@pytest.mark.slow
async def test_external_codebase_in_a_venv_from_config_requirements_txt_and_tool(
    executor: None, public_dir: Path, wheels: dict[str, Path]
) -> None:
    assert importlib.util.find_spec("kxcow") is None  # not on the host
    sandbox_dir = codebase(public_dir / "restaurant", wheels["kxcow"])
    local = LocalSandboxConfig(
        sandbox_dir=str(sandbox_dir),
        use_venv=True,
        pip_requirements=[PipRequirement(name=str(wheels["kxtqdm"]))],
    )
    config = SandboxConfig(organization_id="org-1", config=local.model_dump(exclude_none=True))
    result, _ = await run(tools.adjust_menu_prices, {"percentage": 10}, sandbox_config=config)
    assert result.status == "success", result.stderr
    assert result.func_return == (
        "Price Adjustments:\nBurger: $8.99 -> $9.89\nFries: $2.99 -> $3.29\nSoda: $1.99 -> $2.19"
    )
    assert "Hello World" in result.stdout[0]
    assert result.sandbox_config_fingerprint == letta_fingerprint("local", "org-1", config.config)

    # The tool's own requirements join the config's and requirements.txt's (one venv for all).
    mixed, _ = await run(
        tools.venv_marker,
        sandbox_config=config,
        pip_requirements=[PipRequirement(name=str(wheels["kxtqdm"]))],
    )
    assert mixed.status == "success", mixed.stderr
    _, prefix = mixed.func_return.split(" ", 1)
    assert prefix.startswith(os.environ["KERNELEXEC_CACHE_DIR"])  # kernelexec's venv cache
    # No pydantic in the venv: Letta's script says so on stdout and converts with str().
    assert mixed.stdout == [
        "Pydantic not available in sandbox environment, falling back to string conversion\n"
    ]


@pytest.mark.slow
async def test_force_recreate_venv_rebuilds_it(
    executor: None, public_dir: Path, wheels: dict[str, Path]
) -> None:
    local = LocalSandboxConfig(
        sandbox_dir=str(public_dir),
        use_venv=True,
        pip_requirements=[PipRequirement(name=str(wheels["kxcow"]))],
    )
    config = SandboxConfig(config=local.model_dump(exclude_none=True))
    first, _ = await run(tools.venv_marker, sandbox_config=config, agent_id="agent-venv")
    again, _ = await run(tools.venv_marker, sandbox_config=config, agent_id="agent-venv")
    rebuilt, _ = await run(
        tools.venv_marker, sandbox_config=config, agent_id="agent-venv", force_recreate_venv=True
    )
    assert first.status == "success", first.stderr
    build, prefix = first.func_return.split(" ", 1)
    assert again.func_return == first.func_return  # the same venv, not rebuilt
    assert rebuilt.status == "success", rebuilt.stderr
    new_build, new_prefix = rebuilt.func_return.split(" ", 1)
    assert new_prefix == prefix and new_build != build


@pytest.mark.slow
async def test_requirements_that_cannot_be_installed_raise_runtime_error(
    executor: None, public_dir: Path, wheels: dict[str, Path]
) -> None:
    config = SandboxConfig(config={"sandbox_dir": str(public_dir), "use_venv": True})
    broken = [PipRequirement(name=str(wheels["kxbroken"]))]
    with pytest.raises(RuntimeError) as info:
        await run(tools.use_broken_package, sandbox_config=config, pip_requirements=broken)
    assert isinstance(info.value, kx.EnvSetupError)
    assert "use_broken_package" in str(info.value) and "kxbroken" in str(info.value)


async def test_bad_argument_values_fail_the_run(executor: None) -> None:
    result, _ = await run(tools.add, {"x": "ten", "y": 1})
    assert result.status == "error"
    assert result.func_return.startswith(
        "Error executing function add: ValueError: invalid literal"
    )


async def test_runs_are_recorded_when_configured(executor: None, tmp_path: Path) -> None:
    letta.configure(env_vars={"PYTHONPATH": ROOT}, record_dir=str(tmp_path))
    try:
        result, _ = await run(tools.add, {"x": 1, "y": 2}, agent_id="agent-rec")
        assert result.func_return == 3
    finally:
        letta.configure(env_vars={"PYTHONPATH": ROOT})
    cells = json.loads((tmp_path / "agent-rec.ipynb").read_text())["cells"]
    call = "".join(cells[-1]["source"])
    assert call.startswith("_kx_letta_add(args={'x': 1, 'y': 2}")
    assert cells[-1]["metadata"]["kernelexec"]["func_return"] == 3
    report = await kx.areplay(tmp_path / "agent-rec.ipynb")
    assert report.cells_run == 2 and report.differences == []


async def test_shutdown_during_a_run_fails_that_run_clearly(executor: None) -> None:
    # A FIFO in the agent's own directory, which the host and the kernel share.
    where, _ = await run(tools.where_am_i, agent_id="agent-shutdown")
    marker = Path(where.func_return) / "started"
    os.mkfifo(marker)
    os.chmod(marker, 0o666)  # the kernel may run as a user of its own
    call = asyncio.ensure_future(
        run(tools.wait_for_ever, {"marker": str(marker)}, agent_id="agent-shutdown")
    )
    assert await asyncio.to_thread(marker.read_text) == "started"  # the tool runs now
    await asyncio.to_thread(letta.shutdown)
    with pytest.raises(kx.ExecutorClosedError):
        await call


async def test_agent_secrets_are_read_from_a_plain_object(executor: None) -> None:
    # Duck-typed: an id and a `secrets` list of key/value items, no Letta class, no method.
    plain = SimpleNamespace(id="agent-plain", secrets=[{"key": "secret_word", "value": "plain"}])
    result, _ = await run(tools.get_env, agent_state=plain)  # type: ignore[arg-type]
    assert result.func_return == "plain"
    assert result.agent_state is None


STATE_MODULE = """
from pydantic import BaseModel


class KxBlocks(BaseModel):
    id: str
    blocks: dict[str, str] = {}

    def get_block(self, label: str) -> str:
        return self.blocks[label]

    def set_block(self, label: str, value: str) -> None:
        self.blocks[label] = value
"""


@pytest.fixture
def state_class() -> Iterator[tuple[type[Any], str]]:
    """A pydantic agent-state class with methods, in a directory other users may read (so a
    kernel with its own user can too) that is on none of the kernel's paths."""
    import shutil
    import sys
    import tempfile
    import uuid

    where = tempfile.mkdtemp(prefix="kx-letta-state-", dir="/tmp")
    os.chmod(where, 0o755)
    name = f"kxstate_{uuid.uuid4().hex[:8]}"
    path = Path(where) / f"{name}.py"
    path.write_text(STATE_MODULE)
    os.chmod(path, 0o644)
    sys.path.insert(0, where)
    try:
        module = importlib.import_module(name)
        yield module.KxBlocks, where
    finally:
        sys.path.remove(where)
        sys.modules.pop(name, None)
        shutil.rmtree(where, ignore_errors=True)


# At "process" on a root host the kernel has a private /tmp and a user of its own: the directory
# under the host's /tmp reaches it because the adapter lends it (sandbox_dir copy on write, the
# run's PYTHONPATH read-only).
@pytest.mark.parametrize("how", ["sandbox_dir", "PYTHONPATH"])
async def test_agent_state_importable_from_sandbox_dir_or_pythonpath_keeps_its_methods(
    executor: None, state_class: tuple[type[Any], str], how: str
) -> None:
    cls, where = state_class
    state = cls(id=f"agent-state-{how}", blocks={"human": "sarah"})
    kwargs: dict[str, Any] = {}
    if how == "sandbox_dir":
        kwargs["sandbox_config"] = SandboxConfig(config={"sandbox_dir": where})
    else:
        kwargs["sandbox_env_vars"] = {"PYTHONPATH": where}
    result, _ = await run(tools.upper_block, {"label": "human"}, agent_state=state, **kwargs)
    assert result.status == "success", result.stderr
    assert result.func_return == "SARAH"
    assert isinstance(result.agent_state, cls)
    assert result.agent_state.get_block("human") == "SARAH"


async def test_non_finite_floats_come_back_as_floats(executor: None) -> None:
    import math

    result, _ = await run(tools.not_a_number)
    assert result.status == "success", result.stderr
    nan, inf, ninf, plain = result.func_return
    assert isinstance(nan, float) and math.isnan(nan)
    assert (inf, ninf, plain) == (math.inf, -math.inf, 1.5)
