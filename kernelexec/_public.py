"""``public``: shows kernelexec's public classes and functions as ``kernelexec.X`` (in reprs,
tracebacks, pickles and the API docs), not by the private module that defines each."""

from __future__ import annotations

PACKAGE = "kernelexec"


def public(*objects: type | object) -> None:
    """Name the package as the module of ``objects`` (the names ``kernelexec/__init__.py``
    exports). Call it at the end of the defining module, once its classes are built: pydantic
    resolves a model's annotations in its module's namespace while it builds the model."""
    for obj in objects:
        obj.__module__ = PACKAGE
