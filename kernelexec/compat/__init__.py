"""Drop-in adapters that run other agent frameworks' tool contracts on kernelexec.

``kernelexec.compat.letta``: Letta's local tool sandbox (``AsyncToolSandboxLocal``) on
persistent kernels.
"""
