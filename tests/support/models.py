"""A pydantic model importable by both the host and (with PYTHONPATH) a kernel."""

from __future__ import annotations

from pydantic import BaseModel, Field


class AgentState(BaseModel):
    name: str
    turns: int = 0
    notes: list[str] = Field(default_factory=list)
