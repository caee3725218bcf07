"""Finding 3 of the hostile probe: JSON values of any size or depth, and tool shapes."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

import kernelexec as kx

BIG = 7**20_000  # 16,902 digits: over the interpreter's 4,300-digit conversion limit


def tool(src: str, **kwargs: Any) -> kx.Tool:
    return kx.Tool.from_source(textwrap.dedent(src), **kwargs)


INC = tool(
    '''
    def inc(n: int) -> int:
        """Add one."""
        return n + 1
    '''
)

MARK = tool(
    '''
    def mark(v: object = None) -> bool:
        """Record that it ran."""
        global marked
        marked = True
        return True
    '''
)


def test_big_integers_cross_both_ways_exactly(tmp_path: Any) -> None:
    with kx.KernelExecutor(record_dir=tmp_path) as ex:
        result = ex.call_tool(INC, {"n": BIG}, agent_id="big")
        assert result.ok, result.error
        assert result.func_return == BIG + 1
        made = ex.call_tool(
            tool(
                '''
                def make() -> int:
                    """A big number."""
                    return 3**30_000
                '''
            ),
            agent_id="big",
        )
        assert made.ok and made.func_return == 3**30_000
        assert made.recording_error is None


@pytest.mark.parametrize("record", [False, True])
def test_deep_arguments_are_invalid_args_before_running(record: bool) -> None:
    deep: Any = 1
    for _ in range(1_000):
        deep = [deep]
    with kx.KernelExecutor(record=record) as ex:
        result = ex.call_tool(MARK, {"v": deep}, agent_id="deep")
        assert result.error is not None and result.error.kind == "invalid_args"
        assert "deeper than 100 levels" in result.error.evalue
        assert ex.run_code("'marked' in globals()", agent_id="deep").result == "False"


def test_a_deep_return_value_fails_clearly() -> None:
    nest = tool(
        '''
        def nest() -> list:
            """Deeply nested."""
            v = 1
            for _ in range(5_000):
                v = [v]
            return v
        '''
    )
    with kx.KernelExecutor() as ex:
        result = ex.call_tool(nest, agent_id="nest")
        assert result.error is not None and result.error.kind == "result_too_large"
        assert "deeper than 100 levels" in result.error.evalue
        assert ex.run_code("1 + 1", agent_id="nest").result == "2"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (b"bytes", "bytes is not a JSON value"),
        (object(), "object is not a JSON value"),
        ({1: "x"}, "key 1 is not a string"),
    ],
)
def test_non_json_argument_values_are_invalid_args(
    executor: kx.KernelExecutor, value: Any, fragment: str
) -> None:
    result = executor.call_tool(MARK, {"v": value}, agent_id="non-json")
    assert result.error is not None and result.error.kind == "invalid_args"
    assert fragment in result.error.evalue and "'v'" in result.error.evalue


@pytest.mark.parametrize(
    "ref", ["http://127.0.0.1:9/schema.json", "file:///etc/passwd", "#/$defs/missing"]
)
def test_unresolvable_refs_are_invalid_args(executor: kx.KernelExecutor, ref: str) -> None:
    schema = {"type": "object", "properties": {"v": {"$ref": ref}}}
    odd = MARK.model_copy(update={"args_json_schema": schema})
    result = executor.call_tool(odd, {"v": 1}, agent_id="refs")
    assert result.error is not None and result.error.kind == "invalid_args"
    assert "$ref" in result.error.evalue


def test_kwargs_tools_accept_extra_keys(executor: kx.KernelExecutor) -> None:
    kw = tool(
        '''
        def kw(a: int, **rest: int) -> dict:
            """Return the extra keys."""
            return {"a": a, "rest": rest}
        '''
    )
    assert kw.json_schema["parameters"]["additionalProperties"] is True
    result = executor.call_tool(kw, {"a": 1, "b": 2, "c": 3}, agent_id="kwargs")
    assert result.ok, result.error
    assert result.func_return == {"a": 1, "rest": {"b": 2, "c": 3}}


def test_positional_only_and_generator_tools_are_refused_at_definition() -> None:
    with pytest.raises(kx.ToolDefinitionError, match="positional-only"):
        tool(
            '''
            def po(a: int, /, b: int) -> int:
                """Positional only."""
                return a + b
            '''
        )
    with pytest.raises(kx.ToolDefinitionError, match="generator"):
        tool(
            '''
            def gen(n: int):
                """A generator."""
                for i in range(n):
                    yield i
            '''
        )
    # yield inside a nested function or a generator expression is fine
    fine = tool(
        '''
        def fine(n: int) -> list:
            """Uses generators inside."""
            def inner():
                yield 1
            return list(inner()) + list(i for i in range(n))
        '''
    )
    assert fine.name == "fine"


def test_a_hand_built_generator_tool_is_invalid_tool_in_the_kernel(
    executor: kx.KernelExecutor,
) -> None:
    schema = {"name": "gen", "description": "", "parameters": {"type": "object"}}
    gen = kx.Tool(name="gen", source_code="def gen():\n    yield 1\n", json_schema=schema)
    result = executor.call_tool(gen, {}, agent_id="hand-built")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "generator" in result.error.evalue
    open_schema = {**schema, "parameters": {"type": "object", "additionalProperties": True}}
    po = kx.Tool(name="po", source_code="def po(a, /):\n    return a\n", json_schema=open_schema)
    result = executor.call_tool(po, {"a": 1}, agent_id="hand-built")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "positional-only" in result.error.evalue
