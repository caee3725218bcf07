"""kernelexec.widgets: interactive debugging of agent tools in JupyterLab and Notebook 7.

:class:`ToolDebugger` is an ``ipywidgets.VBox``: a tool picker, a form generated from the
tool's JSON schema, Run / Interrupt / Restart on a sandbox session (through the executor, as an
agent's calls go), live output, the result, the history and the sandbox kernel's variables.
:class:`SchemaForm` is its arguments form, usable on its own.
"""

from kernelexec.widgets._debugger import ToolDebugger
from kernelexec.widgets._form import SchemaForm

__all__ = ["SchemaForm", "ToolDebugger"]
