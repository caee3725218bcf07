"""Recording sessions as notebooks, re-running them (nbclient, replay), and crash safety."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

import kernelexec as kx
from kernelexec._notebooks._io import call_source, safe_filename
from kernelexec._replay import output_lines
from tests.conftest import kernels_matching, wait_exited

TOOL_V1 = textwrap.dedent(
    '''
    def describe(name: str, values: list[int]) -> dict:
        """Summarise some values.

        Args:
            name: A label.
            values: Numbers to sum.
        """
        print("describing", name)
        return {"name": name, "total": sum(values)}
    '''
)
TOOL_V2 = TOOL_V1.replace('"total": sum(values)', '"total": sum(values) * 10')
BIG = 2**80


def timeout_of(cell: Any) -> float | None:
    """What a stock nbclient needs to replay recorded timeouts (a public nbclient trait)."""
    value = cell.metadata.get("kernelexec", {}).get("timeout_s")
    return float(value) if value is not None else None


def record_session(record_dir: Path) -> Path:
    tool = kx.Tool.from_source(TOOL_V1)
    with kx.KernelExecutor(record_dir=record_dir, default_timeout=30) as ex:
        session = ex.session("agent/7")
        first = session.call_tool(tool, {"name": "héllo ✓", "values": [1, 2, BIG]})
        assert first.ok and first.func_return == {"name": "héllo ✓", "total": 3 + BIG}
        assert first.outputs == [
            {"output_type": "stream", "name": "stdout", "text": "describing héllo ✓\n"}
        ]
        assert first.result is None  # displayed for the notebook only
        rejected = session.call_tool(tool, {"name": 1, "values": []})
        assert rejected.error is not None and rejected.error.kind == "invalid_args"
        assert session.run_code("rows = [i * i for i in range(10)]\nsum(rows)").result == "285"
        assert session.run_code("rows[100]").error.kind == "exception"  # type: ignore[union-attr]
        slow = session.run_code(
            "import time\nprint('start', flush=True)\ntime.sleep(30)", timeout=1.5
        )
        assert slow.error is not None and slow.error.kind == "timeout"
        again = session.call_tool(tool, {"name": "again", "values": [4]})
        assert again.func_return == {"name": "again", "total": 4}
        assert session.run_code("len(rows)").result == "10"  # state survived the timeout
        path = session.record_path
        assert path is not None
        in_memory = copy.deepcopy(session.notebook)
    assert nbformat.reads(path.read_text(), as_version=4) == in_memory
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_session(tmp_path_factory.mktemp("rec"))


@pytest.fixture
def notebook_copy(recorded: Path, tmp_path: Path) -> Path:
    path = tmp_path / recorded.name
    path.write_text(recorded.read_text())
    return path


def test_session_is_recorded_as_a_valid_notebook(recorded: Path) -> None:
    assert recorded.name == f"{safe_filename('agent/7')}.ipynb"
    assert recorded.name.startswith("agent_7-")
    nb = nbformat.read(recorded, as_version=4)
    nbformat.validate(nb)
    kinds = [c.metadata["kernelexec"]["kind"] for c in nb.cells]
    assert kinds == [
        "tool_definition",
        "tool_call",
        "tool_call",
        "code",
        "code",
        "code",
        "tool_call",
        "code",
    ]
    sources = [c.source for c in nb.cells]
    assert sources[0] == TOOL_V1
    assert sources[1] == f"describe(name='héllo ✓', values=[1, 2, {BIG}])"
    assert sources[2].startswith("# not run (invalid_args: argument 'name': 1 is not of type")
    assert nb.cells[2].metadata["kernelexec"]["status"] == "not_run"
    assert sources[6] == "describe(name='again', values=[4])"  # definition not repeated
    call = nb.cells[1]
    meta = call.metadata["kernelexec"]
    assert meta["args"] == {"name": "héllo ✓", "values": [1, 2, BIG]}
    assert meta["func_return"] == {"name": "héllo ✓", "total": 3 + BIG}
    assert meta["status"] == "success" and meta["error_kind"] is None
    assert meta["agent_id"] == "agent/7" and meta["tool"] == "describe"
    assert meta["duration_s"] > 0 and meta["started"] <= meta["finished"]
    assert [o["output_type"] for o in call.outputs] == ["stream", "execute_result"]
    assert call.outputs[1]["data"]["text/plain"] == f"{{'name': 'héllo ✓', 'total': {3 + BIG}}}"
    counts = [c.execution_count for c in nb.cells]
    assert counts[0] is None and counts[2] is None
    ran = [n for n in counts if n is not None]
    assert ran == sorted(ran) and len(set(ran)) == len(ran)
    error_cell, timeout_cell = nb.cells[4], nb.cells[5]
    assert error_cell.metadata["tags"] == ["raises-exception"]
    assert error_cell.metadata["kernelexec"]["error_kind"] == "exception"
    assert error_cell.outputs[0]["ename"] == "IndexError"
    assert timeout_cell.metadata["kernelexec"]["error_kind"] == "timeout"
    assert timeout_cell.metadata["kernelexec"]["timeout_s"] == 1.5
    assert [o["output_type"] for o in timeout_cell.outputs] == ["stream", "error"]
    assert timeout_cell.outputs[1]["ename"] == "KeyboardInterrupt"
    assert "tags" not in nb.cells[3].metadata
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.metadata["language_info"]["name"] == "python"
    assert nb.metadata["language_info"]["version"] == sys.version.split()[0]
    assert nb.metadata["kernelexec"]["agent_id"] == "agent/7"
    assert len(nb.metadata["kernelexec"]["env_fingerprint"]) == 16


def test_nbclient_reexecutes_the_recording_with_matching_outputs(notebook_copy: Path) -> None:
    recorded = nbformat.read(notebook_copy, as_version=4)
    nb = copy.deepcopy(recorded)
    client = NotebookClient(nb, timeout=60, interrupt_on_timeout=True, timeout_func=timeout_of)
    client.execute()
    assert len(nb.cells) == len(recorded.cells)
    for before, after in zip(recorded.cells, nb.cells, strict=True):
        assert output_lines(after.outputs) == output_lines(before.outputs), before.source


def test_replay_reports_no_difference(notebook_copy: Path) -> None:
    report = kx.replay(notebook_copy)
    assert report.ok, report.differences
    assert report.cells_run == 7  # the rejected call is not run


def test_replay_names_the_cell_a_changed_tool_changes(notebook_copy: Path) -> None:
    nb = nbformat.read(notebook_copy, as_version=4)
    nb.cells[0].source = TOOL_V2
    nbformat.write(nb, notebook_copy)
    report = kx.replay(notebook_copy)
    assert [d.index for d in report.differences] == [1, 6]
    first = report.differences[0]
    assert first.first_line == "describe(name='héllo ✓', values=[1, 2, 1208925819614629174706176])"
    assert f"-[text/plain] {{'name': 'héllo ✓', 'total': {3 + BIG}}}" in first.diff
    assert f"+[text/plain] {{'name': 'héllo ✓', 'total': {(3 + BIG) * 10}}}" in first.diff
    assert first.recorded_status == first.replayed_status == "success"


def test_changed_tool_source_is_recorded_again(tmp_path: Path) -> None:
    v1, v2 = kx.Tool.from_source(TOOL_V1), kx.Tool.from_source(TOOL_V2)
    with kx.KernelExecutor(record=True) as ex:
        session = ex.session("a")
        for tool in (v1, v1, v2, v1):
            assert session.call_tool(tool, {"name": "n", "values": [1]}).ok
        assert session.record_path is None
        nb = session.notebook
        assert nb is not None
    sources = [c.source for c in nb.cells]
    assert sources == [
        TOOL_V1,
        "describe(name='n', values=[1])",
        "describe(name='n', values=[1])",
        TOOL_V2,
        "describe(name='n', values=[1])",
        TOOL_V1,
        "describe(name='n', values=[1])",
    ]
    assert [o["data"]["text/plain"] for o in nb.cells[4].outputs[1:]] == [
        "{'name': 'n', 'total': 10}"
    ]


def test_not_recording_by_default(add_tool: kx.Tool) -> None:
    with kx.KernelExecutor() as ex:
        session = ex.session("a")
        assert session.call_tool(add_tool, {"a": 1}).func_return == 3
        assert session.notebook is None and session.record_path is None


def test_huge_output_is_stored_truncated(tmp_path: Path) -> None:
    with kx.KernelExecutor(record_dir=tmp_path, max_output_chars=1000) as ex:
        result = ex.run_code("print('x' * 100_000)", agent_id="big")
    nb = nbformat.read(tmp_path / "big.ipynb", as_version=4)
    text = nb.cells[0].outputs[0]["text"]
    assert text == result.stdout
    assert 1000 <= len(text) < 1300 and "truncated" in text


def test_existing_recording_is_continued_not_overwritten(tmp_path: Path) -> None:
    for value in (1, 2):
        with kx.KernelExecutor(record_dir=tmp_path) as ex:
            ex.run_code(f"v = {value}", agent_id="same")
            ex.run_code("v", agent_id="same")
    nb = nbformat.read(tmp_path / "same.ipynb", as_version=4)
    assert [c.source for c in nb.cells] == ["v = 1", "v", "v = 2", "v"]
    assert [c.metadata["kernelexec"]["fresh_kernel"] for c in nb.cells] == [
        True,
        False,
        True,
        False,
    ]
    (tmp_path / "other.ipynb").write_text(nbformat.writes(nbformat.v4.new_notebook()))
    with (
        kx.KernelExecutor(record_dir=tmp_path) as ex,
        pytest.raises(kx.ConfigError, match="not written by kernelexec"),
    ):
        ex.session("other")
    (tmp_path / "broken.ipynb").write_text("{not json")
    with (
        kx.KernelExecutor(record_dir=tmp_path) as ex,
        pytest.raises(kx.ConfigError, match="not a valid notebook"),
    ):
        ex.session("broken")
    assert (tmp_path / "broken.ipynb").read_text() == "{not json"


def test_a_failed_save_keeps_the_result_and_the_next_save_writes_everything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record_dir = tmp_path / "rec"
    with kx.KernelExecutor(record_dir=record_dir) as ex:
        assert ex.run_code("x = 1", agent_id="s").ok
        shutil.rmtree(record_dir)
        record_dir.write_text("in the way")  # the directory is gone: saving must fail
        with caplog.at_level("WARNING", logger="kernelexec"):
            lost = ex.run_code("x + 1", agent_id="s")
        assert lost.result == "2"  # the run's result is not lost over the file
        assert "could not save the recording" in caplog.text
        record_dir.unlink()
        record_dir.mkdir()
        assert ex.run_code("x + 2", agent_id="s").result == "3"
    nb = nbformat.read(record_dir / "s.ipynb", as_version=4)
    assert [c.source for c in nb.cells] == ["x = 1", "x + 1", "x + 2"]


def test_one_recorder_per_file(tmp_path: Path) -> None:
    first = kx.KernelExecutor(record_dir=tmp_path)
    try:
        first.run_code("a = 1", agent_id="shared")
        with kx.KernelExecutor(record_dir=tmp_path) as second:
            with pytest.raises(kx.ConfigError, match="being recorded by another session"):
                second.session("shared")
            second.run_code("b = 2", agent_id="other")  # other agents are fine
        first.run_code("a", agent_id="shared")
    finally:
        first.close()
    with kx.KernelExecutor(record_dir=tmp_path) as third:  # free again: continues the file
        third.run_code("c = 3", agent_id="shared")
    nb = nbformat.read(tmp_path / "shared.ipynb", as_version=4)
    assert [c.source for c in nb.cells] == ["a = 1", "a", "c = 3"]


def test_replay_restarts_where_the_session_lost_its_kernel(tmp_path: Path) -> None:
    with kx.KernelExecutor(record_dir=tmp_path) as ex:
        session = ex.session("r")
        session.run_code("x = 1")
        died = session.run_code("import os; os._exit(3)")
        assert died.error is not None and died.error.kind == "kernel_died"
        lost = session.run_code("x")
        assert lost.error is not None and lost.error.ename == "NameError"
    nb = nbformat.read(tmp_path / "r.ipynb", as_version=4)
    assert nb.cells[2].metadata["kernelexec"]["fresh_kernel"] is True
    report = kx.replay(tmp_path / "r.ipynb")
    assert report.ok, report.differences
    assert report.cells_run == 3


@pytest.mark.parametrize(
    ("agent_id", "expected"),
    [("agent-1", "agent-1"), ("a.b_c", "a.b_c")],
)
def test_safe_ids_are_kept(agent_id: str, expected: str) -> None:
    assert safe_filename(agent_id) == expected


def test_unsafe_ids_map_to_distinct_safe_names() -> None:
    ids = ["a/b", "a_b", "a:b", "../etc/passwd", ".hidden", "", "ü", "x" * 300, "con\x00"]
    names = [safe_filename(i) for i in ids]
    assert len(set(names)) == len(names)
    for name in names:
        assert name and "/" not in name and "\x00" not in name and not name.startswith(".")
        assert len(name) <= 90
        assert all(c.isalnum() or c in "._-" for c in name)


def test_call_source_writes_json_values_as_python_literals() -> None:
    args = {"s": 'it\'s "q" ✓\n', "n": BIG, "f": 1.5, "t": True, "z": None, "l": [{"k": []}]}
    source = call_source("f", args)
    assert source == (f"f(s='it\\'s \"q\" ✓\\n', n={BIG}, f=1.5, t=True, z=None, l=[{{'k': []}}])")
    namespace: dict[str, Any] = {"f": lambda **kw: kw}
    assert eval(source, namespace) == args
    assert call_source("f", {"class": 1, "a-b": 2}) == "f(**{'class': 1, 'a-b': 2})"
    weird = call_source("f", {"x": float("nan"), "y": float("-inf")})
    assert weird == "f(x=float('nan'), y=float('-inf'))"


HOST_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import kernelexec as kx
    with kx.KernelExecutor(record_dir=sys.argv[1]) as ex:
        for i in range(3):
            ex.run_code(f"value_{i} = {i}; print({i})", agent_id="crash")
        print("recorded", flush=True)
        ex.run_code(
            "import os, time; print('under way', os.getpid(), flush=True); time.sleep(60)",
            agent_id="crash",
            on_stdout=lambda text: print(text, end="", flush=True),
        )
    """
)


