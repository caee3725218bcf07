"""Hostile: an executor's kernels together cannot take more memory than its budget.

Seen before: the default ``memory_mb`` is half the host's memory per kernel, so sixteen
kernels could commit eight times the host's memory. Now every kernel's memory group sits in
one parent group per executor (``memory_budget_mb``).
"""

from __future__ import annotations

import os

import psutil
import pytest

import kernelexec as kx
from kernelexec._sandbox import _cgroups
from tests.hostile.conftest import needs_cgroup

pytestmark = needs_cgroup("memory_mb")


def _budget_groups() -> list[str]:
    hier = _cgroups.BudgetGroup.hierarchy()
    assert hier is not None
    return [p.name for p in hier.base.iterdir() if p.name.startswith(f"kx-{os.getpid()}-b")]


def test_the_default_budget_bounds_all_kernels_together() -> None:
    with kx.KernelExecutor() as ex:
        shown = ex.session("default-budget").isolation.limits["memory_budget_mb"]
    budget = float(shown.split()[0])
    assert budget <= psutil.virtual_memory().total / 1024**2 * 0.75 + 1


@pytest.mark.slow
def test_kernels_reaching_the_budget_together_lose_the_largest_only() -> None:
    # Each kernel may take 1000 MiB alone; together they get 400.
    with kx.KernelExecutor(memory_budget_mb=400, limits=kx.Limits(memory_mb=1000)) as ex:
        small, large = ex.session("budget-small"), ex.session("budget-large")
        assert small.run_code("kept = bytearray(100 * 1024 * 1024); len(kept)").ok
        assert _budget_groups() != []
        result = large.run_code("grab = bytearray(500 * 1024 * 1024)")
        assert result.error is not None and result.error.kind == "limit_exceeded"
        assert "memory_budget_mb=400" in result.error.evalue
        assert result.kernel_restarted
        assert small.run_code("len(kept)").result == str(100 * 1024 * 1024)
        assert large.run_code("1 + 1").result == "2"  # a fresh kernel, in the budget again
    assert _budget_groups() == []


def test_a_budget_is_refused_where_it_cannot_be_enforced() -> None:
    with pytest.raises(kx.ConfigError, match="memory_budget_mb"):
        kx.KernelExecutor(isolation="none", memory_budget_mb=1024)
