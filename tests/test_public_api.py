"""The public surface as a user meets it: classes named ``kernelexec.X`` (not by a private
module), constructors whose settings are typed, a misspelt setting refused with kernelexec's own
error, the blocking facade's properties typed, and the one loop thread the facades run on."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import pickle
import threading
import types
import typing
from pathlib import Path
from typing import Any

import nbformat
import pytest

import kernelexec as kx
from kernelexec._aio import LoopThread
from kernelexec._public import exports

# -- public names ------------------------------------------------------------------------------


def _public_objects() -> list[tuple[str, Any]]:
    return [
        (name, getattr(kx, name))
        for name in kx.__all__
        if isinstance(getattr(kx, name), type | types.FunctionType)
    ]


# Ids by name: a function's repr holds its address, which differs between xdist's workers.
@pytest.mark.parametrize(("name", "obj"), _public_objects(), ids=[n for n, _ in _public_objects()])
def test_public_classes_and_functions_are_named_by_the_package(name: str, obj: Any) -> None:
    assert obj.__module__ == "kernelexec"
    if isinstance(obj, type):
        assert repr(obj) == f"<class 'kernelexec.{name}'>"


def test_the_public_path_is_what_reprs_and_pickles_carry() -> None:
    assert repr(kx.Execution) == "<class 'kernelexec.Execution'>"  # a pydantic model
    assert repr(kx.KernelExecutor) == "<class 'kernelexec.KernelExecutor'>"
    result = kx.Execution(
        status="error", error=kx.ExecError(kind="exception", ename="ValueError", evalue="no")
    )
    data = pickle.dumps(result)
    assert b"kernelexec._models" not in data and b"kernelexec" in data
    assert pickle.loads(data) == result
    copy = pickle.loads(pickle.dumps(kx.ConfigError("bad")))
    assert type(copy) is kx.ConfigError and str(copy) == "bad"


def test_public_models_stay_subclassable() -> None:
    class Tagged(kx.Limits):
        tag: str = "t"

    limits = Tagged(memory_mb=512)
    assert limits.memory_mb == 512 and limits.tag == "t"


def test_the_public_names_are_written_once(tmp_path: Path) -> None:
    # The one list is __init__'s TYPE_CHECKING block; the lazy loader and __all__ read it.
    extra = {"__version__", "load_ipython_extension", "unload_ipython_extension"}
    assert set(kx.__all__) == set(kx._EXPORTS) | extra
    tree = ast.parse(Path(kx.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If))
    imported = [(s.module, a) for s in block.body if isinstance(s, ast.ImportFrom) for a in s.names]
    assert len(imported) == len(kx._EXPORTS)
    for module, alias in imported:
        assert alias.asname == alias.name, alias.name  # a re-export, as type checkers read it
        assert kx._EXPORTS[alias.name] == module
        assert getattr(importlib.import_module(str(module)), alias.name) is getattr(kx, alias.name)
    init = tmp_path / "__init__.py"
    init.write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from p._a import A as A\n"
        "    from p._b import b as b\nfrom p._c import C\n"
    )
    assert exports(str(init)) == {"A": "p._a", "b": "p._b"}


# -- a typed constructor -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", [kx.KernelExecutor, kx.AsyncKernelExecutor])
def test_a_misspelt_setting_is_a_config_error(cls: Any) -> None:
    with pytest.raises(kx.ConfigError, match=r"invalid executor configuration: max_kernel: "):
        cls(max_kernel=3)
    with pytest.raises(ValueError, match="default_timeout"):
        cls(default_timeout="soon")


@pytest.mark.parametrize("cls", [kx.KernelExecutor, kx.AsyncKernelExecutor])
def test_the_constructors_type_their_settings(cls: Any) -> None:
    params = inspect.signature(cls).parameters
    assert params["config"].kind is inspect.Parameter.VAR_KEYWORD
    assert params["config"].annotation == "Unpack[ExecutorOptions]"


def test_the_typed_settings_are_the_config_fields() -> None:
    assert list(kx.ExecutorOptions.__annotations__) == list(kx.ExecutorConfig.model_fields)


@pytest.mark.parametrize("cls", [kx.KernelExecutor, kx.Session, kx.Snapshot])
def test_the_facade_properties_are_typed(cls: type) -> None:
    props = {n: p for n, p in vars(cls).items() if isinstance(p, property)}
    assert props
    # nbformat is imported for type checkers only: at run time, on first use (issue 36)
    lazy = {"NotebookNode": nbformat.NotebookNode}
    for name, prop in props.items():
        returns = inspect.get_annotations(prop.fget, eval_str=True, locals=lazy)["return"]
        assert returns is not Any, name


# -- one loop thread ---------------------------------------------------------------------------


async def _add(a: int, b: int) -> int:
    return a + b


def test_a_loop_thread_serves_calls_and_cancels_the_rest_when_stopped() -> None:
    runner = LoopThread("kernelexec-test")
    assert runner.call(_add, 1, 2) == 3
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    pending = asyncio.run_coroutine_threadsafe(forever(), runner.loop)
    assert started.wait(30)
    runner.stop()
    assert pending.cancelled()
    assert runner.loop.is_closed()
    assert "kernelexec-test" not in [t.name for t in threading.enumerate()]
    runner.stop()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        runner.call(_add, 1, 2)  # refused, the coroutine closed (no "never awaited" warning)


def test_a_loop_thread_is_awaited_from_another_loop_and_cancelled_with_its_caller() -> None:
    runner = LoopThread("kernelexec-test")
    started = asyncio.Event()
    ended: list[str] = []

    async def forever() -> None:
        caller.call_soon_threadsafe(started.set)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def main() -> None:
        assert await runner.run(_add, 2, 3) == 5
        task = asyncio.ensure_future(runner.run(forever))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    caller = asyncio.new_event_loop()
    try:
        caller.run_until_complete(main())
    finally:
        caller.close()
        runner.stop()
    assert ended == ["cancelled"]


def test_the_blocking_facade_runs_on_one_named_loop_thread() -> None:
    before = {t.ident for t in threading.enumerate()}
    with kx.KernelExecutor() as ex:
        assert ex.run_code("1 + 1").result == "2"
        mine = [t for t in threading.enumerate() if t.ident not in before]
        assert [t.name for t in mine if t.name == "kernelexec"] == ["kernelexec"]
        assert all(t.daemon for t in mine if t.name == "kernelexec")
    assert "kernelexec" not in [t.name for t in threading.enumerate() if t.ident not in before]


@pytest.mark.parametrize("name", [n for n, obj in _public_objects() if isinstance(obj, type)])
def test_type_hints_of_public_classes_resolve(name: str) -> None:
    # Named by the package, which imports lazily: the hints must not need its namespace.
    hints = typing.get_type_hints(getattr(kx, name))
    assert all(not isinstance(v, str) for v in hints.values())
