"""The public names: ``exports`` reads the one list of them (the package's ``__init__``), and
``public`` shows kernelexec's public classes and functions as ``kernelexec.X`` (in reprs,
tracebacks, pickles and the API docs), not by the private module that defines each."""

from __future__ import annotations

import ast
import sys
import types
import typing

PACKAGE = "kernelexec"


def exports(init: str) -> dict[str, str]:
    """Each public name and the module that defines it, read from the package's ``__init__``
    (the file ``init``): the imports of its ``if TYPE_CHECKING:`` block, written ``X as X`` so
    that type checkers see them as the package's own. The package imports a name from its
    module on first use, so this one block is the only list of public names.
    """
    with open(init, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), init)
    found: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module is not None:
                for alias in stmt.names:
                    found[alias.asname or alias.name] = stmt.module
    return found


def public(module: str) -> None:
    """Name the package as the module of what ``kernelexec/__init__.py`` exports from
    ``module`` (its ``_EXPORTS``, read from the one list of public names). Call it as
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
    import inspect  # not for `import kernelexec` itself, which reads only the list

    own = inspect.get_annotations(cls)
    if not own or not any(isinstance(v, str) for v in own.values()):
        return
    namespace = vars(sys.modules[cls.__module__])
    try:
        hints = typing.get_type_hints(cls, globalns=namespace, include_extras=True)
    except Exception:  # a name only imported for type checkers: leave the strings
        return
    cls.__annotations__ = {name: hints.get(name, value) for name, value in own.items()}
