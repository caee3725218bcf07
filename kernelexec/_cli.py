"""The ``kernelexec`` command line (placeholder until the CLI lands)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kernelexec`` command."""
    raise SystemExit("kernelexec: the command line is not built yet")
