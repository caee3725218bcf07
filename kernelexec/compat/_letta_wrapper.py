"""A Letta tool as a kernelexec tool: Letta's script semantics wrapped around its source.

Letta runs a tool by generating a script: ``from typing import *``, a ``client``, the
arguments converted by schema type and coerced by annotation, the call (awaited for ``async
def``), the return value converted. Here that script becomes one wrapper function, defined in
the agent's kernel next to the tool's own source and called with the arguments as JSON data
(never as generated code); the helpers it uses are ``_letta_kernel``, sent as text.
"""

from __future__ import annotations

import ast
import functools
import importlib.resources
import json
import warnings
from dataclasses import dataclass
from typing import Any

from kernelexec._exceptions import ConfigError, ToolDefinitionError, ToolSchemaWarning
from kernelexec._tools._tool import Tool

WRAPPER_PREFIX = "_kx_letta_"


@dataclass(frozen=True)
class LettaTool:
    """A Letta tool ready to call.

    Attributes:
        name: The tool's function name.
        tool: The wrapper, a kernelexec :class:`Tool` taking ``args``, ``sandbox_dir`` and
            ``agent_id`` (and ``agent_state`` with its class's import path ``state_class``,
            ``"module:QualName"``, when the tool takes one).
        inject_agent_state: The function has an ``agent_state`` parameter.
        inject_agent_id: The function has an ``agent_id`` parameter the schema does not list.
        is_async: The function is an ``async def``.
    """

    name: str
    tool: Tool
    inject_agent_state: bool
    inject_agent_id: bool
    is_async: bool


def read_tool(tool_object: Any, tool_name: str) -> LettaTool:
    """The wrapper for a Letta ``Tool``-like object (``name``, ``source_code``,
    ``json_schema``, ``args_json_schema``).

    Raises:
        ConfigError: the object has no source code, or its name is not a Python identifier.
    """
    if tool_object is None:
        raise ConfigError(
            f"tool {tool_name!r}: tool_object is required (kernelexec has no Letta database "
            "to look the tool up in; pass the Tool the server already holds)"
        )
    name = getattr(tool_object, "name", None) or tool_name
    source = getattr(tool_object, "source_code", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"tool name {name!r} is not a Python identifier")
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"tool {name!r} has no source_code")
    schema = getattr(tool_object, "args_json_schema", None) or _parameters(
        getattr(tool_object, "json_schema", None)
    )
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if properties is None:
        properties = _derived_properties(source, name)
    types = {
        key: {"type": spec.get("type")} if isinstance(spec, dict) else {}
        for key, spec in dict(properties).items()
    }
    return _build(name, source, json.dumps(types, sort_keys=True))


def _derived_properties(source: str, name: str) -> dict[str, Any]:
    """The parameters kernelexec derives from the source, for a tool stored without a schema."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ToolSchemaWarning)
            derived = Tool.from_source(source, name=name)
    except ToolDefinitionError:
        return {}  # the kernel reports what is wrong with the source when it runs it
    return dict(_parameters(derived.json_schema).get("properties") or {})


def _parameters(json_schema: Any) -> dict[str, Any]:
    if isinstance(json_schema, dict) and isinstance(json_schema.get("parameters"), dict):
        return dict(json_schema["parameters"])
    return {}


@functools.lru_cache(maxsize=512)
def _build(name: str, source: str, types_json: str) -> LettaTool:
    types: dict[str, Any] = json.loads(types_json)
    parsed = Tool(name=name, source_code=source, json_schema={})  # for its signature only
    params, is_async = parsed.parameter_names, parsed.is_async
    inject_state = "agent_state" in params
    inject_id = "agent_id" in params and "agent_id" not in types
    wrapper = WRAPPER_PREFIX + name
    extra = ", agent_state=None, state_class=None" if inject_state else ""
    define = "async def" if is_async else "def"
    body = [
        f"{define} {wrapper}(args, sandbox_dir=None, agent_id=None{extra}):",
        "    global client",
        "    _kx_letta_enter(sandbox_dir)",
        "    with _kx_letta_pythonpath():",
        "        client = _kx_letta_client()",
        f"        kwargs = _kx_letta_coerce({name}, args, {types!r})",
    ]
    if inject_state:
        body.append("        state = _kx_letta_state(agent_state, state_class)")
        body.append("        kwargs['agent_state'] = state")
    if inject_id:
        body.append("        kwargs['agent_id'] = agent_id")
    call = f"{'await ' if is_async else ''}{name}(**kwargs)"
    if inject_state:
        body.append(f"        value = {call}")
        body.append("        _kx_letta_keep(agent_state, state)")
        body.append("        return _kx_letta_convert(value)")
    else:
        body.append(f"        return _kx_letta_convert({call})")
    text = "\n\n".join(["from typing import *", _helpers(), source.rstrip(), "\n".join(body)])
    schema = {
        "name": wrapper,
        "description": f"Letta tool {name}, called with Letta's script semantics.",
        "parameters": {
            "type": "object",
            "properties": {
                "args": {"type": "object"},
                "sandbox_dir": {"type": ["string", "null"]},
                "agent_id": {"type": ["string", "null"]},
                "state_class": {"type": ["string", "null"]},
            },
            "required": ["args"],
            "additionalProperties": False,
        },
    }
    tool = Tool(name=wrapper, source_code=text + "\n", json_schema=schema)
    return LettaTool(name, tool, inject_state, inject_id, is_async)


@functools.cache
def _helpers() -> str:
    """``_letta_kernel``'s source without its module docstring."""
    text = importlib.resources.files(__package__).joinpath("_letta_kernel.py").read_text()
    tree = ast.parse(text)
    first = tree.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines = text.splitlines(keepends=True)
        text = "".join(lines[first.end_lineno or 0 :])
    return text.strip()
