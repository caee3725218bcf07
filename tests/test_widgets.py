"""The tool debugger driven headlessly: through its API and through its own widgets' values and
``.click()``, against real sandbox kernels."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import ipywidgets as w
import pytest

import kernelexec as kx
from kernelexec.widgets import ToolDebugger

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

TYPES_SOURCE = '''
from typing import Literal


def every_type(
    text: str,
    count: int,
    ratio: float,
    flag: bool,
    colour: Literal["red", "green"],
    items: list[int],
    options: dict,
    maybe: int | None = None,
    level: int = 3,
    note: str = "hi",
) -> dict:
    """Take one of everything.

    Args:
        text: Some text.
        count: How many.
    """
    return {"text": text, "count": count, "items": items}
'''

TOOLS_SOURCE = '''
def add(a: int, b: int = 2) -> int:
    """Add two numbers; leaves `created` behind.

    Args:
        a: The first number.
        b: The second number.
    """
    global created
    created = [a, b]
    print("adding", a, b)
    return a + b


def nap(seconds: float = 30.0) -> str:
    """Sleep, after saying so."""
    import sys
    import time

    print("sleeping", flush=True)
    sys.stderr.write("zzz\\n")
    sys.stderr.flush()
    time.sleep(seconds)
    return "woke"


def fail(message: str) -> None:
    """Raise."""
    raise ValueError(message)


def die() -> None:
    """Kill the kernel."""
    import os

    os._exit(3)


def remember(item: str, agent_state: dict) -> int:
    """Append to the agent's memory; reads a per-call variable."""
    import os

    agent_state.setdefault("memory", []).append(item + os.environ.get("SUFFIX", ""))
    return len(agent_state["memory"])
