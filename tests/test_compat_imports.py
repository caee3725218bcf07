"""Importing kernelexec never imports an agent framework (issue 27): the adapters in
``kernelexec.compat`` import theirs only when they are imported themselves."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("smolagents", "pydantic_ai", "deepagents", "langchain_core", "langgraph", "agents")


def _loaded_after(statement: str) -> list[str]:
    code = (
        f"import sys\n{statement}\nprint(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return [name for name in out.stdout.strip().split(",") if name]


def test_importing_kernelexec_imports_no_framework() -> None:
    assert _loaded_after("import kernelexec, kernelexec.compat") == []


def test_each_adapter_imports_only_its_own_framework() -> None:
    assert "pydantic_ai" in _loaded_after("import kernelexec.compat.pydantic_ai")
    loaded = _loaded_after("import kernelexec.compat.openai_agents")
    assert "agents" in loaded and "deepagents" not in loaded and "smolagents" not in loaded
