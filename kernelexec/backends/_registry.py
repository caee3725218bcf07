"""Finding backends by name, through the ``kernelexec.backends`` entry-point group.

A package registers a backend class in its ``pyproject.toml``::

    [project.entry-points."kernelexec.backends"]
    mybackend = "mypackage.backend:MyBackend"

and ``KernelExecutor(backend="mybackend", backend_options={...})`` constructs it with those
keyword arguments. kernelexec registers its own local backend the same way.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kernelexec._exceptions import ConfigError
from kernelexec.backends._base import KernelBackend

GROUP = "kernelexec.backends"


@functools.cache
def _registered() -> tuple[EntryPoint, ...]:
    # Read once per process: a scan of every installed distribution's metadata (about 6 ms
    # here), which every executor made without a backend instance would otherwise pay.
    return tuple(entry_points(group=GROUP))


def backend_names() -> list[str]:
    """The names of every installed backend, sorted."""
    return sorted({ep.name for ep in _registered()})


def get_backend(name: str, **options: Any) -> KernelBackend:
    """Construct the backend registered as ``name`` with ``options``.

    Raises:
        ConfigError: no backend has that name, it cannot be loaded, it is not a
            :class:`KernelBackend`, or it refused the options.
    """
    found = [ep for ep in _registered() if ep.name == name]
    if not found:
        known = ", ".join(backend_names()) or "none"
        raise ConfigError(f"no kernelexec backend named {name!r} (installed: {known})")
    try:
        cls = found[0].load()
    except Exception as exc:
        raise ConfigError(f"backend {name!r} could not be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, KernelBackend)):
        raise ConfigError(f"backend {name!r} is not a KernelBackend ({found[0].value})")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"backend {name!r} rejected its options: {exc}") from None
