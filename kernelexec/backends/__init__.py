"""Kernel backends: where kernels run and how kernelexec talks to them.

A backend implements :class:`KernelBackend` (start a kernel) and :class:`KernelConnection`
(send, receive, alive, interrupt, restart, shutdown). :class:`LocalBackend` runs ipykernel on this
machine.
"""

from kernelexec.backends._base import ExecuteRequest, KernelBackend, KernelConnection, KernelMessage
from kernelexec.backends._local import LocalBackend, LocalConnection

__all__ = [
    "ExecuteRequest",
    "KernelBackend",
    "KernelConnection",
    "KernelMessage",
    "LocalBackend",
    "LocalConnection",
]
