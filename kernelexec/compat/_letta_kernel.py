"""Letta's tool-script semantics, inside the kernel: argument coercion, ``client``, results.

This module is never imported by the host. Its source text is put at the top of every Letta
wrapper tool (see ``_letta_wrapper``) and so runs in the kernel's user namespace, after
``from typing import *`` (Letta's generated script starts with it). Standard library only;
pydantic is used when the kernel's environment has it, as Letta's script does. No
``from __future__`` import: the text is not at the top of the cell it runs in.
"""

import ast
import contextlib
import importlib
import json
import os
import sys
import typing
from typing import Any

_kx_letta_wrapper_cls: list[Any] = []

# The session's own directory: where the kernel was when the first Letta tool was defined in it
# (this text runs again with every tool; the first value stays).
_kx_letta_home: str = globals().get("_kx_letta_home") or os.getcwd()


def _kx_letta_enter(sandbox_dir: str | None) -> None:
    """Run in ``sandbox_dir`` (else the session's own directory) with it first on
    ``sys.path``, as Letta's script file there would be."""
    target = sandbox_dir or _kx_letta_home
    try:
        os.makedirs(target, exist_ok=True)
        os.chdir(target)
    except OSError as exc:
        # The host lends sandbox_dir to a kernel with a user of its own where it can (a root
        # host); elsewhere (bwrap on a non-root host) the kernel reaches what it is given.
        raise PermissionError(
            f"sandbox_dir {target} is not usable by this tool's kernel (uid {os.getuid()}): "
            f"{exc.strerror}; give the kernels a directory they can reach and write, or run "
            "the adapter with configure(isolation='none') as Letta's local sandbox runs tools"
        ) from None
    if not sys.path or sys.path[0] != target:
        if target in sys.path:
            sys.path.remove(target)
        sys.path.insert(0, target)


@contextlib.contextmanager
def _kx_letta_pythonpath() -> Any:
    """The run's ``PYTHONPATH`` (a sandbox or agent variable, set only for this run) on
    ``sys.path`` after ``sandbox_dir`` while the tool runs, as it is for Letta's script, which
    a fresh interpreter runs with that environment."""
    entries = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and entry not in sys.path
    ]
    sys.path[1:1] = entries
    try:
        yield
    finally:
        for entry in entries:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def _kx_letta_state(agent_state: Any, state_class: Any) -> Any:
    """The agent state as its own class (with its methods) when that class is importable now,
    with ``sandbox_dir`` and the run's ``PYTHONPATH`` on ``sys.path``; else as it came."""
    if not isinstance(agent_state, dict) or not isinstance(state_class, str):
        return agent_state  # already rebuilt (the class was importable), or no class known
    module_name, _, qualname = state_class.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found.model_validate(agent_state)
    except Exception:
        return agent_state


def _kx_letta_keep(original: Any, state: Any) -> None:
    """Changes the tool made to a rebuilt agent state, written back into the data the
    kernel reports (``original``)."""
    if state is original or not isinstance(original, dict):
        return
    dump = getattr(state, "model_dump", None)
    if callable(dump):
        original.clear()
        original.update(dump(mode="json"))


def _kx_letta_client() -> Any:
    """Letta's ``client``: a ``letta_client.Letta`` when ``LETTA_API_KEY`` is set and the
    package is installed, else None."""
    key = os.getenv("LETTA_API_KEY")
    if not key:
        return None
    try:
        from letta_client import Letta
    except ImportError:
        return None
    try:
        return Letta(api_key=key)
    except TypeError:  # letta_client < 1.0 names it `token`
        return Letta(token=key)


def _kx_letta_by_schema(kind: Any, raw: Any) -> Any:
    """An argument as Letta's script would assign it from its JSON-schema type."""
    if kind == "integer":
        return int(raw)
    if kind == "boolean":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        raise ValueError(f"Invalid boolean value: {raw}")
    if kind in ("number", "array", "object") and isinstance(raw, str):
        # Letta writes the value into its script as Python source: a string is evaluated.
        for parse in (ast.literal_eval, json.loads):
            try:
                return parse(raw)
            except (ValueError, SyntaxError):
                continue
    return raw


def _kx_letta_by_annotation(value: Any, annotation: Any, namespace: dict[str, Any]) -> Any:
    """Letta's ``coerce_dict_args_by_annotations`` for one argument (raises when it cannot)."""
    if isinstance(annotation, typing.ForwardRef):
        annotation = annotation.__forward_arg__
    kind = eval(annotation, namespace) if isinstance(annotation, str) else annotation
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                if kind is not str:
                    raise
    origin = typing.get_origin(kind)
    if origin in (list, dict, tuple, set):
        return origin(value)
    return kind(value)


def _kx_letta_coerce(fn: Any, args: dict[str, Any], properties: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments Letta's script would pass: only the schema's parameters, each
    converted by its schema type, then all coerced by the function's annotations (or none of
    them when one fails, as Letta's script swallows the failure)."""
    kwargs = {
        name: _kx_letta_by_schema((properties[name] or {}).get("type"), raw)
        for name, raw in args.items()
        if name in properties
    }
    annotations = getattr(fn, "__annotations__", {}) or {}
    try:
        coerced = {
            name: _kx_letta_by_annotation(value, annotations[name], fn.__globals__)
            if name in annotations
            else value
            for name, value in kwargs.items()
        }
    except Exception:
        return kwargs
    return coerced


def _kx_letta_convert(value: Any) -> Any:
    """Letta's conversion of a return value: a pydantic dump, then ``json.dumps(default=str)``
    (a datetime becomes ``'2024-01-02 03:04:05'``, a set ``'{1, 2, 3}'``, bytes ``"b'abc'"``)."""
    try:
        from pydantic import BaseModel, ConfigDict
    except ImportError:
        print("Pydantic not available in sandbox environment, falling back to string conversion")
        value = str(value)
    else:
        try:
            if not _kx_letta_wrapper_cls:

                class _TempResultWrapper(BaseModel):
                    model_config = ConfigDict(arbitrary_types_allowed=True)
                    result: Any

                _kx_letta_wrapper_cls.append(_TempResultWrapper)
            value = _kx_letta_wrapper_cls[0](result=value).model_dump()["result"]
        except Exception as exc:
            print(f"Failed to serialize result with Pydantic wrapper: {exc}")
            value = str(value)
    text = json.dumps(value, default=str)
    value = json.loads(text)
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        # NaN or an infinity: Letta's JSON transport gives the float back, kernelexec's
        # result channel would give the string "NaN"; the host decodes this text itself.
        return {_KX_LETTA_JSON: text}
    return value


_KX_LETTA_JSON = "__kx_letta_json__"
