"""The architecture's promises: the layering, the backend interface (by name, a non-local
filesystem, misbehaving backends), error kinds that user code cannot forge, typed signatures,
picklable exceptions."""

from __future__ import annotations

import inspect
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path, PurePosixPath
from typing import Any

import grimp
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli there
    import tomli as tomllib

import kernelexec as kx
from kernelexec.backends import (
    KernelBackend,
    KernelConnection,
    KernelLaunch,
    LocalBackend,
    backend_names,
    get_backend,
)

# -- layout ------------------------------------------------------------------------------------


def _cycles(graph: Any, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    imported = graph.find_modules_directly_imported_by(child) & modules
                    work.append((child, iter(sorted(imported))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules() -> None:
    # Imports inside functions count; those under TYPE_CHECKING do not.
    graph = grimp.build_graph("kernelexec", exclude_type_checking_imports=True)
    modules = {m for m in graph.modules if m != "kernelexec"}
    assert _cycles(graph, modules) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.b", imported="p.c")
    assert _cycles(graph, {"p.a", "p.b", "p.c"}) == [["p.a", "p.b"]]


def test_layering_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [str(lint), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def _folders_split_across_heights(contract: dict[str, Any]) -> list[str]:
    """The top-level parts a layers contract names by something other than themselves, once: a
    module inside a folder, or the part at two heights. Empty when each part sits at one height."""
    prefix = "".join(f"{c}." for c in contract.get("containers", []))
    named: dict[str, list[str]] = {}
    for layer in contract["layers"]:
        for name in re.split(r"[|:]", layer):
            full = prefix + name.strip()
            named.setdefault(".".join(full.split(".")[:2]), []).append(full)
    return sorted(part for part, names in named.items() if names != [part])


def _layers_contracts() -> list[dict[str, Any]]:
    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]


def test_each_folder_sits_at_one_height_in_the_layering() -> None:
    top = [c for c in _layers_contracts() if c.get("containers") in (None, ["kernelexec"])]
    assert len(top) == 1
    assert top[0].get("exhaustive") is True  # a new top-level part must be given its height
    assert _folders_split_across_heights(top[0]) == []
    # The order inside a folder is its own contract, naming only that folder's modules.
    for inside in _layers_contracts():
        if inside is not top[0]:
            names = [n for layer in inside["layers"] for n in re.split(r"[|:]", layer)]
            assert all("." not in name for name in names), inside["name"]


def test_the_height_check_finds_a_split_folder() -> None:
    split = {
        "containers": ["kernelexec"],
        "layers": ["_cli", "_files._blocking | _core", "_files._wire", "_json"],
    }
    assert _folders_split_across_heights(split) == ["kernelexec._files"]
    twice = {"layers": ["kernelexec._cli", "kernelexec._notebooks", "kernelexec._notebooks"]}
    assert _folders_split_across_heights(twice) == ["kernelexec._notebooks"]
    inside = {"layers": ["kernelexec._sync", "kernelexec._notebooks._replay"]}
    assert _folders_split_across_heights(inside) == ["kernelexec._notebooks"]
    whole = {"layers": ["kernelexec._sync", "kernelexec._files | kernelexec._core"]}
    assert _folders_split_across_heights(whole) == []


def test_every_module_says_what_it_holds() -> None:
    root = Path(kx.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        text = path.read_text()
        if not text.lstrip().startswith('"""'):
            missing.append(str(path.relative_to(root)))
    assert missing == []


# -- typed surface ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        kx.KernelExecutor.call_tool,
        kx.KernelExecutor.run_code,
        kx.Session.call_tool,
        kx.Session.run_code,
        kx.AsyncKernelExecutor.call_tool,
        kx.AsyncKernelExecutor.run_code,
        kx.AsyncSession.call_tool,
        kx.AsyncSession.run_code,
    ],
    ids=lambda m: m.__qualname__,
)
def test_call_methods_name_their_parameters_with_types(method: Any) -> None:
    params = inspect.signature(method).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name in ("timeout", "env_vars", "on_stdout", "on_stderr", "on_display"):
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].annotation is not inspect.Parameter.empty
        assert params[name].default is None
    if method.__name__ == "call_tool":
        assert "agent_state" in params
    hints = inspect.get_annotations(method, eval_str=True)
    assert hints["timeout"] == float | None
    assert hints["env_vars"] == dict[str, str] | None


def test_version_comes_from_the_installed_metadata() -> None:
    from importlib.metadata import version

    assert kx.__version__ == version("kernelexec")


def _example(cls: type[BaseException]) -> BaseException:
    if issubclass(cls, kx.ExecutionError):
        failed = kx.Execution(
            status="error", error=kx.ExecError(kind="timeout", ename="TimeoutError", evalue="x")
        )
        return cls(failed)  # type: ignore[call-arg]
    return cls(f"a {cls.__name__}")


def _exception_classes() -> list[type[BaseException]]:
    return [
        getattr(kx, name)
        for name in kx.__all__
        if isinstance(getattr(kx, name), type) and issubclass(getattr(kx, name), kx.KernelExecError)
    ]


@pytest.mark.parametrize("cls", _exception_classes(), ids=lambda c: c.__name__)
def test_exceptions_survive_pickling(cls: type[BaseException]) -> None:
    original = _example(cls)
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert str(copy) == str(original)
    if isinstance(original, kx.ExecutionError):
        assert isinstance(copy, kx.ExecutionError)
        assert copy.execution == original.execution


# -- error kinds ---------------------------------------------------------------------------


def test_user_exceptions_cannot_pose_as_kernelexec_errors(
    executor: kx.KernelExecutor,
) -> None:
    liar = kx.Tool.from_source(
        textwrap.dedent(
            '''
            def liar(which: str) -> None:
                """Raise an exception named like one of kernelexec's own."""
                raise type(which, (Exception,), {})("the arguments were fine, honest")
            '''
        )
    )
    for name in ("InvalidArguments", "KernelexecInvalidTool", "KernelexecResultTooLarge"):
        result = executor.call_tool(liar, {"which": name}, agent_id="liar")
        assert result.error is not None
        assert result.error.kind == "exception"
        assert result.error.ename == name
        assert result.error.evalue == "the arguments were fine, honest"
    code = executor.run_code(
        "class KernelexecInvalidArgs(Exception): pass\nraise KernelexecInvalidArgs('no')",
        agent_id="liar",
    )
    assert code.error is not None and code.error.kind == "exception"


def test_kernelexec_own_checks_still_name_their_kind(executor: kx.KernelExecutor) -> None:
    # The schema admits `c`, the function does not: only the kernel's signature check sees it.
    mismatched = kx.Tool(
        name="two",
        source_code="def two(a):\n    return a\n",
        json_schema={
            "name": "two",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "c": {"type": "integer"}},
            },
        },
    )
    result = executor.call_tool(mismatched, {"a": 1, "c": 2}, agent_id="kinds")
    assert result.error is not None
    assert result.error.kind == "invalid_args"
    assert "unexpected keyword argument 'c'" in result.error.evalue
    missing = kx.Tool(
        name="absent",
        source_code="def present():\n    return 1\n",
        json_schema={"name": "absent", "parameters": {"type": "object", "properties": {}}},
    )
    result = executor.call_tool(missing, {}, agent_id="kinds")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "no function named 'absent'" in result.error.evalue
    big = kx.Tool.from_source('def big() -> str:\n    """Big."""\n    return "y" * 5000\n')
    with kx.KernelExecutor(max_result_chars=1000) as ex:
        result = ex.call_tool(big, {})
    assert result.error is not None and result.error.kind == "result_too_large"
    assert result.error.ename == "KernelexecResultTooLarge"


