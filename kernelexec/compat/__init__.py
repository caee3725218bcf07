"""Drop-in adapters that run other agent frameworks' tool contracts on kernelexec.

Each adapter imports its framework only when it is imported itself (``import kernelexec``
imports none), and needs that framework's extra:

- ``kernelexec.compat.smolagents``: ``KernelPythonExecutor``, a smolagents code executor.
- ``kernelexec.compat.pydantic_ai``: ``KernelWorkspace``, a pydantic-ai workspace backend.
- ``kernelexec.compat.deepagents``: ``KernelSandbox``, a deepagents sandbox backend.
- ``kernelexec.compat.openai_agents``: ``KernelSandboxClient``, an openai-agents sandbox client.
- ``kernelexec.compat.letta``: Letta's local tool sandbox (``AsyncToolSandboxLocal``) on
  persistent kernels.
"""
