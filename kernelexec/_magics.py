"""The IPython extension (``%load_ext kernelexec``): write tools in cells and call them as an agent.

* ``%%tool`` defines the cell's function in the notebook (so it can be tried directly), builds a
  :class:`~kernelexec.Tool` from the cell and prints its JSON schema.
* ``%tool_call NAME {"arg": 1}`` calls that tool through a kernelexec sandbox (its own
  persistent kernel, arguments validated and sent as JSON) and returns the ``ToolResult``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from kernelexec._exceptions import KernelExecError
from kernelexec._models import ToolResult
from kernelexec._notebooks._authoring import requirements_of, strip_cell_magic
from kernelexec._sync import KernelExecutor
from kernelexec._tools._tool import Tool

AGENT_ID = "notebook"


@magics_class
class ToolMagics(Magics):
    """``%%tool`` and ``%tool_call``; the tools defined so far are in :attr:`tools`."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.tools: dict[str, Tool] = {}
        self._executor: KernelExecutor | None = None

    @cell_magic
    def tool(self, line: str, cell: str) -> None:
        """Define the cell's one public function as a tool and print its JSON schema."""
        try:
            source = strip_cell_magic(cell)
            tool = Tool.from_source(source, pip_requirements=requirements_of(source, {}))
        except KernelExecError as exc:
            raise UsageError(f"%%tool: {exc}") from None
        assert self.shell is not None
        result = self.shell.run_cell(cell, store_history=False)
        if not result.success:
            return
        self.tools[tool.name] = tool
        print(json.dumps(tool.json_schema, indent=2, ensure_ascii=False))

    @line_magic
    def tool_call(self, line: str) -> ToolResult:
        """``%tool_call NAME JSON``: call a ``%%tool`` tool in a kernelexec sandbox."""
        name, _, raw = line.strip().partition(" ")
        if not name:
            raise UsageError('usage: %tool_call NAME {"arg": value}')
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none yet"
            raise UsageError(f"no %%tool named {name!r} (defined: {known})")
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            raise UsageError(f"the arguments are not valid JSON: {exc}") from None
        if not isinstance(args, dict):
            raise UsageError("the arguments must be a JSON object")
        if self._executor is None:
            self._executor = KernelExecutor()
        result = self._executor.call_tool(tool, args, agent_id=AGENT_ID)
        if result.stdout:
            sys.stdout.write(result.stdout)
        if result.stderr:
            sys.stderr.write(result.stderr)
        return result

    def close(self) -> None:
        """Shut the sandbox kernel down."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None


def load(ipython: Any) -> None:
    """Register the magics (idempotent)."""
    if getattr(ipython, "_kernelexec_magics", None) is None:
        magics = ToolMagics(ipython)
        ipython.register_magics(magics)
        ipython._kernelexec_magics = magics


def unload(ipython: Any) -> None:
    """Shut down the extension's sandbox kernel."""
    magics = getattr(ipython, "_kernelexec_magics", None)
    if magics is not None:
        magics.close()