# -- per-run environment variables --------------------------------------------------------------


def test_run_code_takes_env_vars_for_that_run_only(executor: kx.KernelExecutor) -> None:
    s = executor.session("code-env")
    read = "import os; os.environ.get('KX_TOKEN', 'unset')"
    assert s.run_code(read, env_vars={"KX_TOKEN": "t1"}).result == "'t1'"
    assert s.run_code(read).result == "'unset'"
    failed = s.run_code(
        "import os; assert os.environ['KX_TOKEN'] == 't2'; 1/0", env_vars={"KX_TOKEN": "t2"}
    )
    assert failed.error is not None and failed.error.ename == "ZeroDivisionError"
    assert s.run_code(read).result == "'unset'"
    # A top-level await cell runs on IPython's async path (no post_execute): still restored.
    awaited = s.run_code(
        "import asyncio, os\nawait asyncio.sleep(0)\nos.environ['KX_TOKEN']",
        env_vars={"KX_TOKEN": "t3"},
    )
    assert awaited.result == "'t3'", awaited.error
    assert s.run_code(read).result == "'unset'"
    with pytest.raises(TypeError, match="env_vars"):
        s.run_code("1", env_vars={"A": 1})  # type: ignore[dict-item]


# -- backends ---------------------------------------------------------------------------------


