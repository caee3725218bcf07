"""The command line, run as real subprocesses: exit codes, output, ``--json``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.procs import signal_another_thread

TOOL = textwrap.dedent(
    '''
    def greet(name: str, times: int = 1) -> str:
        """Greet someone.

        Args:
            name: Who to greet.
            times: How often.
        """
        print("greeting", name)
        return " ".join(["hello " + name] * times)
    '''
)


def kernelexec(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelexec", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tool_file(tmp_path: Path) -> Path:
    path = tmp_path / "greet.py"
    path.write_text(TOOL)
    return path


def test_run_json_prints_only_json(tool_file: Path) -> None:
    proc = kernelexec(
        "run", str(tool_file), "--args", '{"name": "Ada \\u00e9", "times": 2}', "--json"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "success"
    assert result["func_return"] == "hello Ada é hello Ada é"
    assert result["stdout"] == "greeting Ada é\n"


def test_run_with_bad_args_fails_with_status_1(tool_file: Path) -> None:
    proc = kernelexec("run", str(tool_file), "--args", '{"times": 2}', "--json")
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["error"]["kind"] == "invalid_args"
    assert "name" in result["error"]["evalue"]


@pytest.mark.parametrize(
    "args",
    [
        ["run", "/no/such/file.py"],
        ["run", "TOOL", "--args", "{not json"],
        ["run", "TOOL", "--args", "[1, 2]"],
        ["frobnicate"],
    ],
)
def test_bad_usage_exits_2(tool_file: Path, args: list[str]) -> None:
    proc = kernelexec(*[str(tool_file) if a == "TOOL" else a for a in args])
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip()


def test_exec_from_argument_and_stdin() -> None:
    proc = kernelexec("exec", "print('hi'); 6 * 7")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hi\n42\n"
    proc = kernelexec("exec", "-", "--json", stdin="import sys\nprint('from stdin')\n1/0\n")
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["stdout"] == "from stdin\n"
    assert result["error"]["ename"] == "ZeroDivisionError"


def test_exec_timeout_exits_1() -> None:
    proc = kernelexec("exec", "import time; time.sleep(30)", "--timeout", "1", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"]["kind"] == "timeout"


def test_schema(tool_file: Path) -> None:
    proc = kernelexec("schema", str(tool_file))
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema["name"] == "greet"
    assert schema["parameters"]["required"] == ["name"]
    assert schema["parameters"]["properties"]["times"]["default"] == 1


def test_demo_runs_the_stateful_session(tmp_path: Path) -> None:
    proc = kernelexec("demo", "--calls", "20", "--record", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    notebooks = list(tmp_path.glob("demo-*.ipynb"))
    assert len(notebooks) == 1
    assert f"recorded the session as a notebook: {notebooks[0]}" in out
    assert "replayed 12 cells in a fresh kernel: no differences" in out
    steps = {
        r"load_orders\(n=10000\)": r"ok .* -> \{'loaded': 10000\}",
        r"add_tax\(rate='high'\)  bad args": r"ERROR .* -> invalid_args: InvalidArguments: ",
        r"refund\(order_id=99999\)  raises": r"ERROR .* -> exception: KeyError: ",
        r"run_code: sleep 60 s, timeout 1 s": (
            r"ERROR .* -> timeout: TimeoutError: timed out after 1 s; interrupted, kernel state"
        ),
        r"run_code: len\(orders\) after timeout": r"ok .* -> 10000$",  # state survived
    }
    for label, outcome in steps.items():
        assert re.search(rf"^  {label}\s+{outcome}", out, re.MULTILINE), (label, out)
    assert re.search(r"^20 warm calls of top_regions .*: median \d+\.\d\d ms", out, re.MULTILINE)


def test_repl_keeps_state_across_inputs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kernelexec", "repl"],
        input="x = 20\ndef f(y):\n    return x + y\n\nf(22)\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "42" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("reaching", ["the terminal", "another thread"])
@pytest.mark.usefixtures("ctrl_c_default")
def test_repl_ctrl_c_interrupts_the_code_and_exit_leaves(reaching: str) -> None:
    """As in Python's REPL: Ctrl-C while code runs interrupts it (the kernel and its state
    live on), and ``exit`` leaves the REPL instead of killing the kernel. Whichever of the
    REPL's threads the SIGINT reached: a main thread blocked in ``Future.result()`` was not
    woken when another thread took it (as Linux may, under load), and the code ran on."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "kernelexec", "repl"],
        encoding="utf-8",
        timeout=90,
        env={**os.environ, "TERM": "dumb"},
        dimensions=(24, 200),
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("x = 41")
        child.expect_exact(">>> ")
        # The marker is built in the kernel, so the echo of the line cannot match it.
        child.sendline("import time; print('wait' + 'ing', flush=True); time.sleep(600)")
        child.expect_exact("waiting")
        if reaching == "the terminal":
            child.sendintr()
        else:
            signal_another_thread(child.pid, signal.SIGINT)
        child.expect_exact("KeyboardInterrupt")
        child.expect_exact(">>> ")
        child.sendline("x + 1")
        child.expect_exact("42")
        child.expect_exact(">>> ")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in (child.before or "")


def test_record_then_replay(tool_file: Path, tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    proc = kernelexec(
        "run", str(tool_file), "--args", '{"name": "Ada"}', "--record", str(rec), "--agent", "a1"
    )
    assert proc.returncode == 0, proc.stderr
    notebook = rec / "a1.ipynb"
    assert f"recorded to {notebook}" in proc.stderr
    assert proc.stdout == 'greeting Ada\n"hello Ada"\n'

    proc = kernelexec("replay", str(notebook))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "2 cells replayed: no differences\n"

    text = notebook.read_text().replace('\\"hello \\" + name', '\\"bye \\" + name')
    assert text != notebook.read_text()
    notebook.write_text(text)
    proc = kernelexec("replay", str(notebook))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0] == "cell 1 (greet(name='Ada')): outputs differ"
    assert "  -[text/plain] 'hello Ada'" in lines and "  +[text/plain] 'bye Ada'" in lines
    assert lines[-1] == "2 cells replayed: 1 cell(s) differ"

    proc = kernelexec("replay", str(notebook), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert [d["index"] for d in report["differences"]] == [1]


@pytest.mark.parametrize("content", [None, "{broken", '{"cells": 3}'])
def test_replay_of_a_bad_notebook_exits_2(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "nb.ipynb"
    if content is not None:
        path.write_text(content)
    proc = kernelexec("replay", str(path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert str(path) in proc.stderr


def test_exec_record_dir_that_is_a_file_exits_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = kernelexec("exec", "1", "--record", str(blocker))
    assert proc.returncode == 2
    assert "record_dir" in proc.stderr


def test_every_argument_and_command_has_help_text() -> None:
    """Issue 36: several arguments showed no help in ``--help`` and the CLI reference."""
    import argparse

    from kernelexec._cli._main import _parser

    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, where: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                for name, sub in action.choices.items():
                    if name not in helped:
                        missing.append(f"{where} {name}")
                    walk(sub, f"{where} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")

    walk(_parser(), "kernelexec")
    assert missing == []
