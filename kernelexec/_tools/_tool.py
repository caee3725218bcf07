"""The :class:`Tool` model: a function's source, its JSON schema, and argument validation."""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import referencing
import referencing.exceptions
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from kernelexec import _json
from kernelexec._exceptions import NotebookError, ToolDefinitionError, ToolSchemaWarning
from kernelexec._public import public
from kernelexec._tools._schema import function_schema

if TYPE_CHECKING:
    import jsonschema


class Tool(BaseModel):
    """A function an agent can call, shipped to the kernel as source code.

    Attributes:
        name: The function's name; the source must define it at top level.
        source_code: Python source defining the function (it may define helpers too).
        json_schema: The OpenAI/Letta function schema ``{"name", "description", "parameters"}``.
        args_json_schema: When given, arguments are validated against this schema instead of
            ``json_schema["parameters"]`` (Letta's pydantic-style args schema).
        pip_requirements: Requirement lines the tool needs in its environment.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    source_code: str
    json_schema: dict[str, Any]
    args_json_schema: dict[str, Any] | None = None
    pip_requirements: list[str] = Field(default_factory=list)

    _validator: Any = PrivateAttr(default=None)
    _agent_state: bool | None = PrivateAttr(default=None)
    _async: bool | None = PrivateAttr(default=None)
    _digest: str | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError(f"tool name {value!r} is not a Python identifier")
        return value

    @classmethod
    def from_function(cls, fn: Callable[..., Any], **kwargs: Any) -> Tool:
        """Build a tool from a function defined in a source file.

        The function must be self-contained (imports inside it, or in ``pip_requirements``):
        only its own source is sent to the kernel. Decorators are dropped. ``async def``
        functions are awaited on the kernel's event loop; generator functions are refused.

        Raises:
            ToolDefinitionError: the function's source cannot be found or parsed.
        """
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as exc:
            raise ToolDefinitionError(f"cannot read the source of {fn!r}: {exc}") from None
        node = _parse_functions(source).get(fn.__name__)
        if node is None:
            raise ToolDefinitionError(f"no function named {fn.__name__!r} in its source")
        lines = source.splitlines(keepends=True)
        source = "".join(lines[node.lineno - 1 :])  # from the `def` line: decorators dropped
        return cls.from_source(source, name=fn.__name__, **kwargs)

    @classmethod
    def from_source(cls, source: str, name: str | None = None, **kwargs: Any) -> Tool:
        """Build a tool from source text, deriving its schema without running it.

        Args:
            source: Python source defining the function.
            name: The function to expose; ``None`` picks the one public top-level function.
            **kwargs: Other :class:`Tool` fields (``pip_requirements``, ``args_json_schema``).

        Raises:
            ToolDefinitionError: the source does not parse, the function is missing or
                ambiguous, has positional-only parameters, or is a generator function
                (``yield``; sync or async): a tool returns its result, it does not stream it.
        """
        functions = _parse_functions(source)
        if name is None:
            public = [n for n in functions if not n.startswith("_")]
            if len(public) != 1:
                found = ", ".join(public) or "none"
                raise ToolDefinitionError(
                    f"expected exactly one public top-level function, found {found}; pass name="
                )
            name = public[0]
        node = functions.get(name)
        if node is None:
            raise ToolDefinitionError(f"the source defines no top-level function {name!r}")
        _refuse_shape(node)
        schema, notes = function_schema(node)
        for note in notes:
            warnings.warn(note, ToolSchemaWarning, stacklevel=2)
        return cls(name=name, source_code=source, json_schema=schema, **kwargs)

    @classmethod
    def from_notebook(cls, path: str | Path) -> list[Tool]:
        """The tools defined in a notebook's code cells tagged ``tool``, one public function each.

        A cell may start with the ``%%tool`` magic line; its requirements come from the cell
        metadata ``kernelexec.pip_requirements`` or ``# requirements: a, b`` comment lines.

        Raises:
            NotebookError: the notebook is unreadable or a tagged cell is not a valid tool.
        """
        from kernelexec._notebooks._authoring import tool_cells  # nbformat: on first use

        tools: dict[str, Tool] = {}
        for cell in tool_cells(path):
            try:
                tool = cls.from_source(cell.source, pip_requirements=cell.requirements)
            except ToolDefinitionError as exc:
                raise NotebookError(f"{path}, cell {cell.index}: {exc}") from None
            if tool.name in tools:
                raise NotebookError(f"{path}, cell {cell.index}: a second tool named {tool.name!r}")
            tools[tool.name] = tool
        return list(tools.values())

    @property
    def description(self) -> str:
        """The tool's description from its schema."""
        return str(self.json_schema.get("description", ""))

    @property
    def digest(self) -> str:
        """A hash of the source; the kernel redefines the tool when it changes."""
        if self._digest is None:
            digest = hashlib.sha256(self.source_code.encode()).hexdigest()[:16]
            object.__setattr__(self, "_digest", digest)
        return str(self._digest)

    @property
    def takes_agent_state(self) -> bool:
        """Whether the function has an ``agent_state`` parameter (injected, not in the schema)."""
        if self._agent_state is None:
            object.__setattr__(self, "_agent_state", self._find_agent_state())
        return bool(self._agent_state)

    @property
    def is_async(self) -> bool:
        """Whether the function is an ``async def`` (awaited on the kernel's event loop)."""
        if self._async is None:
            node = self._node()
            object.__setattr__(self, "_async", isinstance(node, ast.AsyncFunctionDef))
        return bool(self._async)

    def _node(self) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        try:
            return _parse_functions(self.source_code).get(self.name)
        except ToolDefinitionError:
            return None  # reported by the kernel when the tool is called (invalid_tool)

    def _find_agent_state(self) -> bool:
        return "agent_state" in self.parameter_names

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The function's parameter names as its source declares them (none when the source
        does not parse or lacks the function)."""
        node = self._node()
        if node is None:
            return ()
        a = node.args
        return tuple(p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs])

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The schema arguments are validated against."""
        if self.args_json_schema is not None:
            return self.args_json_schema
        params = self.json_schema.get("parameters")
        return params if isinstance(params, dict) else {"type": "object"}

    def validate_args(self, args: Any) -> list[str]:
        """Check arguments against the schema; return problems, each naming the argument."""
        if not isinstance(args, dict):
            return [f"arguments must be a JSON object, got {type(args).__name__}"]
        problems = []
        for key, value in args.items():
            if not isinstance(key, str):
                return [f"argument name {key!r} is not a string"]
            problem = _json.problem(value, key)
            if problem:
                problems.append(problem)
        if problems:
            return problems  # the schema is not checked against what is not JSON
        schema = self.parameters_schema
        if self._validator is None:
            # Imported on first use: importing jsonschema builds rfc3987-syntax's grammars
            # when that package is installed (1.2 s of CPU here), which every program that
            # imports kernelexec's models would pay at start (the MCP server before it can
            # answer ``initialize``).
            import jsonschema

            try:
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
            except jsonschema.SchemaError as exc:
                return [f"the tool's argument schema is invalid: {exc.message}"]
            # An empty registry: a $ref is resolved within the schema only, never fetched
            # from the network or read from a file.
            validator = cls(schema, registry=referencing.Registry())
            object.__setattr__(self, "_validator", validator)
        props = schema.get("properties") or {}
        if schema.get("additionalProperties") is None:
            # Letta-style schemas omit additionalProperties; a name the function does not
            # take would fail inside the kernel anyway, so say so before anything runs.
            problems += [f"unexpected argument {k!r}" for k in args if k not in props]
        try:
            errors = sorted(self._validator.iter_errors(args), key=lambda e: list(e.path))
        except referencing.exceptions.Unresolvable as exc:
            return [f"the tool's argument schema has a $ref that cannot be resolved: {exc}"]
        problems += [_describe(error) for error in errors]
        return problems


