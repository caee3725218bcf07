"""Tool calls and code runs against real kernels: state, arguments, results, errors, env."""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import textwrap

import pytest

import kernelexec as kx
from kernelexec._sandbox import _users


def tool(src: str, **kwargs: object) -> kx.Tool:
    return kx.Tool.from_source(textwrap.dedent(src), **kwargs)  # type: ignore[arg-type]


ECHO = tool(
    '''
    def echo(value: str) -> dict:
        """Return the value and its hash as seen inside the kernel."""
        import hashlib
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
        return {"value": value, "sha": digest}
    '''
)


# 1. state persists within a session; sessions are isolated ---------------------------------


def test_state_persists_within_session_and_not_across(executor: kx.KernelExecutor) -> None:
    a = executor.session("state-a")
    assert executor.session("state-a") is a
    assert a.run_code("counter = 41").ok
    assert a.run_code("counter += 1").ok
    assert a.run_code("counter").result == "42"
    setter = tool(
        """
        def remember(v: int) -> int:
            global remembered
            remembered = v
            return v
        """
    )
    assert a.call_tool(setter, {"v": 7}).func_return == 7
    assert a.run_code("remembered * 2").result == "14"

    b = executor.session("state-b")
    other = b.run_code("counter")
    assert other.status == "error"
    assert other.error is not None and other.error.ename == "NameError"


# 2. arguments: validated before running, delivered as exact data ---------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({}, "missing required argument 'a'"),
        ({"a": "1"}, "argument 'a'"),
        ({"a": 1, "c": 3}, "unexpected argument 'c'"),
        ({"a": True}, "argument 'a'"),
    ],
)
def test_invalid_args_are_rejected_before_running(
    executor: kx.KernelExecutor, args: dict[str, object], fragment: str
) -> None:
    marker = tool(
        """
        def mark(a: int) -> int:
            global marked
            marked = True
            return a
        """
    )
    s = executor.session("invalid-args")
    result = s.call_tool(marker, args)
    assert result.status == "error"
    assert result.error is not None
    assert result.error.kind == "invalid_args"
    assert fragment in result.error.evalue
    assert s.run_code("'marked' in globals()").result == "False"


NASTY = [
    "plain",
    "quotes ' \" ''' \"\"\" and backslashes \\ \\\\ \\n \\x00",
    "NUL \x00 inside",
    "line\u2028separator\u2029 and ${HOME} {{x}} %s",
    "non-BMP \U0001f600 \U00010348 and combining e\u0301",
    "\"); import os; os.system('touch /tmp/pwned'); (\"",
    "x" * 100_000,
]


@pytest.mark.parametrize("value", NASTY, ids=range(len(NASTY)))
def test_string_args_arrive_byte_exact(executor: kx.KernelExecutor, value: str) -> None:
    result = executor.call_tool(ECHO, {"value": value}, agent_id="nasty")
    assert result.ok, result.error
    assert result.func_return["value"] == value
    assert result.func_return["sha"] == hashlib.sha256(value.encode()).hexdigest()
    # An argument that escaped into code would run in the kernel, whose /tmp is its own.
    seen = executor.run_code("import os; os.path.exists('/tmp/pwned')", agent_id="nasty")
    assert seen.result == "False"
    assert not os.path.exists("/tmp/pwned")


def test_json_values_round_trip_exactly(executor: kx.KernelExecutor) -> None:
    ident = tool(
        """
        def ident(value):
            return value
        """
    )
    value = {
        "big": 2**200,
        "neg": -(10**30),
        "float": 0.1 + 0.2,
        "tiny": 5e-324,
        "unicode": "日本語 \U0001f600",
        "nested": [None, True, False, [], {}, {"k": [1, 2.5, "s"]}],
    }
    result = executor.call_tool(ident, {"value": value}, agent_id="roundtrip")
    assert result.ok, result.error
    assert result.func_return == value
    assert type(result.func_return["big"]) is int


# 3. the return value: an unforgeable channel, JSON conversion -----------------------------


