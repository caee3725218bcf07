"""MkDocs hook: the CLI reference page gets every command's ``--help``, from the parser itself,
so the page cannot drift from the code."""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- cli-reference -->"


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, str]]:
    found = [(prefix, parser.format_help())]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{prefix} {name}")
    return found


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace the marker with one section per command."""
    if MARKER not in markdown:
        return markdown
    from kernelexec._cli._main import _parser

    parts = []
    for name, text in _commands(_parser(), "kernelexec")[1:]:
        parts.append(f"### `{name}`\n\n```text\n{text.rstrip()}\n```\n")
    return markdown.replace(MARKER, "\n".join(parts))
