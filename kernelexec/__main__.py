"""``python -m kernelexec``: the command line."""

from kernelexec._cli import entry

entry()
