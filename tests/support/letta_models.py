"""Stand-ins for Letta's schemas, shaped as Letta's own (importable by kernels via PYTHONPATH).

Letta is not a dependency; the adapter reads these by their attributes exactly as it reads
Letta's classes.
"""

from __future__ import annotations

import enum
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

import kernelexec as kx


class Block(BaseModel):
    label: str
    value: str


class Memory(BaseModel):
    blocks: list[Block] = Field(default_factory=list)

    def get_block(self, label: str) -> Block:
        for block in self.blocks:
            if block.label == label:
                return block
        raise KeyError(label)

    def update_block_value(self, label: str, value: str) -> None:
        self.get_block(label).value = value


class AgentEnvironmentVariable(BaseModel):
    key: str
    value: str
    agent_id: str


class AgentState(BaseModel):
    id: str
    name: str = "agent"
    memory: Memory = Field(default_factory=Memory)
    secrets: list[AgentEnvironmentVariable] = Field(default_factory=list)
    project_id: str | None = None

    def get_agent_env_vars_as_dict(self) -> dict[str, str]:
        return {s.key: s.value or "" for s in self.secrets}


class PipRequirement(BaseModel):
    name: str
    version: str | None = None

    def __str__(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


class SandboxType(str, enum.Enum):
    LOCAL = "local"
    E2B = "e2b"


class LocalSandboxConfig(BaseModel):
    sandbox_dir: str | None = None
    use_venv: bool = False
    venv_name: str = "venv"
    pip_requirements: list[PipRequirement] = Field(default_factory=list)


class SandboxConfig(BaseModel):
    id: str = "sandbox-config-1"
    type: SandboxType = SandboxType.LOCAL
    organization_id: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class Tool(BaseModel):
    id: str
    name: str
    source_code: str
    json_schema: dict[str, Any]
    args_json_schema: dict[str, Any] | None = None
    pip_requirements: list[PipRequirement] | None = None


class User(BaseModel):
    id: str = "user-1"
    organization_id: str = "org-1"


def create_tool_from_func(fn: Callable[..., Any], **fields: Any) -> Tool:
    """A Letta Tool for ``fn`` as Letta's test helper makes one: its source and schema."""
    source = textwrap.dedent(inspect.getsource(fn))
    schema = kx.Tool.from_function(fn).json_schema
    return Tool(
        id=f"tool-{fn.__name__}", name=fn.__name__, source_code=source, json_schema=schema, **fields
    )


def agent(agent_id: str = "agent-1", **fields: Any) -> AgentState:
    """An agent with Letta's two default memory blocks."""
    memory = Memory(
        blocks=[
            Block(label="human", value="username: sarah"),
            Block(label="persona", value="This is the persona"),
        ]
    )
    return AgentState(id=agent_id, memory=memory, **fields)