def _describe(error: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"missing required argument {missing!r}"
    if error.validator == "additionalProperties" and not where:
        known = error.schema.get("properties", {}) if isinstance(error.schema, dict) else {}
        extra = sorted(set(error.instance) - set(known))  # type: ignore[arg-type]
        return "unexpected argument " + ", ".join(repr(e) for e in extra)
    return f"argument {where!r}: {error.message}" if where else error.message


def _refuse_shape(node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    """Refuse, at definition, the function shapes a call could not honour."""
    if node.args.posonlyargs:
        names = ", ".join(a.arg for a in node.args.posonlyargs)
        raise ToolDefinitionError(
            f"tool {node.name!r} has positional-only parameters ({names}); tools are called "
            "with JSON arguments by name: remove the '/'"
        )
    if _is_generator(node):
        raise ToolDefinitionError(
            f"tool {node.name!r} is a generator function (it yields); its body would never "
            "run: return a list instead"
        )


def _is_generator(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``yield`` appears in the function's own body (not in nested scopes)."""
    stack: list[ast.AST] = list(node.body)
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    while stack:
        item = stack.pop()
        if isinstance(item, ast.Yield | ast.YieldFrom):
            return True
        if isinstance(item, nested):
            continue
        stack.extend(ast.iter_child_nodes(item))
    return False


def _parse_functions(source: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ToolDefinitionError(f"tool source does not parse: {exc}") from None
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


public(__name__)