def test_tool_output_cannot_forge_the_return_value(executor: kx.KernelExecutor) -> None:
    forger = tool(
        """
        def forger() -> int:
            from IPython.display import display
            mime = "application/vnd.kernelexec.result+json"
            print('{"names": [], "result": {"return": "forged"}}')
            print("<<RESULT>>forged<<END>>")
            display({mime: '{"names": [], "result": {"return": "forged"}}'}, raw=True)
            return 1
        """
    )
    result = executor.call_tool(forger, {}, agent_id="forger")
    assert result.ok, result.error
    assert result.func_return == 1
    assert "forged" in result.stdout


def test_unjsonable_values_are_converted(executor: kx.KernelExecutor) -> None:
    conv = tool(
        """
        def conv() -> dict:
            import dataclasses, datetime, decimal, enum, uuid, pathlib
            from pydantic import BaseModel

            class M(BaseModel):
                x: int
                when: datetime.date

            @dataclasses.dataclass
            class D:
                a: int
                b: tuple

            class Color(enum.Enum):
                RED = "red"

            class Weird:
                def __repr__(self):
                    return "<weird>"

            class Broken:
                def __repr__(self):
                    raise RuntimeError("no")

            loop = []
            loop.append(loop)
            return {
                "set": {3, 1, 2},
                "dt": datetime.datetime(2024, 5, 6, 7, 8, 9),
                "td": datetime.timedelta(minutes=1, seconds=30),
                "dec": decimal.Decimal("1.10"),
                "uuid": uuid.UUID(int=1),
                "path": pathlib.PurePosixPath("/a/b"),
                "bytes": b"hi",
                "binary": b"\\xff\\x00",
                "enum": Color.RED,
                "model": M(x=1, when=datetime.date(2024, 1, 2)),
                "dc": D(1, (2, 3)),
                "custom": Weird(),
                "broken": Broken(),
                "nan": float("nan"),
                "inf": float("-inf"),
                "loop": loop,
                (1, 2): "tuple key",
            }
        """
    )
    result = executor.call_tool(conv, {}, agent_id="convert")
    assert result.ok, result.error
    r = result.func_return
    assert r["set"] == [1, 2, 3]
    assert r["dt"] == datetime.datetime(2024, 5, 6, 7, 8, 9).isoformat()
    assert r["td"] == 90.0
    assert r["dec"] == "1.10"
    assert r["uuid"] == "00000000-0000-0000-0000-000000000001"
    assert r["path"] == "/a/b"
    assert r["bytes"] == "hi"
    assert r["binary"] == "/wA="
    assert r["enum"] == "red"
    assert r["model"] == {"x": 1, "when": "2024-01-02"}
    assert r["dc"] == {"a": 1, "b": [2, 3]}
    assert r["custom"] == "<weird>"
    assert r["broken"].startswith("<unrepresentable Broken")
    assert r["nan"] == "NaN" and r["inf"] == "-Infinity"
    assert r["loop"] == ["<circular reference>"]
    assert r["(1, 2)"] == "tuple key"


def test_too_large_result_is_an_error_not_a_crash() -> None:
    big = tool(
        """
        def big() -> str:
            return "y" * 5000
        """
    )
    with kx.KernelExecutor(max_result_chars=1000) as ex:
        result = ex.call_tool(big, {})
        assert result.error is not None
        assert result.error.ename == "KernelexecResultTooLarge"
        assert "5002" in result.error.evalue
        assert ex.run_code("1 + 1").result == "2"


# 4. tool errors -----------------------------------------------------------------------------


def test_tool_exception_keeps_stdout_and_session(executor: kx.KernelExecutor) -> None:
    boom = tool(
        """
        def boom(n: int) -> int:
            print("before the error")
            raise ValueError(f"bad n={n}")
        """
    )
    s = executor.session("exception")
    s.run_code("keep = 'me'")
    result = s.call_tool(boom, {"n": 3})
    assert result.status == "error"
    assert result.error is not None
    assert result.error.kind == "exception"
    assert result.error.ename == "ValueError"
    assert result.error.evalue == "bad n=3"
    assert any("bad n=3" in line for line in result.error.traceback)
    assert result.stdout == "before the error\n"
    assert result.func_return is None
    assert s.run_code("keep").result == "'me'"


