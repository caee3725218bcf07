"""MkDocs hook: the Sphinx roles in docstrings (``:class:`~kernelexec.Tool` ``, ``:meth:``...)
become links to the API reference (code where the target is not documented), instead of showing
raw ``:class:`` text.

mkdocstrings renders a role as ``:class:<code>~kernelexec.Tool</code>``; each becomes an
``autoref`` element that mkdocs-autorefs resolves once every page is built (``optional``: an
unknown target stays plain code, never a broken link).
"""

from __future__ import annotations

import html
import re
from typing import Any

_ROLE = re.compile(r":(class|meth|func|attr|mod|data|exc|obj):<code>(~?)([\w.]+)</code>")
_CALLABLE = {"meth", "func"}


def _link(match: re.Match[str]) -> str:
    role, short, target = match.group(1), match.group(2), match.group(3)
    shown = target.rsplit(".", 1)[-1] if short else target
    if role in _CALLABLE:
        shown += "()"
    full = target if target.startswith("kernelexec") else f"kernelexec.{target}"
    return (
        f'<autoref identifier="{html.escape(full)}" optional>'
        f"<code>{html.escape(shown)}</code></autoref>"
    )


def on_page_content(content: str, page: Any, **kwargs: Any) -> str:
    """Replace every rendered role on the page."""
    return _ROLE.sub(_link, content)