def test_the_local_backend_is_found_by_name() -> None:
    assert "local" in backend_names()
    assert isinstance(get_backend("local"), LocalBackend)
    with kx.KernelExecutor(backend="local") as ex:
        assert isinstance(ex._async.backend, LocalBackend)
        assert ex.run_code("6 * 7").result == "42"
    with kx.KernelExecutor(backend="local", backend_options={"python": sys.executable}) as ex:
        assert ex.run_code("1 + 1").result == "2"


def test_a_bad_backend_choice_is_a_config_error() -> None:
    with pytest.raises(kx.ConfigError, match=r"no kernelexec backend named 'nope' \(installed: "):
        kx.KernelExecutor(backend="nope")
    with pytest.raises(kx.ConfigError, match="rejected its options"):
        kx.KernelExecutor(backend="local", backend_options={"colour": "blue"})
    with pytest.raises(kx.ConfigError, match="backend must be"):
        kx.KernelExecutor(backend=42)  # type: ignore[arg-type]


class RemoteLike(KernelBackend):
    """A backend whose kernels do not share the host's filesystem (as over a gateway); it
    runs them with the local backend underneath."""

    name = "remote-like"
    host_filesystem = False

    def __init__(self) -> None:
        self.inner = LocalBackend()
        self.starts = 0

    async def start(self, launch: KernelLaunch, *, timeout: float) -> KernelConnection:
        self.check(launch)
        self.starts += 1
        return await self.inner.start(launch, timeout=timeout)


def test_a_backend_without_the_host_filesystem(tmp_path: Path) -> None:
    backend = RemoteLike()
    with kx.KernelExecutor(backend=backend) as ex:
        s = ex.session("agent/1")
        assert isinstance(s.workdir, PurePosixPath) and not s.workdir.is_absolute()
        cwd = s.run_code("import os; os.getcwd()").result
        assert cwd is not None and cwd.strip("'").endswith(f"/{s.workdir}")
        assert backend.starts == 1
        # The fingerprint is the backend's, not the host interpreter's alone.
        assert ex.fingerprint != kx.LocalEnv().fingerprint
        with pytest.raises(kx.ConfigError, match="'remote-like' backend does not support"):
            ex.session("venv", kx.VenvEnv(requirements=["six"]))
    with pytest.raises(kx.ConfigError, match=r"interpreter \(virtual environments\)"):
        kx.KernelExecutor(backend=RemoteLike(), env=kx.VenvEnv())


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_kernel_that_dies_at_start_says_why(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, 'echo "boom: no ipykernel here" >&2\nexit 3')
    with (
        kx.KernelExecutor(backend=LocalBackend(python=python), start_timeout=20) as ex,
        pytest.raises(kx.KernelStartError) as info,
    ):
        ex.run_code("1")
    text = str(info.value)
    assert "kernel exited (exit code 3) before it was ready" in text
    assert "boom: no ipykernel here" in text


def test_start_timeout_bounds_a_kernel_that_never_answers(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, 'echo "waiting forever" >&2\nexec sleep 600')
    with (
        # 3 s: time for the launcher and the shell to get to its echo on a loaded host.
        kx.KernelExecutor(backend=LocalBackend(python=python), start_timeout=3) as ex,
        pytest.raises(kx.KernelStartError, match="did not become ready in time") as info,
    ):
        ex.run_code("1")
    assert "waiting forever" in str(info.value)
    # The leak check (conftest) proves the silent process was killed and its files removed.


class FailingBackend(LocalBackend):
    """Prewarming meets a bug in the backend: an exception kernelexec does not expect."""

    async def start(self, launch: KernelLaunch, *, timeout: float) -> KernelConnection:
        raise RuntimeError("backend bug")


@pytest.mark.anyio
async def test_a_failing_background_task_is_logged_and_surfaces_at_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ex = kx.AsyncKernelExecutor(backend=FailingBackend(), prewarm=1)
    await ex.start()
    await ex.warm_up()  # returns once prewarming gave up
    assert any("backend bug" in r.getMessage() for r in caplog.records)
    with pytest.raises(kx.BackgroundTaskError, match="1 background task") as info:
        await ex.aclose()
    assert isinstance(info.value.__cause__, RuntimeError)
    await ex.aclose()  # closed for good; idempotent
