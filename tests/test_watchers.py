"""The socket a session feature plugs into: a watcher subscribed to the session's lease is told
each kernel attached, each one leaving (and why), every run that reached a kernel (with what the
kernel side reported), and the session's end; the session's own modules name no feature."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import kernelexec as kx
from kernelexec._core._lease import Arrival, LeasedKernel, Leaving
from kernelexec._models import Restored

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent / "kernelexec"
FEATURES = ("_durable", "_branching", "_codemode", "_files", "_recording")


class Journal:
    """A feature that only writes down what its lease tells it."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    async def attaching(self) -> None:
        self.events.append(("attaching",))

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        self.events.append(("attached", kernel.generation, how, kernel.conn.kernel_pid()))
        return None

    async def before_use(self, kernel: LeasedKernel) -> None:
        self.events.append(("before_use", kernel.generation))

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        self.events.append(("leaving", kernel.generation, why, kernel.names))
        return False

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        generation = kernel.generation if kernel is not None else None
        self.events.append(("after_run", generation, extras is not None))

    def gone(self) -> None:
        self.events.append(("gone",))


async def test_a_watcher_follows_the_session_kernel_by_kernel() -> None:
    journal = Journal()
    async with kx.AsyncKernelExecutor(default_timeout=30) as ex:
        session = await ex.session("watched")
        session.lease.subscribe(journal)
        (await session.run_code("x = 1")).raise_for_error()
        first_pid = session.lease.connection.kernel_pid()  # type: ignore[union-attr]
        tool = kx.Tool.from_source("def add(a: int, b: int) -> int:\n    return a + b\n")
        assert (await session.call_tool(tool, {"a": "not a number"})).status == "error"
        await session.restart()
        (await session.run_code("y = 2")).raise_for_error()
        await session.aclose()
    assert journal.events == [
        ("attaching",),
        ("attached", 1, "fresh", first_pid),
        ("after_run", 1, True),  # the kernel side's report came back
        # the rejected call never reached a kernel: nothing
        ("leaving", 1, "lost", ("x",)),
        ("attached", 2, "fresh", journal.events[4][3]),  # a replacement: no "attaching"
        ("before_use", 2),  # the next run finds that kernel attached
        ("after_run", 2, True),
        ("gone",),  # its last kernel is shut down after, unannounced
    ]
    assert journal.events[4][3] != first_pid


async def test_an_evicted_kernel_is_told_leaving_before_its_names_are_reported_lost() -> None:
    journal = Journal()
    async with kx.AsyncKernelExecutor(default_timeout=30, max_kernels=1) as ex:
        a = await ex.session("a")
        a.lease.subscribe(journal)
        (await a.run_code("kept = 1")).raise_for_error()
        (await ex.run_code("1", agent_id="b")).raise_for_error()  # takes a's kernel
        again = await a.run_code("print('kept' in dir())")
    assert again.stdout == "False\n" and again.lost_variables == ["kept"]
    assert journal.events[:4] == [
        ("attaching",),
        ("attached", 1, "fresh", journal.events[1][3]),
        ("after_run", 1, True),
        ("leaving", 1, "evict", ("kept",)),
    ]
    assert journal.events[4] == ("attaching",)
    assert journal.events[5][:3] == ("attached", 2, "fresh")


def _imported(module: Path) -> set[str]:
    """What ``module`` imports at run time (imports under ``TYPE_CHECKING`` left out)."""
    tree = ast.parse(module.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("name", ["_session", "_lease", "_pipeline", "_features", "_atomic"])
def test_the_session_lease_and_pipeline_name_no_feature(name: str) -> None:
    imported = _imported(ROOT / "_core" / f"{name}.py")
    assert not {m for m in imported for f in FEATURES if m.startswith(f"kernelexec.{f}")}


def test_the_session_module_stays_within_500_lines() -> None:
    assert len((ROOT / "_core" / "_session.py").read_text().splitlines()) <= 500
