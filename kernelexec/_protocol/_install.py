"""Shipping kernelexec's kernel halves into a kernel: the declared kernel modules, the one install
request, reading its answers, and the record of which kernel has what.

A kernel half is a real module of the package (ruff, mypy and one import contract check it:
standard library only) that the host never runs. A feature declares it once as a
:class:`KernelModule`; :func:`install_request` carries the sources of the modules a kernel needs
in one execute request's metadata, and one fixed loader (:data:`LOADER`) executes each there
under its declared name and calls its entry function. Text rather than an import, because the
kernel's interpreter (a venv's, a gateway's) need not have kernelexec, or this version of it.
The answers of the entry functions come back in one payload of the reply (:func:`answers`).
"""

from __future__ import annotations

import functools
import importlib.resources
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kernelexec._protocol import _kernel_loader as kernel_loader
from kernelexec._protocol import _kernel_side as kernel_side

INSTALL_KEY = "kernelexec_install"
"""The request-metadata key of the install spec (the modules, their sources and entries)."""

ANSWERS_PAYLOAD = "kernelexec.installed"
"""The ``source`` of the install reply's payload with the entry functions' answers."""

FILENAME = kernel_side.KERNEL_FILENAME
"""The file name the kernel's tracebacks give for code of a kernel half."""

COMPILED = kernel_side.COMPILED_MODULE_NAME
"""The module a fork server leaves in its kernels with the sources it compiled (by text)."""

LOADER = (
    inspect.getsource(kernel_loader.__kx_install)
    + f"__kx_install({INSTALL_KEY!r}, {ANSWERS_PAYLOAD!r}, {FILENAME!r}, {COMPILED!r})"
    + "; del __kx_install\n"
)
"""The code of every install request: :func:`._kernel_loader.__kx_install` and one call of it.
For each module of the spec in order, a module the kernel lacks (or one not ``keep``) is
executed from its source (or the code its fork server compiled from the same text) as a fresh
module under its name, and its entry function is called with the spec's arguments (on a kept
module too)."""


@dataclass(frozen=True, slots=True)
class KernelModule:
    """A kernel half, as its feature declares it.

    Attributes:
        name: The name it is installed under in the kernel's ``sys.modules``.
        origin: The package module whose file is its source (``kernelexec._files._kernel_files``).
        entry: The function the loader calls after executing it (None: none).
        keep: Whether a kernel that has it already keeps its copy (and that copy's state);
            otherwise every install executes it afresh.
    """

    name: str
    origin: str
    entry: str | None = "install"
    keep: bool = False

    def source(self) -> str:
        """The module's source text."""
        return _source(self.origin)


@functools.cache
def _source(origin: str) -> str:
    package, _, module = origin.rpartition(".")
    return importlib.resources.files(package).joinpath(f"{module}.py").read_text()


@dataclass(frozen=True, slots=True)
class ExecuteRequest:
    """The parts of an ``execute_request`` kernelexec sends."""

    code: str
    silent: bool = False
    store_history: bool = True
    user_expressions: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    msg_type: str = "execute_request"

    @property
    def reply_type(self) -> str:
        """The msg_type of the request's reply."""
        return (
            kernel_side.CALL_REPLY
            if self.msg_type == kernel_side.CALL_REQUEST
            else ("execute_reply")
        )

    @property
    def quiet(self) -> bool:
        """Whether the kernel sends no busy/idle for it (its reply counts its outputs)."""
        return self.msg_type == kernel_side.CALL_REQUEST

    @property
    def announces_start(self) -> bool:
        """Whether the kernel publishes an ``execute_input`` once it runs the request's code
        (a request that is not silent): only from then on does a SIGINT reach the code, as
        ipykernel ignores SIGINT until a shell handler starts."""
        return self.msg_type == "execute_request" and not self.silent

    def content(self) -> dict[str, Any]:
        """The message content, with kernelexec's execution policy for every backend: no
        stdin (a tool asking for input fails instead of hanging) and no aborting of queued
        requests after an error (each call stands alone). A served call has everything in
        its metadata."""
        if self.msg_type == kernel_side.CALL_REQUEST:
            return {}
        return {
            "code": self.code,
            "silent": self.silent,
            "store_history": self.store_history,
            "user_expressions": self.user_expressions,
            "allow_stdin": False,
            "stop_on_error": False,
        }


def install_request(
    modules: Sequence[KernelModule | tuple[KernelModule, Sequence[Any]]],
    *,
    metadata: dict[str, Any] | None = None,
    user_expressions: dict[str, str] | None = None,
) -> ExecuteRequest:
    """The one request that installs kernel halves: ``modules`` in order, each alone or with
    the arguments of its entry function; ``metadata`` rides along for the modules to read
    (their own keys), ``user_expressions`` are evaluated after. Silent and kept out of the
    history, like all of kernelexec's own requests."""
    spec = []
    for item in modules:
        module, args = item if isinstance(item, tuple) else (item, ())
        spec.append([module.name, module.source(), module.keep, module.entry, list(args)])
    return ExecuteRequest(
        code=LOADER,
        silent=True,
        store_history=False,
        user_expressions=dict(user_expressions or {}),
        metadata={**(metadata or {}), INSTALL_KEY: {"modules": spec}},
    )


def answers(reply: dict[str, Any]) -> list[Any] | None:
    """The entry functions' answers in the reply to :func:`install_request` (in the order of its
    modules), or None when the reply has none (the install failed, or was not one)."""
    for payload in reply.get("payload") or []:
        if isinstance(payload, dict) and payload.get("source") == ANSWERS_PAYLOAD:
            got = payload.get("answers")
            return got if isinstance(got, list) else None
    return None


@dataclass(slots=True)
class Installed:
    """Which kernel has a feature's kernel halves: the lease's generation of the last successful
    install, and its connection where the feature holds one (a restart, a replacement or a fork
    is another kernel, which needs them again)."""

    _where: tuple[int, int] | None = None

    def on(self, generation: int, conn: object = None) -> bool:
        """Whether kernel ``generation`` (of connection ``conn``) has them."""
        return self._where == (generation, id(conn))

    def mark(self, generation: int, conn: object = None) -> None:
        """Kernel ``generation`` (of ``conn``) has them now."""
        self._where = (generation, id(conn))

    def forget(self) -> None:
        """No kernel is known to have them (the next use installs them again)."""
        self._where = None
