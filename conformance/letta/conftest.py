"""Letta 0.11.7's own local-sandbox tests, run against kernelexec's ``AsyncToolSandboxKernel``.

Copied by ``run.sh`` next to Letta's ``tests/`` folder, so pytest loads it before Letta's
``tests/conftest.py`` and the test module: the module's
``from letta.services.tool_sandbox.local_sandbox import AsyncToolSandboxLocal`` then gets
:class:`ServerSandbox` below. Letta's tests and their assertions are not changed.

:class:`ServerSandbox` is the adapter plus the reads a Letta server's sandbox makes from Letta's
database, which the adapter leaves to its caller on purpose (docs/letta.md, "database"): the
tool by name when none is given, Letta's default local config when no ``sandbox_config`` is
given, and that config's variables when no ``sandbox_env_vars`` are given. The adapter runs at
its defaults (isolation "process"); ``KX_LETTA_ISOLATION=none`` runs it with
``configure(isolation="none")`` for comparison.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import letta.services.tool_sandbox.local_sandbox as local_sandbox
import pytest

from kernelexec.compat import letta as kx_letta
from kernelexec.compat.letta import AsyncToolSandboxKernel, ToolExecutionResult


class ServerSandbox(AsyncToolSandboxKernel):
    """kernelexec's sandbox, given what Letta's server gives its own."""

    async def _from_database(self) -> None:
        from letta.schemas.enums import SandboxType
        from letta.services.sandbox_config_manager import SandboxConfigManager
        from letta.services.tool_manager import ToolManager

        if self.tool is None:
            self.tool = await ToolManager().get_tool_by_name_async(
                tool_name=self.tool_name, actor=self.user
            )
        configs = SandboxConfigManager()
        if self.provided_sandbox_config is None:
            self.provided_sandbox_config = await configs.get_or_create_default_sandbox_config_async(
                sandbox_type=SandboxType.LOCAL, actor=self.user
            )
        if self.provided_sandbox_env_vars is None:
            self.provided_sandbox_env_vars = await configs.get_sandbox_env_vars_as_dict_async(
                sandbox_config_id=self.provided_sandbox_config.id, actor=self.user, limit=None
            )

    async def run(
        self, agent_state: Any = None, additional_env_vars: dict[str, Any] | None = None
    ) -> ToolExecutionResult:
        await self._from_database()
        return await super().run(agent_state=agent_state, additional_env_vars=additional_env_vars)


local_sandbox.AsyncToolSandboxLocal = ServerSandbox  # type: ignore[misc]


@pytest.fixture(scope="session", autouse=True)
def _adapter() -> Iterator[None]:
    # A Letta server creates its sqlite tables when its sync engine starts; the tests' first
    # fixture uses the async one.
    from letta.server.db import db_registry

    db_registry.initialize_sync()
    if os.environ.get("KX_LETTA_ISOLATION") == "none":
        kx_letta.configure(isolation="none")
    yield
    kx_letta.shutdown()


@pytest.fixture(autouse=True)
def _swapped(request: pytest.FixtureRequest) -> None:
    module = request.module
    if hasattr(module, "AsyncToolSandboxLocal"):
        assert module.AsyncToolSandboxLocal is ServerSandbox, "Letta's sandbox is not swapped"
