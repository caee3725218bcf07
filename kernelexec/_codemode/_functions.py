"""``HostFunction``: one host callable (or ``kx.Tool``) that kernel code may call.

Holds what the kernel needs to show it (name, signature, docstring, sync or async), what the
host needs to check a call (a pydantic model of its parameters, or the tool's JSON schema), and
how to run it: ``async def`` functions on the event loop, plain ones on a thread of the session
(a slow sync function on the loop would stall every session, and one in the loop's default pool
every kernel start), each within its own timeout.

A parameter named ``agent_id`` or ``context`` is filled in by kernelexec (the session's agent
id, a :class:`~kernelexec.HostCallContext`); kernel code neither sees nor passes it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import pydantic
import pydantic_core

from kernelexec import _json
from kernelexec._codemode._kernel_side import _EXPORTED
from kernelexec._exceptions import ConfigError
from kernelexec._models import HostCallContext
from kernelexec._tools._tool import Tool

INJECTED = ("agent_id", "context")
"""Parameters kernelexec fills in; they are not part of what kernel code passes."""

_SHAPES = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


class ArgumentsRejected(Exception):
    """The kernel's arguments do not fit the function (the message says which and why)."""


class NotJSON(Exception):
    """The host function returned something that is not a JSON value."""


class TooLarge(NotJSON):
    """The host function's answer passes the bytes a host call may carry."""


class CallTimedOut(Exception):
    """The call took longer than the function's own timeout (a ``TimeoutError`` the function
    raised itself is its own error, not this)."""