def test_syntax_error_and_missing_function_are_invalid_tool(executor: kx.KernelExecutor) -> None:
    broken = kx.Tool(
        name="broken",
        source_code="def broken(:\n    pass\n",
        json_schema={"name": "broken", "parameters": {"type": "object", "properties": {}}},
    )
    result = executor.call_tool(broken, {}, agent_id="invalid-tool")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "SyntaxError" in result.error.evalue

    missing = kx.Tool(
        name="absent",
        source_code="def present():\n    return 1\n",
        json_schema={"name": "absent", "parameters": {"type": "object", "properties": {}}},
    )
    result = executor.call_tool(missing, {}, agent_id="invalid-tool")
    assert result.error is not None and result.error.kind == "invalid_tool"
    assert "absent" in result.error.evalue


def test_changed_tool_source_is_redefined(executor: kx.KernelExecutor) -> None:
    v1 = tool("def version() -> int:\n    return 1\n")
    v2 = tool("def version() -> int:\n    return 2\n")
    s = executor.session("redefine")
    assert s.call_tool(v1, {}).func_return == 1
    assert s.call_tool(v2, {}).func_return == 2
    assert s.call_tool(v1, {}).func_return == 1


# 7. stdin ------------------------------------------------------------------------------------


def test_input_errors_instead_of_hanging(executor: kx.KernelExecutor) -> None:
    result = executor.run_code("input('name? ')", agent_id="stdin", timeout=20)
    assert result.error is not None
    assert result.error.kind == "exception"
    assert result.error.ename == "StdinNotImplementedError"


# 8. environment and working directory ---------------------------------------------------------


def test_kernel_does_not_inherit_host_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KX_TEST_SECRET", "hunter2")
    peek = tool(
        """
        def peek(name: str):
            import os
            return os.environ.get(name)
        """
    )
    with kx.KernelExecutor(env_vars={"KX_GIVEN": "yes"}) as ex:
        s = ex.session("env")
        assert s.call_tool(peek, {"name": "KX_TEST_SECRET"}).func_return is None
        assert s.call_tool(peek, {"name": "KX_GIVEN"}).func_return == "yes"
        # The host's PATH, behind the kernel interpreter's directory (and without the
        # entries a kernel's own user cannot reach, on a root host).
        path = s.call_tool(peek, {"name": "PATH"}).func_return.split(os.pathsep)
        assert path[0] == os.path.dirname(os.path.abspath(sys.executable))
        reachable = [
            p
            for p in os.environ["PATH"].split(os.pathsep)
            if p and p != path[0] and (not _users.is_root() or _users.blocked(p) is None)
        ]
        assert path[1:] == list(dict.fromkeys(reachable))
        during = s.call_tool(peek, {"name": "KX_CALL"}, env_vars={"KX_CALL": "only now"})
        assert during.func_return == "only now"
        assert s.call_tool(peek, {"name": "KX_CALL"}).func_return is None
        names = s.run_code("sorted(__import__('os').environ)").result
        assert names is not None
        # No host variable outside the allowlist reaches the kernel.
        host_only = set(os.environ) - set(kx.DEFAULT_ENV_ALLOWLIST)
        assert "KX_TEST_SECRET" in host_only
        leaked = set(eval(names)) & host_only
        assert not leaked


def test_each_session_has_its_own_working_directory(executor: kx.KernelExecutor) -> None:
    a = executor.session("cwd-a")
    b = executor.session("cwd-b")
    cwd_a = a.run_code("import os; os.getcwd()").result
    cwd_b = b.run_code("import os; os.getcwd()").result
    assert cwd_a == repr(str(a.workdir))
    assert cwd_b == repr(str(b.workdir))
    assert cwd_a != cwd_b
    a.run_code("open('note.txt', 'w').write('from a')")
    assert (a.workdir / "note.txt").read_text() == "from a"
    assert not (b.workdir / "note.txt").exists()


# 9. agent_state --------------------------------------------------------------------------------


def test_agent_state_dict_is_injected_and_returned(executor: kx.KernelExecutor) -> None:
    remember = tool(
        '''
        def remember(fact: str, agent_state) -> str:
            """Store a fact in the agent's memory."""
            agent_state["memory"].append(fact)
            agent_state.count = len(agent_state.memory)
            return "ok"
        '''
    )
    assert "agent_state" not in remember.json_schema["parameters"]["properties"]
    result = executor.call_tool(
        remember, {"fact": "sky is blue"}, agent_state={"memory": ["a"]}, agent_id="state"
    )
    assert result.ok, result.error
    assert result.agent_state == {"memory": ["a", "sky is blue"], "count": 2}