'''


def _tools(source: str) -> list[kx.Tool]:
    import ast

    names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    return [kx.Tool.from_source(source, name=name) for name in names]


@pytest.fixture
def dbg() -> Iterator[ToolDebugger]:
    debugger = ToolDebugger(_tools(TOOLS_SOURCE), agent_id="dbg-test")
    try:
        yield debugger
    finally:
        debugger.close()


def _wait_for_output(dbg: ToolDebugger, text: str) -> None:
    """Block until the debugger's output area shows ``text`` (it arrives from another thread)."""
    seen = threading.Event()

    def check(_change: object = None) -> None:
        if any(text in str(o.get("text", "")) for o in dbg.output.outputs):
            seen.set()

    dbg.output.observe(check, names="outputs")
    check()
    assert seen.wait(30), f"{text!r} never reached the output area"
    dbg.output.unobserve(check, names="outputs")


def test_every_schema_type_maps_to_a_field_and_back() -> None:
    tool = kx.Tool.from_source(TYPES_SOURCE, name="every_type")
    dbg = ToolDebugger([tool])
    try:
        fields = dbg.form.fields
        kinds = {name: type(f.input) for name, f in fields.items()}
        assert kinds == {
            "text": w.Text,
            "count": w.IntText,
            "ratio": w.FloatText,
            "flag": w.Checkbox,
            "colour": w.Dropdown,
            "items": w.Textarea,
            "options": w.Textarea,
            "maybe": w.Textarea,
            "level": w.IntText,
            "note": w.Text,
        }
        assert fields["text"].input.description == "text *"  # required, marked
        assert fields["level"].input.description == "level"
        assert "Some text." in fields["text"].help.value
        assert "(default: 3)" in fields["level"].help.value
        # Defaults filled; required JSON fields start empty, and say so.
        args, problems = dbg.form.read()
        assert args == {
            "text": "",
            "count": 0,
            "ratio": 0.0,
            "flag": False,
            "colour": "red",
            "maybe": None,
            "level": 3,
            "note": "hi",
        }
        assert problems == {"items": "required", "options": "required"}
        with pytest.raises(kx.ConfigError, match="argument 'items': required"):
            _ = dbg.args
        values = {
            "text": 'quote " and \\ and \u2028',
            "count": -7,
            "ratio": 2.5,
            "flag": True,
            "colour": "green",
            "items": [1, 2, 3],
            "options": {"deep": {"x": [None, True]}},
            "maybe": 12,
            "level": 9,
            "note": "",
        }
        dbg.set_args(values)
        assert dbg.args == values
        assert json.loads(fields["options"].input.value) == values["options"]
        assert fields["colour"].input.label == "green"
        # The widgets hold the values: change them directly and read them back.
        fields["count"].input.value = 41
        fields["flag"].input.value = False
        fields["items"].input.value = "[4]"
        fields["maybe"].input.value = ""
        args = dbg.args
        assert (args["count"], args["flag"], args["items"]) == (41, False, [4])
        assert "maybe" not in args  # an optional field left empty stays out of the call
        # set_args resets what it is not given.
        dbg.set_args(
            {
                "text": "t",
                "count": 1,
                "ratio": 0,
                "flag": False,
                "colour": "red",
                "items": [],
                "options": {},
            }
        )
        assert (dbg.args["level"], dbg.args["note"], dbg.args["maybe"]) == (3, "hi", None)
    finally:
        dbg.close()


def test_bounds_enums_and_bad_values() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 5},
            "x": {"type": "number", "exclusiveMinimum": 0},
            "pick": {"enum": [1, "two", None]},
        },
        "required": ["n", "x", "pick"],
    }
    source = "def bounded(n, x, pick):\n    return [n, x, pick]\n"
    tool = kx.Tool(
        name="bounded",
        source_code=source,
        json_schema={"name": "bounded", "description": "", "parameters": schema},
    )
    dbg = ToolDebugger([tool])
    try:
        n = dbg.form.fields["n"].input
        assert isinstance(n, w.BoundedIntText) and (n.min, n.max) == (1, 5)
        assert isinstance(dbg.form.fields["x"].input, w.BoundedFloatText)
        dbg.set_args({"n": 5, "x": 0.5, "pick": None})
        assert dbg.args == {"n": 5, "x": 0.5, "pick": None}
        with pytest.raises(kx.ConfigError, match=r"argument 'n'.*outside"):
            dbg.set_args({"n": 6, "x": 1.0, "pick": 1})
        assert dbg.args == {"n": 5, "x": 0.5, "pick": None}  # unchanged after the refusal
        with pytest.raises(kx.ConfigError, match=r"argument 'pick'.*not one of"):
            dbg.set_args({"n": 1, "x": 1.0, "pick": "three"})
        with pytest.raises(kx.ConfigError, match=r"unknown argument.*'zzz'"):
            dbg.set_args({"zzz": 1})
        with pytest.raises(kx.ConfigError, match="no tool named 'nope'"):
            dbg.select("nope")
    finally:
        dbg.close()


def test_bad_input_shows_next_to_the_field_and_runs_nothing(dbg: ToolDebugger) -> None:
    tool = kx.Tool.from_source(TYPES_SOURCE, name="every_type")
    bad = ToolDebugger([tool], executor=dbg.executor, agent_id="dbg-bad")
    fields = bad.form.fields
    bad.set_args(
        {
            "text": "t",
            "count": 1,
            "ratio": 1.0,
            "flag": True,
            "colour": "red",
            "items": [1],
            "options": {},
        }
    )
    fields["options"].input.value = '{"unclosed": '
    with pytest.raises(kx.ConfigError, match="argument 'options': invalid JSON"):
        _ = bad.args
    bad.run_button.click()
    assert "invalid JSON" in fields["options"].problem.value
    assert fields["items"].problem.value == ""
    assert "not run" in bad.status.value
    result = bad.run()
    assert result.error is not None and result.error.kind == "invalid_args"
    # JSON that parses but that the schema rejects: shown next to its field, nothing runs.
    fields["options"].input.value = "{}"
    fields["items"].input.value = '["x"]'
    result = bad.run()
    assert result.error is not None and result.error.kind == "invalid_args"
    assert "is not of type 'integer'" in fields["items"].problem.value
    assert fields["options"].problem.value == ""
    assert bad.history == []
    assert dbg.executor.kernel_count == 0  # no kernel was ever started
    bad.close()


def test_run_history_variables_and_load(dbg: ToolDebugger) -> None:
    dbg.select("add")
    dbg.form.fields["a"].input.value = 40
    dbg.run_button.click()
    result = dbg.wait(60)
    assert result is not None and result.ok and result.func_return == 42
    assert dbg.output.outputs == (
        {"output_type": "stream", "name": "stdout", "text": "adding 40 2\n"},
    )
    assert "<pre class='kx-return'>42</pre>" in dbg.summary.value
    # The variables view shows what the call created, refreshed after the call.
    assert "<code>created</code>" in dbg.variables_view.value
    assert dbg.variables["created"] == {"type": "list", "repr": "[40, 2]"}
    r2 = (dbg.set_args({"a": 1, "b": 1}), dbg.run())[1]
    assert r2.func_return == 2
    assert [args for args, _ in dbg.history] == [{"a": 40, "b": 2}, {"a": 1, "b": 1}]
    assert len(dbg.history_view.rows) == 2
    dbg.history_view.rows[0].click()  # load the first call's arguments
    assert dbg.args == {"a": 40, "b": 2}


def test_errors_are_shown_with_their_traceback(dbg: ToolDebugger) -> None:
    dbg.select("fail")
    dbg.set_args({"message": "bad thing"})
    result = dbg.run()
    assert result.error is not None and result.error.kind == "exception"
    errors = [o for o in dbg.output.outputs if o["output_type"] == "error"]
    assert errors and errors[0]["ename"] == "ValueError"
    assert any("\x1b[" in line for line in errors[0]["traceback"])  # ANSI, for the renderer
    assert "ValueError: bad thing" in dbg.summary.value
    assert "exception" in dbg.summary.value


def test_interrupt_restart_and_a_dead_kernel(dbg: ToolDebugger) -> None:
    dbg.select("add")
    dbg.set_args({"a": 1})
    assert dbg.run().ok
    dbg.select("nap")
    dbg.run_button.click()
    _wait_for_output(dbg, "zzz")  # live stderr, while the call runs
    assert dbg.busy and dbg.run_button.disabled and not dbg.interrupt_button.disabled
    assert {"output_type": "stream", "name": "stdout", "text": "sleeping\n"} in dbg.output.outputs
    dbg.interrupt_button.click()
    result = dbg.wait(60)
    assert result is not None and result.error is not None
    assert result.error.ename == "KeyboardInterrupt"
    assert dbg.variables["created"]["repr"] == "[1, 2]"  # state kept across the interrupt
    dbg.restart_button.click()
    dbg.restart().result(60)
    assert dbg.variables == {}
    dbg.select("add")
    dbg.set_args({"a": 5})
    after = dbg.run()
    assert after.kernel_restarted and "created" in after.lost_variables
    assert "variables lost" in dbg.summary.value
    dbg.select("die")
    died = dbg.run()
    assert died.error is not None and died.error.kind == "kernel_died"
    dbg.select("add")
    assert dbg.run().func_return == 7  # a fresh kernel took over


def test_timeout_field(dbg: ToolDebugger) -> None:
    dbg.select("nap")
    dbg.set_args({"seconds": 30})
    dbg.timeout.value = 0.5
    result = dbg.run()
    assert result.error is not None and result.error.kind == "timeout"
    assert "timed out after 0.5 s" in dbg.summary.value


def test_agent_state_and_env_vars(dbg: ToolDebugger) -> None:
    dbg.select("remember")
    assert dbg.agent_state.box.layout.display is None  # shown for a tool that takes state
    dbg.agent_state.input.value = '{"memory": ["a"]}'
    dbg.env_vars.input.value = '{"SUFFIX": "!"}'
    dbg.set_args({"item": "b"})
    result = dbg.run()
    assert result.func_return == 2
    assert json.loads(dbg.agent_state.input.value) == {"memory": ["a", "b!"]}
    dbg.env_vars.input.value = '{"SUFFIX": 1}'
    rejected = dbg.run()
    assert rejected.error is not None and "env vars" in rejected.error.evalue
    assert "object of strings" in dbg.env_vars.problem.value
    dbg.select("add")
    assert dbg.agent_state.box.layout.display == "none"


def test_export_writes_a_notebook_that_replays(dbg: ToolDebugger, tmp_path: Path) -> None:
    dbg.select("add")
    for a in (1, 2):
        dbg.set_args({"a": a})
        assert dbg.run().ok
    dbg.export_path.value = str(tmp_path / "debug.ipynb")
    dbg.export_button.click()
    assert "kernelexec replay" in dbg.export_status.value
    report = kx.replay(tmp_path / "debug.ipynb")
    assert report.cells_run == 3 and report.differences == []


def test_export_never_overwrites_a_file_nobody_named(
    dbg: ToolDebugger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    users = tmp_path / "dbg-test.ipynb"  # the default name, taken by the user's own notebook
    users.write_text("the notebook the debugger runs in")
    dbg.select("add")
    dbg.set_args({"a": 1})
    assert dbg.run().ok
    dbg.export_button.click()
    assert users.read_text() == "the notebook the debugger runs in"
    picked = tmp_path / "dbg-test-1.ipynb"
    assert "dbg-test-1.ipynb" in dbg.export_status.value
    assert kx.replay(picked).cells_run == 2
    # Its own export is rewritten in place as the session grows, not copied again.
    dbg.set_args({"a": 2})
    assert dbg.run().ok
    assert dbg.export() == Path("dbg-test-1.ipynb")
    assert kx.replay(picked).cells_run == 3
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == [
        "dbg-test-1.ipynb",
        "dbg-test.ipynb",
    ]
    # A name the user gives is never overwritten unless asked to.
    dbg.export_path.value = str(users)
    dbg.export_button.click()
    assert "exists" in dbg.export_status.value and "overwrite=True" in dbg.export_status.value
    assert users.read_text() == "the notebook the debugger runs in"
    with pytest.raises(kx.ConfigError, match="exists"):
        dbg.export(users)
    assert dbg.export(users, overwrite=True) == users
    assert kx.replay(users).cells_run == 3


def test_form_fields_have_one_css_class_token_each(dbg: ToolDebugger) -> None:
    classes = [c for c in dbg.env_vars.input._dom_classes if c.startswith("kx-field-")]
    assert classes == ["kx-field-env-vars"]


def test_export_needs_a_recording_executor() -> None:
    with kx.KernelExecutor() as ex:
        dbg = ToolDebugger(_tools(TOOLS_SOURCE), executor=ex)
        with pytest.raises(kx.ConfigError, match="record=True"):
            dbg.export()
        dbg.close()
        assert ex.run_code("1 + 1").result == "2"


def test_tools_from_a_notebook_and_bad_arguments() -> None:
    dbg = ToolDebugger(NOTEBOOKS / "authoring_a_tool.ipynb")
    try:
        assert dbg.tool.name == "word_stats"
        assert dbg.args == {"text": "", "top": 3}
    finally:
        dbg.close()
    with pytest.raises(kx.ConfigError, match="no tools"):
        ToolDebugger([])
    with pytest.raises(TypeError, match=r"kernelexec\.Tool"):
        ToolDebugger(["add"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="KernelExecutor"):
        ToolDebugger(_tools(TOOLS_SOURCE), executor=object())  # type: ignore[arg-type]


def test_a_widget_a_tool_displays_leaves_its_text_fallback(dbg: ToolDebugger) -> None:
    source = (
        "def slider(n: int) -> int:\n"
        '    """Show a slider."""\n'
        "    import ipywidgets\n"
        "    from IPython.display import display\n"
        "    display(ipywidgets.IntSlider(value=n))\n"
        "    return n\n"
    )
    result = dbg.executor.call_tool(kx.Tool.from_source(source), {"n": 4}, agent_id="widgets")
    assert result.ok and result.widgets_dropped == 1
    assert result.outputs == [
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {"text/plain": "IntSlider(value=4)"},
        }
    ]


def test_widgets_public_names() -> None:
    import kernelexec.widgets as kw

    assert kw.__all__ == sorted(kw.__all__) == ["SchemaForm", "ToolDebugger"]
    assert all(getattr(kw, name).__doc__ for name in kw.__all__)


def test_rich_outputs_reach_the_output_area_and_close_closes_everything() -> None:
    source = (
        "def page(title: str) -> str:\n"
        '    """Show HTML."""\n'
        "    from IPython.display import HTML, display\n"
        "    display(HTML(f'<h1>{title}</h1>'))\n"
        "    return title\n"
    )
    dbg = ToolDebugger([kx.Tool.from_source(source)])
    dbg.set_args({"title": "Report"})
    assert dbg.run().ok
    (shown,) = dbg.output.outputs
    assert shown["output_type"] == "display_data"
    assert shown["data"]["text/html"] == "<h1>Report</h1>"
    field = dbg.form.fields["title"].input
    dbg.close()
    assert field.comm is None and dbg.output.comm is None  # no widget left open