@dataclass(frozen=True, slots=True)
class HostFunction:
    """A host callable prepared for calls from kernel code."""

    name: str
    fn: Callable[..., Any]
    signature: inspect.Signature  # without the injected parameters
    injected: frozenset[str]
    is_async: bool
    timeout: float | None
    model: type[pydantic.BaseModel] | None  # validates the arguments (else ``validate``)
    tool: Tool | None = None
    validate: Callable[[dict[str, Any]], list[str]] | None = None  # JSON-schema problems
    doc: str = ""
    awaitable_in_kernel: bool | None = None  # None: as the host function is (async or not)

    @classmethod
    def of(cls, target: Any, *, timeout: float | None) -> HostFunction:
        """Prepare ``target`` (a function, a callable object or a :class:`~kernelexec.Tool`).

        Raises:
            ConfigError: it cannot be exposed (no name, ``*args``, a reserved name, ...).
        """
        if isinstance(target, HostFunction):
            return target  # prepared already (another MCP server's tool)
        tool = target if isinstance(target, Tool) else None
        fn = _tool_function(target) if tool is not None else target
        if not callable(fn):
            raise ConfigError(f"cannot expose {target!r}: not a function or a kernelexec.Tool")
        name = tool.name if tool is not None else getattr(fn, "__name__", "")
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ConfigError(f"cannot expose {fn!r}: it needs a public identifier as its name")
        if name in _EXPORTED:
            raise ConfigError(f"cannot expose {name!r}: the name of an exception of code mode")
        try:
            full = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot expose {name!r}: no signature ({exc})") from None
        for param in full.parameters.values():
            if param.kind in _SHAPES:
                raise ConfigError(
                    f"cannot expose {name!r}: {_SHAPES[param.kind]} parameter {param.name!r} "
                    "(kernel code passes JSON arguments by name)"
                )
        injected = frozenset(p for p in full.parameters if p in INJECTED)
        visible = [p for p in full.parameters.values() if p.name not in injected]
        if tool is not None and tool.takes_agent_state:
            raise ConfigError(f"cannot expose tool {name!r}: it takes agent_state")
        call = getattr(fn, "__call__", None)  # noqa: B004 (an async __call__ counts too)
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
        return cls(
            name=name,
            fn=fn,
            signature=full.replace(parameters=visible),
            injected=injected,
            is_async=is_async,
            timeout=timeout,
            model=None if tool is not None else _arguments_model(name, fn, visible),
            tool=tool,
            validate=tool.validate_args if tool is not None else None,
        )

    @classmethod
    def from_schema(
        cls,
        name: str,
        description: str,
        schema: dict[str, Any],
        call: Callable[[dict[str, Any]], Awaitable[Any]],
        *,
        timeout: float | None,
    ) -> HostFunction:
        """A function known by its JSON schema only (another MCP server's tool): its kernel
        signature comes from the schema's properties (required ones first), its arguments are
        checked against the schema, and ``call`` gets them as one dict. In the kernel it is a
        plain function (code calls it without ``await``; threads call several at once).

        Raises:
            ConfigError: ``name`` is not an identifier, or the schema is not valid.
        """
        if not name.isidentifier() or name.startswith("_") or name in _EXPORTED:
            raise ConfigError(f"cannot expose {name!r}: it needs a public identifier as its name")
        validate = schema_validator(schema)
        properties = schema.get("properties") or {}
        required = [p for p in schema.get("required") or [] if p in properties]
        params = []
        for key in [*required, *(p for p in properties if p not in required)]:
            if not key.isidentifier():
                raise ConfigError(f"cannot expose {name!r}: parameter {key!r} is not a name")
            spec = properties[key] if isinstance(properties[key], dict) else {}
            default = inspect.Parameter.empty if key in required else spec.get("default")
            annotation = _schema_type(spec)
            params.append(
                inspect.Parameter(
                    key,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=default,
                    annotation=annotation or inspect.Parameter.empty,
                )
            )

        async def fn(**kwargs: Any) -> Any:
            return await call(kwargs)

        fn.__name__ = fn.__qualname__ = name
        return cls(
            name=name,
            fn=fn,
            signature=inspect.Signature(params),
            injected=frozenset(),
            is_async=True,
            timeout=timeout,
            model=None,
            validate=validate,
            doc=description,
            awaitable_in_kernel=False,
        )

    def spec(self) -> dict[str, Any]:
        """What the kernel builds the stub from: name, docstring, parameters, async."""
        params = []
        for p in self.signature.parameters.values():
            entry: dict[str, Any] = {"name": p.name}
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                entry["keyword_only"] = True
            if p.annotation is not inspect.Parameter.empty:
                entry["annotation"] = _annotation_text(p.annotation)
            if p.default is not inspect.Parameter.empty:
                if _json.problem(p.default, p.name) is None:
                    entry["default"] = _json.dumps(p.default)
                else:
                    entry["default_repr"] = repr(p.default)
            params.append(entry)
        spec: dict[str, Any] = {
            "name": self.name,
            "doc": self.doc
            or inspect.getdoc(self.fn)
            or (self.tool.description if self.tool else ""),
            "params": params,
            "async": self.is_async
            if self.awaitable_in_kernel is None
            else self.awaitable_in_kernel,
        }
        if self.signature.return_annotation is not inspect.Signature.empty:
            spec["returns"] = _annotation_text(self.signature.return_annotation)
        return spec

    def check(self, args: Any) -> dict[str, Any]:
        """The arguments to call with, validated; raises :class:`ArgumentsRejected`."""
        if not isinstance(args, dict):
            raise ArgumentsRejected(f"{self.name}(): arguments must be a JSON object")
        if self.validate is not None:
            problems = self.validate(args)
            if problems:
                raise ArgumentsRejected(f"{self.name}(): " + "; ".join(problems))
            return args
        assert self.model is not None
        try:
            model = self.model.model_validate(args)
        except pydantic.ValidationError as exc:
            raise ArgumentsRejected(f"{self.name}(): {_problems(exc)}") from None
        return {key: getattr(model, key) for key in args}

    async def run(
        self,
        args: dict[str, Any],
        context: HostCallContext,
        threads: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> Any:
        """Call the function (within its own timeout; :class:`CallTimedOut` past it); a plain
        function runs through ``threads`` (the session's own)."""
        kwargs = dict(args)
        if "agent_id" in self.injected:
            kwargs["agent_id"] = context.agent_id
        if "context" in self.injected:
            kwargs["context"] = context
        if self.is_async:
            work: Any = self.fn(**kwargs)
        else:
            work = threads(functools.partial(self.fn, **kwargs))
        if self.timeout is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        finally:
            if not task.done():
                task.cancel()
        if not done:
            raise CallTimedOut
        return task.result()


def result_text(value: Any, limit: int, max_bytes: int) -> str:
    """The JSON text of a host function's return value; :class:`NotJSON` when it has none,
    :class:`TooLarge` when it passes ``max_bytes`` of UTF-8.

    JSON values cross as they are; pydantic models, dataclasses, dates and the like as
    pydantic dumps them in JSON mode. Anything else is refused, never pickled or repr'd.
    """
    if _json.problem(value, "return") is not None:
        try:
            value = pydantic_core.to_jsonable_python(value)
        except (pydantic_core.PydanticSerializationError, ValueError, TypeError):
            raise NotJSON(f"returned a {type(value).__name__}, which is not a JSON value") from None
    try:
        text = _json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError) as exc:
        raise NotJSON(f"returned a value that is not JSON: {exc}") from None
    if len(text) > limit:
        raise NotJSON(f"returned {len(text)} characters of JSON; the limit is {limit}")
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise TooLarge(
            f"returned {size} bytes of JSON; a host call carries at most {max_bytes} "
            "(max_host_call_bytes)"
        )
    return text


