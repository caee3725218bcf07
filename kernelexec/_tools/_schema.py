"""JSON Schema for a tool's parameters, derived from its source without running it.

The host never executes tool code (a tool may import packages only its kernel has, or do
anything at import time), so annotations are read from the syntax tree: builtins and
``typing`` forms (``list[str]``, ``Optional[int]``, ``X | None``, ``Literal[...]``,
``dict[str, X]``, ``tuple[...]``) map to JSON Schema; a name it does not know gives an
unconstrained schema. Descriptions come from the docstring (Google, NumPy, reST or Epydoc, via
docstring-parser).
"""

from __future__ import annotations

import ast
import contextlib
from typing import Any

import docstring_parser

_SCALARS: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "None": {"type": "null"},
    "NoneType": {"type": "null"},
    "list": {"type": "array"},
    "List": {"type": "array"},
    "Sequence": {"type": "array"},
    "tuple": {"type": "array"},
    "Tuple": {"type": "array"},
    "set": {"type": "array", "uniqueItems": True},
    "Set": {"type": "array", "uniqueItems": True},
    "dict": {"type": "object"},
    "Dict": {"type": "object"},
    "Mapping": {"type": "object"},
    "Any": {},
    "object": {},
}
_ARRAYS = {"list", "List", "Sequence", "set", "Set", "frozenset", "Iterable"}
_MAPS = {"dict", "Dict", "Mapping"}
_HIDDEN_PARAMS = {"agent_state", "self"}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # typing.List, t.Optional
        return node.attr
    return None


def annotation_schema(node: ast.expr | None) -> dict[str, Any]:
    """Map an annotation's syntax tree to a JSON Schema fragment (``{}`` if unknown)."""
    if node is None:
        return {}
    if isinstance(node, ast.Constant):
        if node.value is None:
            return {"type": "null"}
        if isinstance(node.value, str):  # a string annotation: parse it and recurse
            try:
                return annotation_schema(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return {}
        return {}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([node.left, node.right])
    name = _name(node)
    if name is not None:
        return dict(_SCALARS.get(name, {}))
    if not isinstance(node, ast.Subscript):
        return {}
    base = _name(node.value)
    args: list[ast.expr] = (
        list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    )
    if base == "Optional":
        return _union([args[0], ast.Constant(None)])
    if base == "Union":
        return _union(args)
    if base == "Literal":
        values = []
        for arg in args:
            try:
                values.append(ast.literal_eval(arg))
            except ValueError:
                return {}
        return {"enum": values}
    if base == "Annotated":
        return annotation_schema(args[0])
    if base in _ARRAYS:
        schema: dict[str, Any] = dict(_SCALARS.get(base, {"type": "array"}))
        items = annotation_schema(args[0])
        if items:
            schema["items"] = items
        return schema
    if base in ("tuple", "Tuple"):
        if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value is Ellipsis:
            items = annotation_schema(args[0])
            return {"type": "array", **({"items": items} if items else {})}
        return {
            "type": "array",
            "prefixItems": [annotation_schema(a) for a in args],
            "minItems": len(args),
            "maxItems": len(args),
        }
    if base in _MAPS:
        mapping: dict[str, Any] = {"type": "object"}
        if len(args) == 2:
            value_schema = annotation_schema(args[1])
            if value_schema:
                mapping["additionalProperties"] = value_schema
        return mapping
    return {}


def _union(nodes: list[ast.expr]) -> dict[str, Any]:
    options = [annotation_schema(n) for n in nodes]
    if any(not o for o in options):
        return {}
    flat: list[dict[str, Any]] = []
    for option in options:
        flat.extend(option.get("anyOf", [option]))
    if all(set(o) == {"type"} for o in flat):
        types = list(dict.fromkeys(o["type"] for o in flat))
        return {"type": types[0] if len(types) == 1 else types}
    return {"anyOf": flat}


def function_schema(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
) -> tuple[dict[str, Any], list[str]]:
    """Build the OpenAI/Letta function schema for a function definition.

    Returns:
        The schema and a list of warnings (missing docstring, unannotated parameters).
    """
    warnings: list[str] = []
    doc_text = ast.get_docstring(node) or ""
    if not doc_text:
        warnings.append(f"tool {node.name!r} has no docstring: its description is empty")
    doc = docstring_parser.parse(doc_text)
    param_docs = {p.arg_name: (p.description or "") for p in doc.params}
    description = "\n\n".join(
        part for part in (doc.short_description, doc.long_description) if part
    ).strip()

    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += list(args.defaults)
    pairs = list(zip(positional, defaults, strict=True))
    pairs += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))

    properties: dict[str, Any] = {}
    required: list[str] = []
    for arg, default in pairs:
        if arg.arg in _HIDDEN_PARAMS:
            continue
        if arg.annotation is None:
            warnings.append(f"parameter {arg.arg!r} of {node.name!r} has no annotation")
        prop = annotation_schema(arg.annotation)
        if param_docs.get(arg.arg):
            prop["description"] = param_docs[arg.arg]
        if default is None:
            required.append(arg.arg)
        else:
            with contextlib.suppress(ValueError):  # not a literal: the function has it
                prop["default"] = ast.literal_eval(default)
        properties[arg.arg] = prop

    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    # **kwargs takes any other name; without it, only the named parameters.
    parameters["additionalProperties"] = args.kwarg is not None
    schema = {"name": node.name, "description": description, "parameters": parameters}
    return schema, warnings
