"""Checks of what a caller passes to a session's run, before anything is queued: plain
functions, each naming what was wrong."""

from __future__ import annotations

from typing import Any

from kernelexec._envs._envs import LocalEnv, VenvEnv, missing_requirements
from kernelexec._exceptions import RequirementsMissingError
from kernelexec._tools._tool import Tool


def check_requirements(tool: Tool, env: LocalEnv | VenvEnv | None, agent_id: str) -> None:
    """Refuse a tool whose ``pip_requirements`` the session's environment ``env`` lacks (it
    would fail with ``ModuleNotFoundError``, or worse, run against other versions).

    Raises:
        RequirementsMissingError: naming the missing requirements and what to do instead.
    """
    if not tool.pip_requirements or env is None:
        return
    missing = missing_requirements(env, tool.pip_requirements)
    if not missing:
        return
    where = (
        f"a venv with {', '.join(env.requirements) or 'no requirements'}"
        if isinstance(env, VenvEnv)
        else "the host's interpreter (LocalEnv)"
    )
    raise RequirementsMissingError(
        f"tool {tool.name!r} needs {', '.join(tool.pip_requirements)}, but session "
        f"{agent_id!r} runs in {where}, which lacks {', '.join(missing)}: call it "
        "through the executor (executor.call_tool(tool, args, agent_id=...) runs it in a "
        "venv with its requirements), or use the session "
        "executor.session(agent_id, executor.env_for(tool))",
        tuple(missing),
    )


def env_problem(env_vars: Any) -> str | None:
    """What is wrong with a run's ``env_vars`` (None: nothing)."""
    if env_vars is None:
        return None
    if not isinstance(env_vars, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
    ):
        return "env_vars must map str to str"
    return None