def schema_validator(schema: dict[str, Any]) -> Callable[[dict[str, Any]], list[str]]:
    """A check of arguments against a JSON schema, as a :class:`~kernelexec.Tool` checks."""
    return Tool(name="schema", source_code="", json_schema={"parameters": schema}).validate_args


def _schema_type(spec: dict[str, Any]) -> str:
    kind = spec.get("type")
    names = {
        "string": "str",
        "integer": "int",
        "number": "float",
        "boolean": "bool",
        "array": "list",
        "object": "dict",
        "null": "None",
    }
    if isinstance(kind, str):
        return names.get(kind, "")
    if isinstance(kind, list):
        return " | ".join(names.get(k, "Any") for k in kind if isinstance(k, str))
    return ""


def _tool_function(tool: Tool) -> Callable[..., Any]:
    """The tool's function, defined on the host from its source (once per expose)."""
    namespace: dict[str, Any] = {"__name__": f"kernelexec_host_tool_{tool.name}"}
    try:
        exec(compile(tool.source_code, f"<kernelexec host tool {tool.name}>", "exec"), namespace)
    except Exception as exc:
        raise ConfigError(f"cannot expose tool {tool.name!r}: its source failed: {exc}") from exc
    fn = namespace.get(tool.name)
    if not callable(fn):
        raise ConfigError(f"cannot expose tool {tool.name!r}: its source defines no such function")
    return fn  # type: ignore[no-any-return]


def _arguments_model(
    name: str, fn: Callable[..., Any], params: list[inspect.Parameter]
) -> type[pydantic.BaseModel]:
    try:
        hints = get_type_hints(fn)
    except Exception:
        hints = {}
    fields: dict[str, Any] = {}
    for p in params:
        annotation = hints.get(p.name, Any)
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    config = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    try:
        return pydantic.create_model(f"{name}_arguments", __config__=config, **fields)
    except Exception as exc:
        raise ConfigError(
            f"cannot expose {name!r}: its parameters have no schema ({exc})"
        ) from None


def _problems(exc: pydantic.ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        if error["type"] == "missing":
            parts.append(f"missing required argument {where!r}")
        elif error["type"] == "extra_forbidden":
            parts.append(f"unexpected argument {where!r}")
        else:
            parts.append(f"argument {where!r}: {error['msg']}")
    return "; ".join(parts)


def _annotation_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type) and annotation.__module__ == "builtins":
        return annotation.__qualname__
    return inspect.formatannotation(annotation)
