"""The debugger's read-only views: a call's summary, the history table, the variables table."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ipywidgets as w

from kernelexec._models import ToolResult

_OK = "#2e7d32"
_BAD = "#c62828"


@dataclass(frozen=True)
class Call:
    """One call made from the debugger."""

    tool: str
    args: dict[str, Any]
    result: ToolResult
    started: str  # local wall-clock time, HH:MM:SS


def summary_html(result: ToolResult) -> str:
    """Status, error, duration, restart and lost variables, then ``func_return`` pretty-printed."""
    colour = _OK if result.ok else _BAD
    parts = [f'<b style="color:{colour}">{html.escape(result.status)}</b>']
    if result.error is not None:
        err = result.error
        parts.append(
            f"<b>{html.escape(err.kind)}</b> <code>{html.escape(err.ename)}: "
            f"{html.escape(err.evalue)}</code>"
        )
    parts.append(f"{result.duration_s:.3f} s")
    if result.kernel_restarted:
        lost = ", ".join(result.lost_variables) or "none"
        parts.append(f"kernel restarted, variables lost: {html.escape(lost)}")
    if result.widgets_dropped:
        parts.append(f"{result.widgets_dropped} widget(s) shown as text")
    text = " &middot; ".join(parts)
    if result.ok:
        value = json.dumps(result.func_return, indent=2, ensure_ascii=False)
        text += f"<pre class='kx-return'>{html.escape(value)}</pre>"
    return f"<div class='kx-result'>{text}</div>"


def result_outputs(result: ToolResult) -> tuple[dict[str, Any], ...]:
    """What the Output area shows: the call's own outputs, plus the error with its traceback
    when the kernel sent none (timeouts, a dead kernel)."""
    outputs = [dict(o) for o in result.outputs]
    err = result.error
    if (
        err is not None
        and err.traceback
        and not any(o.get("output_type") == "error" for o in outputs)
    ):
        outputs.append(
            {
                "output_type": "error",
                "ename": err.ename,
                "evalue": err.evalue,
                "traceback": err.traceback,
            }
        )
    return tuple(outputs)


class HistoryView(w.VBox):
    """The calls as a table (time, tool, args, status, duration); a row's button loads it."""

    def __init__(self, on_load: Callable[[Call], None]) -> None:
        super().__init__([])
        self._on_load = on_load
        self.rows: list[w.Button] = []
        self.add_class("kx-history")
        self.update([])

    def update(self, calls: list[Call]) -> None:
        """Show ``calls`` (oldest first)."""
        header = ["", "time", "tool", "args", "status", "duration"]
        cells: list[w.Widget] = [w.HTML(f"<b>{h}</b>") for h in header]
        self.rows = []
        for i, call in enumerate(calls):
            load = w.Button(description=f"load {i + 1}", layout=w.Layout(width="6em"))
            load.on_click(lambda _b, call=call: self._on_load(call))
            self.rows.append(load)
            res = call.result
            status = res.status if res.error is None else f"{res.status} ({res.error.kind})"
            args = json.dumps(call.args, ensure_ascii=False)
            if len(args) > 80:
                args = args[:79] + "\u2026"
            cells += [
                load,
                w.HTML(call.started),
                w.HTML(html.escape(call.tool)),
                w.HTML(f"<code>{html.escape(args)}</code>"),
                w.HTML(
                    f'<span style="color:{_OK if res.ok else _BAD}">{html.escape(status)}</span>'
                ),
                w.HTML(f"{res.duration_s:.3f} s"),
            ]
        grid = w.GridBox(
            cells,
            layout=w.Layout(grid_template_columns="7em 6em 8em auto 12em 6em", grid_gap="2px 8px"),
        )
        self.children = [grid] if calls else [w.HTML("<i>no calls yet</i>")]


class VariablesView(w.HTML):
    """The sandbox kernel's user variables: name, type, short repr."""

    def __init__(self) -> None:
        super().__init__("")
        self.add_class("kx-variables")
        self.update({})

    def update(self, variables: dict[str, dict[str, str]]) -> None:
        """Show ``variables`` (name -> ``{"type", "repr"}``)."""
        if not variables:
            self.value = "<i>no variables</i>"
            return
        rows = "".join(
            f"<tr><td><code>{html.escape(name)}</code></td><td>{html.escape(info['type'])}</td>"
            f"<td><code>{html.escape(info['repr'])}</code></td></tr>"
            for name, info in sorted(variables.items())
        )
        self.value = (
            "<table><thead><tr><th>name</th><th>type</th><th>value</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
