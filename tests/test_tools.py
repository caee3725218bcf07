"""Tool construction and schema derivation (host side, no kernel needed) and the public API."""

from __future__ import annotations

import textwrap
import warnings

import pytest

import kernelexec as kx


def test_public_api_is_curated() -> None:
    assert sorted(kx.__all__) == kx.__all__
    for name in kx.__all__:
        assert hasattr(kx, name), name
    public = {n for n in dir(kx) if not n.startswith("_")}
    modules = {"backends", "compat", "widgets"}  # public subpackages (present once imported)
    assert public - modules - set(kx.__all__) == set()


def test_schema_from_annotations_and_google_docstring() -> None:
    src = textwrap.dedent(
        '''
        from typing import Literal, Optional

        def search(query: str, tags: list[str], limit: Optional[int] = 10,
                   mode: Literal["fast", "deep"] = "fast", ratio: float | None = None,
                   meta: dict[str, int] = {}, pair: tuple[int, str] = (1, "a")) -> list:
            """Search the index.

            Longer text here.

            Args:
                query: What to look for.
                tags: Tags to filter by.
                limit: Most results.
                mode: How hard to look.
            """
        '''
    )
    tool = kx.Tool.from_source(src)
    schema = tool.json_schema
    assert schema["name"] == "search"
    assert schema["description"] == "Search the index.\n\nLonger text here."
    params = schema["parameters"]
    assert params["required"] == ["query", "tags"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for."}
    assert props["tags"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": "Tags to filter by.",
    }
    assert props["limit"] == {
        "type": ["integer", "null"],
        "description": "Most results.",
        "default": 10,
    }
    assert props["mode"]["enum"] == ["fast", "deep"]
    assert props["ratio"]["type"] == ["number", "null"]
    assert props["meta"] == {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "default": {},
    }
    assert props["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]


@pytest.mark.parametrize(
    "doc",
    [
        "Scale it.\n\nParameters\n----------\nx : float\n    The value.\n",
        "Scale it.\n\n:param x: The value.\n",
    ],
    ids=["numpy", "rest"],
)
def test_numpy_and_rest_docstrings(doc: str) -> None:
    src = f'def scale(x: float) -> float:\n    """{doc}"""\n    return x * 2\n'
    tool = kx.Tool.from_source(src)
    assert tool.json_schema["description"] == "Scale it."
    assert tool.json_schema["parameters"]["properties"]["x"]["description"] == "The value."


def test_missing_docstring_and_annotation_warn_but_work() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tool = kx.Tool.from_source("def f(x, y=3):\n    return x\n")
    assert {type(w.message) for w in caught} == {kx.ToolSchemaWarning}
    assert tool.json_schema["description"] == ""
    assert tool.json_schema["parameters"]["properties"]["x"] == {}
    assert tool.validate_args({"x": object.__name__}) == []


def test_from_source_errors_are_typed() -> None:
    with pytest.raises(kx.ToolDefinitionError, match="does not parse"):
        kx.Tool.from_source("def f(:\n  pass")
    with pytest.raises(kx.ToolDefinitionError, match="exactly one public"):
        kx.Tool.from_source("def a(): pass\ndef b(): pass\n")
    with pytest.raises(kx.ToolDefinitionError, match="no top-level function 'c'"):
        kx.Tool.from_source("def a(): pass\n", name="c")
    with pytest.raises(ValueError, match="identifier"):
        kx.Tool(name="not a name", source_code="", json_schema={})
    helper = kx.Tool.from_source("def _h(): pass\ndef main(): return _h()\n")
    assert helper.name == "main"


def test_from_function_drops_decorators() -> None:
    def deco(fn):  # type: ignore[no-untyped-def]
        return fn

    @deco
    def greet(name: str) -> str:
        """Say hello."""
        return f"hi {name}"

    tool = kx.Tool.from_function(greet)
    assert tool.source_code.startswith("def greet(")
    assert tool.takes_agent_state is False


def test_args_json_schema_takes_precedence() -> None:
    tool = kx.Tool.from_source(
        "def f(n):\n    return n\n",
        args_json_schema={
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0}},
            "required": ["n"],
        },
    )
    assert tool.validate_args({"n": 3}) == []
    assert tool.validate_args({"n": -1}) == ["argument 'n': -1 is less than the minimum of 0"]
    assert tool.validate_args({"n": 1, "m": 2}) == ["unexpected argument 'm'"]
    assert tool.validate_args([1]) == ["arguments must be a JSON object, got list"]


def test_tool_result_shows_itself_in_a_notebook() -> None:
    ok = kx.ToolResult(status="success", func_return={"n": 2**70}, stdout="hi\n", duration_s=0.0032)
    text = ok._repr_markdown_()
    assert text.startswith("**success** in 3.2 ms")
    assert f'"n": {2**70}' in text and "stdout:\n```\nhi\n" in text
    error = kx.ExecError(kind="exception", ename="KeyError", evalue="'x'")
    failed = kx.ToolResult(status="error", error=error)._repr_markdown_()
    assert "exception: `KeyError: 'x'`" in failed and "func_return" not in failed