def test_host_killed_mid_session_leaves_the_completed_runs(tmp_path: Path) -> None:
    record_dir, tmp = tmp_path / "rec", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_SCRIPT, str(record_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert host.stdout is not None
        assert host.stdout.readline() == "recorded\n"
        under_way, pid = host.stdout.readline().rsplit(" ", 1)
        assert under_way == "under way"  # the fourth run is in the kernel
        kernel_pid = int(pid)
        host.send_signal(signal.SIGKILL)
        host.wait(10)
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
    nb = nbformat.read(record_dir / "crash.ipynb", as_version=4)
    nbformat.validate(nb)
    assert [c.source for c in nb.cells] == [f"value_{i} = {i}; print({i})" for i in range(3)]
    assert [c.outputs[0]["text"] for c in nb.cells] == ["0\n", "1\n", "2\n"]
    # No temp file of an interrupted save; the lock file of the dead recorder is free again.
    assert sorted(p.name for p in record_dir.iterdir()) == [".crash.ipynb.lock", "crash.ipynb"]
    # The orphaned kernel notices its parent is gone and exits (ipykernel's parent poller).
    assert wait_exited(kernel_pid)
    # Its launcher exits right after it (reaping first): wait for each, do not poll.
    assert not [p for p in kernels_matching(str(tmp)) if not wait_exited(p.pid)]
    # The killed host's temporary directories are swept by the next kernelexec process.
    left = sorted(p.name.split("-")[0] for p in tmp.iterdir())
    assert left == ["kernelexec", "kx"]
    after = subprocess.run(
        [sys.executable, "-m", "kernelexec", "exec", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert after.returncode == 0, after.stderr
    assert list(tmp.iterdir()) == []


def test_tools_round_trip_from_notebook_to_json_and_back(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# My tools"),
        nbformat.v4.new_code_cell(
            "%%tool\n# requirements: httpx>=0.27, rich[jupyter,extra]\n"
            'def shout(text: str) -> str:\n    """Shout.\n\n    Args:\n'
            '        text: What.\n    """\n'
            "    return text.upper() + '!'\n",
            metadata={"tags": ["tool"]},
        ),
        nbformat.v4.new_code_cell("shout('try it')"),  # untagged: not a tool
        nbformat.v4.new_code_cell(
            "def _helper(x):\n    return x * 2\n\n"
            'def double(n: int) -> int:\n    """Double.\n\n    Args:\n'
            '        n: A number.\n    """\n'
            "    return _helper(n)\n",
            metadata={"tags": ["tool"], "kernelexec": {"pip_requirements": ["numpy"]}},
        ),
    ]
    path = tmp_path / "tools.ipynb"
    nbformat.write(nb, path)
    tools = kx.Tool.from_notebook(path)
    assert [t.name for t in tools] == ["shout", "double"]
    assert tools[0].pip_requirements == ["httpx>=0.27", "rich[jupyter,extra]"]
    assert tools[1].pip_requirements == ["numpy"]
    assert not tools[0].source_code.startswith("%%tool")
    assert tools[0].json_schema["parameters"]["properties"]["text"]["type"] == "string"

    exported = subprocess.run(
        [sys.executable, "-m", "kernelexec", "tools", "export", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert exported.returncode == 0, exported.stderr
    data = json.loads(exported.stdout)
    assert [d["name"] for d in data] == ["shout", "double"]
    assert set(data[0]) == {"name", "source_code", "json_schema", "pip_requirements"}
    loaded = [kx.Tool.model_validate(d) for d in data]
    assert loaded == tools
    # Their requirements would route them to venvs (tested in test_envs.py); these two need
    # nothing beyond the standard library, so pin the host environment.
    with kx.KernelExecutor() as ex:
        host = kx.LocalEnv()
        assert ex.call_tool(loaded[0], {"text": "hi"}, env=host).func_return == "HI!"
        assert ex.call_tool(loaded[1], {"n": 21}, env=host).func_return == 42


def test_bad_tool_cells_name_the_cell(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("x"),
        nbformat.v4.new_code_cell("def a(): pass\ndef b(): pass", metadata={"tags": ["tool"]}),
    ]
    path = tmp_path / "bad.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(kx.NotebookError, match=r"cell 1: expected exactly one public"):
        kx.Tool.from_notebook(path)
    with pytest.raises(kx.NotebookError, match="no such file"):
        kx.Tool.from_notebook(tmp_path / "missing.ipynb")
    (tmp_path / "text.ipynb").write_text("hello")
    with pytest.raises(kx.NotebookError, match="not a readable notebook"):
        kx.Tool.from_notebook(tmp_path / "text.ipynb")


# 7 (hostile probe). a failed save is on the result, and the next save retries ----------------


def test_a_failed_save_is_on_the_result_and_the_next_save_retries(tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"
    with kx.KernelExecutor(record_dir=record_dir) as ex:
        first = ex.run_code("a = 1", agent_id="s")
        assert first.recording_error is None
        shutil.rmtree(record_dir)  # the disk "fails": nowhere to write
        failed = ex.run_code("b = 2", agent_id="s")
        assert failed.ok
        assert failed.recording_error is not None
        assert str(record_dir / "s.ipynb") in failed.recording_error
        record_dir.mkdir()
        again = ex.run_code("c = 3", agent_id="s")
        assert again.recording_error is None
    cells = nbformat.read(record_dir / "s.ipynb", as_version=4).cells
    assert [c.source for c in cells] == ["a = 1", "b = 2", "c = 3"]


def test_no_recording_means_no_recording_error(executor: kx.KernelExecutor) -> None:
    assert executor.run_code("1", agent_id="unrecorded").recording_error is None


def test_a_program_that_never_records_imports_no_nbformat(tmp_path: Path) -> None:
    """Importing nbformat (and with it jsonschema, which compiles rfc3987-syntax's grammars
    where JupyterLab is installed) doubled the time to a first result (issue 36); only
    recording, replay and notebook reading need it."""
    probe = textwrap.dedent(
        f"""
        import sys
        import kernelexec as kx
        with kx.KernelExecutor() as ex:
            agent = ex.session("a")
            agent.run_code("from IPython.display import display; display(1); 1/0")
            print(agent.run_code("6 * 7").result)
            print(sorted(m for m in ("nbformat", "jsonschema") if m in sys.modules))
            with kx.KernelExecutor(record_dir={str(tmp_path)!r}) as rec:
                rec.session("b").run_code("1")
            print("nbformat" in sys.modules)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.split("\n")[:3] == ["42", "[]", "True"], proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("kind", "content"),
    [
        ("execute_result", {"data": {"text/plain": "1"}, "metadata": {}, "execution_count": 3}),
        ("execute_result", {"data": {"text/plain": ["a", "b"]}, "metadata": {}}),
        ("execute_result", {"data": {}, "metadata": {}, "execution_count": -1}),
        ("execute_result", {"data": {}, "metadata": {}, "execution_count": None}),
        ("execute_result", {"data": {}, "metadata": {}, "execution_count": True}),
        ("display_data", {"data": {"application/vnd.x+json": {"k": [1]}}, "metadata": {"m": 1}}),
        ("display_data", {"data": {"application/json": 5, "image/png": "iVBO"}, "metadata": {}}),
        ("display_data", {"data": {"text/plain": 5}, "metadata": {}}),
        ("display_data", {"data": {"text/plain": ["a", 1]}, "metadata": {}}),
        ("display_data", {"data": "x", "metadata": {}}),
        ("display_data", {"data": {}, "metadata": []}),
        ("display_data", {"data": {}}),
        ("error", {"ename": "E", "evalue": "v", "traceback": ["1", "2"]}),
        ("error", {"ename": "E", "evalue": 5, "traceback": []}),
        ("error", {"ename": "E", "evalue": "v", "traceback": [1]}),
        ("error", {"ename": "E", "evalue": "v"}),
    ],
)
def test_outputs_are_built_as_nbformat_builds_them(kind: str, content: dict[str, Any]) -> None:
    """The run loop builds outputs without nbformat: the same outputs, the same refusals."""
    from nbformat.v4 import output_from_msg

    from kernelexec._core._outputs import notebook_output

    try:
        expected = output_from_msg({"header": {"msg_type": kind}, "content": content})
    except Exception:
        expected = None
    assert notebook_output(kind, content) == expected
