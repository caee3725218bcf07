"""``Exposure``: which host functions a session exposes to kernel code, and getting them there.

The session owns one. Modules exposed with ``AsyncSession.expose`` stay until the session closes;
each kernel the session gets (a start, a restart, after an eviction or a crash) needs them again,
so the exposure remembers which kernel (the lease's generation) has the kernel half installed
and which modules it already has. Functions passed as ``host_functions=`` for one call ride on
that call's request and are gone from the kernel when it ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from kernelexec._codemode import _kernel_side as kernel_side
from kernelexec._codemode._functions import HostFunction
from kernelexec._exceptions import ConfigError
from kernelexec._models import HostFunctions as HostFunctions
from kernelexec._protocol._install import ExecuteRequest, Installed, KernelModule, install_request

DEFAULT_MODULE = "tools"

KERNEL_MODULE = KernelModule(kernel_side.MODULE_NAME, kernel_side.__name__, keep=True)
"""Code mode's kernel half: kept by a kernel that has it (a fork's), whose ``install`` then
only applies the modules the request carries."""


class Exposure:
    """A session's exposed modules, and what its current kernel already has."""

    def __init__(self, bounds: Mapping[str, int] | None = None) -> None:
        self._bounds = dict(bounds or {})  # applied by the kernel half before it sends
        self.modules: dict[str, dict[str, HostFunction]] = {}
        self._installed = Installed()  # the kernel that has the kernel half
        self._sent: set[str] = set()  # modules that kernel has in their current version

    @property
    def active(self) -> bool:
        """Whether anything is exposed."""
        return bool(self.modules)

    def add(self, functions: Iterable[Any], module: str, timeout: float | None) -> None:
        """Expose ``functions`` as ``module`` (added to what the module has).

        Raises:
            ConfigError: a bad module name, or a function that cannot be exposed.
        """
        prepared = prepare(functions, module, timeout)
        self.modules.setdefault(module, {}).update(prepared)
        self._sent.discard(module)

    def installed_on(self, generation: int) -> bool:
        """Whether kernel ``generation`` has the kernel half."""
        return self._installed.on(generation)

    def install_request(self) -> ExecuteRequest:
        """The request that installs the kernel half (where missing) with every module exposed
        so far (call :meth:`installed` when it succeeded)."""
        return install_request(
            [KERNEL_MODULE],
            metadata={
                kernel_side.METADATA_KEY: {
                    "modules": self._specs(self.modules),
                    "bounds": self._bounds,
                }
            },
        )

    def installed(self, generation: int) -> None:
        """The kernel half and every module are in kernel ``generation`` now."""
        self._installed.mark(generation)
        self._sent = set(self.modules)

    def run_metadata(
        self, once: Mapping[str, Mapping[str, HostFunction]] | None
    ) -> dict[str, Any] | None:
        """Code mode's entry for a run's request metadata: modules exposed since the kernel
        got its last update, and this run's own functions (None: nothing to send)."""
        spec: dict[str, Any] = {}
        changed = {name: fns for name, fns in self.modules.items() if name not in self._sent}
        if changed:
            spec["modules"] = self._specs(changed)
            self._sent.update(changed)
        if once:
            spec["once"] = self._specs(once)
        return {kernel_side.METADATA_KEY: spec} if spec else None

    def callable_in_run(
        self, once: Mapping[str, Mapping[str, HostFunction]] | None
    ) -> dict[str, dict[str, HostFunction]]:
        """Everything kernel code may call during a run (this run's functions win)."""
        merged = {name: dict(fns) for name, fns in self.modules.items()}
        for name, fns in (once or {}).items():
            merged.setdefault(name, {}).update(fns)
        return merged

    @staticmethod
    def _specs(modules: Mapping[str, Mapping[str, HostFunction]]) -> dict[str, Any]:
        return {name: [fn.spec() for fn in fns.values()] for name, fns in modules.items()}


def prepare(
    functions: Iterable[Any], module: str, timeout: float | None
) -> dict[str, HostFunction]:
    """``functions`` checked and prepared for ``module``.

    Raises:
        ConfigError: a bad module name or timeout, or a function that cannot be exposed.
    """
    check_module(module)
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, not {timeout!r}")
    prepared: dict[str, HostFunction] = {}
    for target in functions:
        fn = HostFunction.of(target, timeout=timeout)
        if fn.name in prepared:
            raise ConfigError(f"two functions named {fn.name!r} for module {module!r}")
        prepared[fn.name] = fn
    if not prepared:
        raise ConfigError("nothing to expose: pass at least one function or kernelexec.Tool")
    return prepared


def one_call(host_functions: HostFunctions | None) -> dict[str, dict[str, HostFunction]] | None:
    """``host_functions=`` of one call, prepared (None when not given)."""
    if host_functions is None:
        return None
    if isinstance(host_functions, Mapping):
        return {name: prepare(fns, name, None) for name, fns in host_functions.items()}
    if callable(host_functions):
        host_functions = [host_functions]
    return {DEFAULT_MODULE: prepare(host_functions, DEFAULT_MODULE, None)}


def check_module(module: Any) -> None:
    """Refuse a module name kernel code could not import, or one that would hide another."""
    if not isinstance(module, str) or not all(p.isidentifier() for p in module.split(".")):
        raise ConfigError(f"module must be a dotted Python name, not {module!r}")
    top = module.split(".")[0]
    if top.startswith("_") or top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise ConfigError(f"module {module!r} would hide a standard library or private module")