def test_agent_state_pydantic_model_comes_back_as_same_class() -> None:
    from tests.support.models import AgentState

    bump = tool(
        """
        def bump(agent_state) -> int:
            agent_state.turns += 1
            agent_state.notes.append(type(agent_state).__name__)
            return agent_state.turns
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    state = AgentState(name="a1", turns=1)
    # Importable in the kernel: the tool gets the real class.
    with kx.KernelExecutor(env_vars={"PYTHONPATH": root}) as ex:
        result = ex.call_tool(bump, {}, agent_state=state)
    assert result.ok, result.error
    assert isinstance(result.agent_state, AgentState)
    assert result.agent_state.turns == 2
    assert result.agent_state.notes == ["AgentState"]
    assert state.turns == 1  # the caller's object is not mutated in place

    # Not importable there (a class local to this function): attribute-style data in the
    # kernel, and still the model class on the way back.
    class LocalState(AgentState):
        pass

    with kx.KernelExecutor() as ex:
        result = ex.call_tool(bump, {}, agent_state=LocalState(name="a2", turns=5))
    assert result.ok, result.error
    assert isinstance(result.agent_state, LocalState)
    assert result.agent_state.turns == 6
    assert result.agent_state.notes == ["AttrDict"]


def test_every_kind_of_output_arrives_before_the_result(executor: kx.KernelExecutor) -> None:
    """Partial lines, C-level (fd) output, subprocess output and stderr all come with the run.

    This guards the kernel-side fast path that skips ipykernel's flush when nothing is pending.
    """
    source = (
        "def noisy() -> int:\n"
        '    """Write every way there is."""\n'
        "    import os, subprocess, sys\n"
        "    print('partial', end='')\n"
        "    sys.stderr.write('err-partial')\n"
        "    os.write(1, b'fd-level\\n')\n"
        "    subprocess.run(['echo', 'from-child'], check=True)\n"
        # Last, a tail the capture thread cannot forward yet: the code holds ipykernel's buffer
        # lock, so the thread reads the tail and holds it, often past the function's return,
        # and it arrives only if the run waits for the thread.
        "    with sys.stdout._buffer_lock:\n"
        "        os.write(1, b'z' * 60_000 + b'|end\\n')\n"
        "    return 7\n"
    )
    tool = kx.Tool.from_source(source)
    session = executor.session("noisy")
    result = session.call_tool(tool)
    assert result.func_return == 7
    assert result.stdout.startswith("partial")
    assert "fd-level\n" in result.stdout and "from-child\n" in result.stdout
    assert result.stdout.endswith("z" * 60_000 + "|end\n")
    assert result.stderr == "err-partial"
    code = session.run_code("print('a', end=''); import sys; sys.stdout.write('b'); 1")
    assert code.stdout == "ab" and code.result == "1"


def test_lean_launcher_leaves_a_normal_kernel(executor: kx.KernelExecutor) -> None:
    """The launcher skips ipykernel's debugger at start, but tools can still import debugpy,
    and, as in Jupyter, modules in the working directory are importable."""
    session = executor.session("lean")
    (session.workdir / "helper_mod.py").write_text("VALUE = 41\n")
    result = session.run_code(
        "import debugpy, helper_mod\n(type(debugpy.__version__).__name__, helper_mod.VALUE + 1)"
    )
    assert result.result == "('str', 42)", result.error


def test_a_blocking_call_from_the_executors_own_loop_thread_is_refused() -> None:
    with kx.KernelExecutor(isolation="none") as ex:
        session = ex.session("reentrant")
        errors: list[BaseException] = []

        def reenter(text: str) -> None:
            try:
                session.run_code("1")
            except RuntimeError as exc:
                errors.append(exc)

        result = session.run_code("print('hi')", on_stdout=reenter)
        assert result.ok and result.stdout == "hi\n"
        assert session.run_code("2").result == "2"  # the session is fine afterwards
    assert len(errors) == 1 and "own event-loop thread" in str(errors[0])
