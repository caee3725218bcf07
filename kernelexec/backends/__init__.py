"""Kernel backends: where kernels run and how kernelexec talks to them.

A backend implements :class:`KernelBackend` (check, fingerprint, start a kernel) and
:class:`KernelConnection` (send, receive, interrupt, restart, shutdown); the docstring of
``kernelexec.backends._base`` says who calls each method and when. :class:`LocalBackend` runs
ipykernel on this machine; :class:`GatewayBackend` runs kernels on a Jupyter Kernel Gateway or
Enterprise Gateway (it needs the ``gateway`` extra once a kernel starts). Backends are found by
name with :func:`get_backend` through the ``kernelexec.backends`` entry-point group.
"""

from kernelexec.backends._base import (
    KernelBackend,
    KernelConnection,
    KernelDied,
    KernelLaunch,
    KernelMessage,
)
from kernelexec.backends._gateway import GatewayBackend, GatewayConnection
from kernelexec.backends._local import LocalBackend, LocalConnection
from kernelexec.backends._registry import backend_names, get_backend

__all__ = [
    "GatewayBackend",
    "GatewayConnection",
    "KernelBackend",
    "KernelConnection",
    "KernelDied",
    "KernelLaunch",
    "KernelMessage",
    "LocalBackend",
    "LocalConnection",
    "backend_names",
    "get_backend",
]
