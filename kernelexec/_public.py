"""``public``: shows kernelexec's public classes and functions as ``kernelexec.X`` (in reprs,
tracebacks, pickles and the API docs), not by the private module that defines each."""

from __future__ import annotations

import inspect
import sys
import types
import typing

PACKAGE = "kernelexec"


def public(module: str) -> None:
    """Name the package as the module of what ``kernelexec/__init__.py`` exports from
    ``module`` (its ``_EXPORTS``, the one list of public names). Call it as
    ``public(__name__)`` at the end of the defining module, once its classes are built:
    pydantic resolves a model's annotations in its module's namespace while it builds the model.

    A class's own annotations are resolved first, in the defining module: ``typing.get_type_hints``
    looks names up in the module a class names, and ``kernelexec`` itself imports lazily.
    """
    exports: dict[str, str] = getattr(sys.modules[PACKAGE], "_EXPORTS", {})
    namespace = vars(sys.modules[module])
    for name, where in exports.items():
        obj = namespace.get(name) if where == module else None
        if isinstance(obj, type):
            _resolve_annotations(obj)
        if isinstance(obj, type | types.FunctionType):
            obj.__module__ = PACKAGE


def _resolve_annotations(cls: type) -> None:
    own = inspect.get_annotations(cls)
    if not own or not any(isinstance(v, str) for v in own.values()):
        return
    namespace = vars(sys.modules[cls.__module__])
    try:
        hints = typing.get_type_hints(cls, globalns=namespace, include_extras=True)
    except Exception:  # a name only imported for type checkers: leave the strings
        return
    cls.__annotations__ = {name: hints.get(name, value) for name, value in own.items()}
