"""``python -m kernelexec``: the command line."""

from kernelexec._cli._main import entry

entry()
