"""``kernelexec mcp`` driven by the MCP SDK's own client, over stdio and streamable HTTP.

The server runs as a real subprocess with real kernels; its kernels are its children, so the
leak checks here look at the server's children (and at the temp dir it was given).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import nbformat
import psutil
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from kernelexec._cli._main import main
from tests.support.procs import children, descendants, of_kind, running

pytestmark = pytest.mark.anyio

TOOLS = textwrap.dedent(
    '''
    def add(a: int, b: int = 2) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        print("adding", a, b)
        return a + b


    def _helper() -> None:
        pass
    '''
)

# A 2x1 PNG built with the standard library only, shown with IPython.display.
IMAGE_CODE = textwrap.dedent(
    """
    import struct, zlib
    from IPython.display import Image, display

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"\\x00\\xff\\x00\\x00\\x00\\x00\\xff"
    png = (b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    display(Image(data=png))
    len(png)
    """
)


def expected_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 2, 0, 0, 0))
    idat = chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00\x00\x00\xff"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + idat + chunk(b"IEND", b"")


# -- processes ---------------------------------------------------------------------------------


def kernels_of(pid: int) -> set[int]:
    """Pids of kernel processes (or their launchers) whose parent is ``pid``, or a fork server
    of ``pid`` (forked kernels carry the server's command line)."""
    found = set()
    for server in of_kind(pid, "fork server"):
        try:
            forked = psutil.Process(server).children()
        except psutil.NoSuchProcess:
            continue
        found |= {k.pid for k in forked if running(k.pid)}
    for child in of_kind(pid, "launcher") | of_kind(pid, "kernel"):
        if running(child):
            found.add(child)
    return found


def wait_exited(pids: set[int], timeout: float = 15.0) -> set[int]:
    """Wait (on pidfds, not by polling) until the processes exit; return those still alive."""
    alive = set()
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(timeout * 1000):
                alive.add(pid)
        finally:
            os.close(fd)
    return alive


def server_children() -> set[int]:
    """Pids of ``kernelexec mcp`` processes started by this test process."""
    return children(os.getpid(), b"kernelexec\0", b"mcp\0")


def leftover_dirs(tmp: Path) -> set[str]:
    return {p.name for p in tmp.iterdir() if p.name.startswith(("kx-", "kernelexec-"))}


@pytest.fixture
def server_tmp() -> Iterator[Path]:
    """The server's TMPDIR; nothing kernelexec made may be left in it. Short, because kernel
    sockets live under it and their paths must fit in 108 bytes."""
    tmp = Path(tempfile.mkdtemp(prefix="mcp-"))
    try:
        yield tmp
        assert not leftover_dirs(tmp), f"the server left temp dirs: {leftover_dirs(tmp)}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture
def tools_notebook(tmp_path: Path) -> Path:
    cell = nbformat.v4.new_code_cell(
        'def shout(text: str) -> str:\n    """Shout it.\n\n    Args:\n        text: What.\n'
        '    """\n    return text.upper()\n',
        metadata={"tags": ["tool"]},
    )
    other = nbformat.v4.new_code_cell("print('not a tool')")
    path = tmp_path / "tools.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell, other]), path)
    return path


def server_env(tmp: Path) -> dict[str, str]:
    switches = {
        k: os.environ[k]
        for k in ("KERNELEXEC_NO_FORK_SERVER", "KERNELEXEC_FAST_CALLS")
        if k in os.environ
    }
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp)),
        "TMPDIR": str(tmp),
        "KERNELEXEC_CACHE_DIR": os.environ["KERNELEXEC_CACHE_DIR"],
        **switches,  # a suite run with the fork server off runs its servers without it too
    }


# -- clients -----------------------------------------------------------------------------------


@dataclass
class Server:
    """A running ``kernelexec mcp --transport http``."""

    proc: subprocess.Popen[str]
    url: str
    token: str
    log: list[str]


@pytest.fixture
def http_server(
    server_tmp: Path, tools_file: Path, tools_notebook: Path, tmp_path: Path
) -> Iterator[Server]:
    args = ("--tools", str(tools_file), str(tools_notebook), "--record", str(tmp_path / "runs"))
    with running_http_server(server_tmp, *args) as server:
        yield server


@contextlib.contextmanager
def running_http_server(
    server_tmp: Path, *args: str, announce_timeout: float = 60
) -> Iterator[Server]:
    """``kernelexec mcp --transport http --port 0 ARGS``, stopped at the end whatever happened
    (checked when the test passed); ``announce_timeout``: seconds to wait for its URL."""
    token = "test-token-" + "x" * 20
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelexec", "mcp", "--transport", "http", "--port", "0", *args],
        env={**server_env(server_tmp), "KERNELEXEC_MCP_TOKEN": token},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            lines.put(line)
        lines.put(None)  # the server closed its stderr: it has exited

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        url = _announced_url(lines, log, announce_timeout)
        yield Server(proc, url, token, log)
        kernels = kernels_of(proc.pid)
    finally:
        stopped = _stop(proc)
        reader.join(timeout=10)
        assert proc.stdout is not None and proc.stderr is not None
        written = proc.stdout.read()
        proc.stdout.close()
        proc.stderr.close()
    assert stopped, "the HTTP server did not exit within 30 s of SIGTERM (killed)"
    assert written == "", "the HTTP server wrote to stdout"
    assert any("executor closed" in line for line in log), "".join(log)
    assert not wait_exited(kernels), "kernels outlived the HTTP server"


def _announced_url(lines: queue.Queue[str | None], log: list[str], timeout: float = 60) -> str:
    """The URL the server says it listens at, once it has said so."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            message = f"no URL from the HTTP server in {timeout:g} s:\n{''.join(log)}"
            raise AssertionError(message) from None
        if line is None:
            raise AssertionError(f"the HTTP server exited before it listened:\n{''.join(log)}")
        found = re.search(r"at (http://\S+/mcp)", line)
        if found:
            return found.group(1)


def _stop(proc: subprocess.Popen[str]) -> bool:
    """SIGTERM the server and wait; SIGKILL it if it does not exit in 30 s (its kernels and
    namespace helper die with it). True when it exited on SIGTERM."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return False


@asynccontextmanager
async def http_client(server: Server, token: str | None = None) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token or server.token}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(server.url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


@asynccontextmanager
async def stdio_session(
    tmp: Path, *args: str, errlog: Path
) -> AsyncIterator[tuple[ClientSession, int]]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "kernelexec", "mcp", *args], env=server_env(tmp)
    )
    before = server_children()  # another test's server may still be ending
    with errlog.open("w") as err:
        async with (
            stdio_client(params, errlog=err) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            (pid,) = server_children() - before
            yield session, pid


@asynccontextmanager
async def client_for(
    transport: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[ClientSession]:
    if transport == "http":
        async with http_client(request.getfixturevalue("http_server")) as session:
            yield session
        return
    tools = request.getfixturevalue("tools_file")
    notebook = request.getfixturevalue("tools_notebook")
    tmp = request.getfixturevalue("server_tmp")
    args = (
        "--tools",
        str(tools),
        "--tools",
        str(notebook),
        "--record",
        str(tmp_path / "runs"),
        "--timeout",
        "30",
    )
    async with stdio_session(tmp, *args, errlog=tmp_path / "server.log") as (session, pid):
        yield session
    assert not wait_exited({pid}), "the stdio server did not exit when its client left"


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        return [leaf for each in inner for leaf in leaves(each)]
    return [exc]


def text_of(result: Any) -> str:
    return "\n".join(block.text for block in result.content if block.type == "text")


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_tools_state_tool_errors_and_images(
    transport: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    async with client_for(transport, request, tmp_path) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert set(listed) == {
            "run_python",
            "list_sessions",
            "reset_session",
            "variables",
            "fork",
            "snapshot",
            "restore",
            "add",
            "shout",
        }
        run_schema = listed["run_python"].input_schema
        assert run_schema["required"] == ["code"]
        assert set(run_schema["properties"]) == {"code", "session", "timeout", "atomic"}
        assert listed["run_python"].output_schema is not None
        add = listed["add"]
        assert add.description == "Add two numbers."
        assert add.input_schema["properties"]["a"]["type"] == "integer"
        assert add.input_schema["required"] == ["a"]

        first = await client.call_tool("run_python", {"code": "x = 41"})
        assert not first.is_error
        second = await client.call_tool("run_python", {"code": "x + 1"})
        assert not second.is_error
        assert second.structured_content["result"] == "42"
        assert "42" in text_of(second)

        ok = await client.call_tool("add", {"a": 40})
        assert not ok.is_error
        assert ok.structured_content["return"] == 42
        assert ok.structured_content["stdout"] == "adding 40 2\n"
        bad = await client.call_tool("add", {"a": "forty"})
        assert bad.is_error
        assert "argument 'a': 'forty' is not of type 'integer'" in text_of(bad)
        unknown = await client.call_tool("add", {"a": 1, "c": 3})
        assert unknown.is_error
        assert "unexpected argument 'c'" in text_of(unknown)
        with pytest.raises(MCPError, match="unknown tool 'nope'"):
            await client.call_tool("nope", {})
        shout = await client.call_tool("shout", {"text": "hi"})
        assert shout.structured_content["return"] == "HI"
        no_code = await client.call_tool("run_python", {"session": "s"})
        assert no_code.is_error and "'code' is a required property" in text_of(no_code)

        failing = await client.call_tool("run_python", {"code": "1/0"})
        assert failing.is_error
        error = failing.structured_content["error"]
        assert (error["kind"], error["name"]) == ("exception", "ZeroDivisionError")
        assert "\x1b[" not in error["traceback"] and "1/0" in error["traceback"]

        image = await client.call_tool("run_python", {"code": IMAGE_CODE})
        assert not image.is_error, text_of(image)
        (png,) = [block for block in image.content if block.type == "image"]
        assert png.mime_type == "image/png"
        assert base64.b64decode(png.data) == expected_png()
        assert image.structured_content["images"] == ["image/png"]
        assert image.structured_content["result"] == str(len(expected_png()))

        slow = await client.call_tool(
            "run_python", {"code": "import time; time.sleep(30)", "timeout": 0.5}
        )
        assert slow.is_error and slow.structured_content["error"]["kind"] == "timeout"
        await client.call_tool("reset_session", {})
        gone = await client.call_tool("run_python", {"code": "x"})
        assert gone.structured_content["error"]["name"] == "NameError"

    (notebook,) = (tmp_path / "runs").glob("client-*.ipynb")
    sources = ["".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]]
    assert "x = 41" in sources and "x + 1" in sources


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_cancel_interrupts_the_kernel_and_keeps_state(
    transport: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    async with client_for(transport, request, tmp_path) as client:
        await client.call_tool("run_python", {"code": "x = 41"})
        started = anyio.Event()

        async def progress(value: float, total: float | None, message: str | None) -> None:
            if message and "started" in message:
                started.set()

        code = "import time\nprint('started', flush=True)\ntime.sleep(600)"
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: client.call_tool(
                        "run_python", {"code": code}, progress_callback=progress
                    )
                )
                await started.wait()
                scope.cancel()
        after = await client.call_tool("run_python", {"code": "x + 1"})
        assert after.structured_content["result"] == "42"
        sessions = await client.call_tool("list_sessions", {})
        (row,) = sessions.structured_content["sessions"]
        assert row["session"] == "default"
        assert (row["runs"], row["cancelled_runs"], row["last_outcome"]) == (3, 1, "success")
        assert row["last_cancelled"].startswith("cancelled by the client; the kernel was interr")
        assert "KeyboardInterrupt" in row["last_cancelled"]
        assert "last cancelled: cancelled by the client" in text_of(sessions)

    # The recording says so too: the cancelled run is a cell that ended in KeyboardInterrupt.
    (notebook,) = (tmp_path / "runs").glob("client-*.ipynb")
    cells = json.loads(notebook.read_text())["cells"]
    (cancelled,) = [c for c in cells if "time.sleep(600)" in "".join(c["source"])]
    assert cancelled["metadata"]["kernelexec"]["status"] == "error"
    assert [o.get("ename") for o in cancelled["outputs"] if o["output_type"] == "error"] == [
        "KeyboardInterrupt"
    ]


@pytest.mark.slow
async def test_http_refuses_requests_without_the_token(http_server: Server) -> None:
    async with httpx2.AsyncClient() as http:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        missing = await http.post(http_server.url, json=body)
        wrong = await http.post(
            http_server.url, json=body, headers={"Authorization": "Bearer not-the-token"}
        )
        rebound = await http.post(
            http_server.url,
            json=body,
            headers={"Authorization": f"Bearer {http_server.token}", "Host": "evil.example"},
        )
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert rebound.status_code == 421, rebound.text  # DNS-rebinding protection
    with pytest.raises(Exception) as refused:
        async with http_client(http_server, token="wrong"):
            pass
    assert any(isinstance(e, MCPError) for e in leaves(refused.value)), refused.value
    assert any("refused a request" in line for line in http_server.log)
    assert kernels_of(http_server.proc.pid) == set(), "a refused request started a kernel"
    async with http_client(http_server) as client:
        await client.call_tool("run_python", {"code": "1"})
        assert len(kernels_of(http_server.proc.pid)) == 1


@pytest.mark.slow
async def test_http_clients_are_isolated_unless_they_share_a_session_name(
    http_server: Server,
) -> None:
    pid = http_server.proc.pid
    async with http_client(http_server) as a:
        await a.call_tool("run_python", {"code": "x = 'a'"})
        await a.call_tool("run_python", {"code": "y = 5", "session": "shared"})
        before = kernels_of(pid)
        assert len(before) == 2
        async with http_client(http_server) as b:
            missing = await b.call_tool("run_python", {"code": "x"})
            assert missing.is_error and missing.structured_content["error"]["name"] == "NameError"
            shared = await b.call_tool("run_python", {"code": "y", "session": "shared"})
            assert shared.structured_content["result"] == "5"
            rows = (await b.call_tool("list_sessions", {})).structured_content["sessions"]
            assert {r["session"]: r["clients"] for r in rows} == {"default": 1, "shared": 2}
            b_kernel = kernels_of(pid) - before
            assert len(b_kernel) == 1
        # b went away: its own kernel is gone, the shared one stays for a.
        assert not wait_exited(b_kernel), "b's kernel outlived b"
        assert kernels_of(pid) == before
        still = await a.call_tool("run_python", {"code": "y", "session": "shared"})
        assert still.structured_content["result"] == "5"
        reserved = await a.call_tool("run_python", {"code": "1", "session": "client-abc"})
        assert reserved.is_error and "reserved" in text_of(reserved)
    assert not wait_exited(before), "kernels outlived their clients"
    assert kernels_of(pid) == set()


@pytest.mark.slow
async def test_stdio_server_shuts_its_kernels_down_when_the_client_leaves(
    server_tmp: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    async with stdio_session(server_tmp, errlog=log) as (client, pid):
        await client.call_tool("run_python", {"code": "import time; x = 1"})
        await client.call_tool("run_python", {"code": "2", "session": "other"})
        kernels = kernels_of(pid)
        assert len(kernels) == 2
    assert not wait_exited({pid} | kernels)
    text = log.read_text()
    assert "executor closed" in text and "shutting down" not in text, text


@pytest.mark.slow
async def test_fork_snapshot_and_restore_tools(server_tmp: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    async with stdio_session(server_tmp, errlog=log) as (client, pid):
        await client.call_tool("run_python", {"code": "x = 1"})
        forked = await client.call_tool("fork", {"n": 2})
        assert not forked.is_error, text_of(forked)
        assert forked.structured_content["children"] == ["default~1", "default~2"]
        await client.call_tool("run_python", {"code": "x = 20", "session": "default~2"})
        one = await client.call_tool("run_python", {"code": "x", "session": "default~1"})
        two = await client.call_tool("run_python", {"code": "x", "session": "default~2"})
        assert (one.structured_content["result"], two.structured_content["result"]) == ("1", "20")
        await client.call_tool("run_python", {"code": "y = 5", "session": "shared"})
        shared = await client.call_tool("fork", {"session": "shared"})
        assert shared.structured_content["children"] == ["shared~1"]
        copy = await client.call_tool("run_python", {"code": "y", "session": "shared~1"})
        assert copy.structured_content["result"] == "5"

        snap = await client.call_tool("snapshot", {})
        assert snap.structured_content["snapshot"] == "s1"
        await client.call_tool("run_python", {"code": "x = 'changed'"})
        for _ in range(2):
            back = await client.call_tool("restore", {"snapshot": "s1"})
            assert not back.is_error, text_of(back)
            again = await client.call_tool("run_python", {"code": "x"})
            assert again.structured_content["result"] == "1"
        missing = await client.call_tool("restore", {"snapshot": "s9"})
        assert missing.is_error and "no snapshot 's9'" in text_of(missing)
        rows = (await client.call_tool("list_sessions", {})).structured_content["sessions"]
        assert {"default", "default~1", "default~2", "shared", "shared~1"} <= {
            r["session"] for r in rows
        }
        kernels = kernels_of(pid)
        assert kernels
        family = descendants(kernels)
    assert not wait_exited({pid} | kernels | family), log.read_text()


@pytest.mark.slow
async def test_stdio_server_closes_its_kernels_on_sigterm(server_tmp: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    async with stdio_session(server_tmp, errlog=log) as (client, pid):
        await client.call_tool("run_python", {"code": "1"})
        kernels = kernels_of(pid)
        assert len(kernels) == 1
        os.kill(pid, signal.SIGTERM)
        assert not wait_exited({pid} | kernels), log.read_text()
    text = log.read_text()
    assert "SIGTERM: shutting down" in text and "executor closed" in text, text


def test_bad_options_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mcp", "--isolation", "vm"]) == 2
    assert "isolation: Input should be 'none', 'process' or 'bwrap'" in capsys.readouterr().err
    assert main(["mcp", "--tools", str(tmp_path / "missing.py")]) == 2
    assert "missing.py: cannot read it" in capsys.readouterr().err
    clash = tmp_path / "clash.py"
    clash.write_text("def run_python(code: str) -> str:\n    return code\n")
    assert main(["mcp", "--tools", str(clash)]) == 2
    assert "built-in tool" in capsys.readouterr().err
    assert main(["mcp", "--transport", "http", "--timeout", "0"]) == 2
    assert "--timeout: Input should be greater than 0" in capsys.readouterr().err
    assert main(["mcp", "--transport", "http", "--port", "70000"]) == 2
    assert "--port: Input should be less than or equal to 65535" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["mcp", "--transport", "http", "--port", port]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert main(["mcp", "--requirement=--index-url=http://127.0.0.1/"]) == 2
    assert "is a pip option" in capsys.readouterr().err


CONTROL_CODE = r"""
import sys
print("\x1b]52;c;c2VjcmV0\x07copied\x1b]0;pwned title\x1b\\ \x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\")
print("\x1b[31mred\x1b[0m 10%\rprogress 100%")
print("\x1bcreset\x9b2Jclear\x9d0;t\x9c ok")
sys.stderr.write("warn\r\x1b]52;c;eA==\x07done\n")
"""


@pytest.mark.slow
async def test_run_python_text_carries_no_terminal_control_sequences(
    server_tmp: Path, tmp_path: Path
) -> None:
    async with stdio_session(server_tmp, errlog=tmp_path / "server.log") as (client, _):
        result = await client.call_tool("run_python", {"code": CONTROL_CODE})
    assert not result.is_error, text_of(result)
    text = text_of(result)
    structured = result.structured_content
    assert structured is not None
    for shown in (text, structured["stdout"], structured["stderr"]):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown), repr(shown)
    assert structured["stdout"] == "copied link\nprogress 100%\nresetclear ok\n"
    assert structured["stderr"] == "done\n"
    assert "copied link\nprogress 100%\nresetclear ok" in text
    assert "c2VjcmV0" not in text and "pwned" not in text and "evil" not in text


@pytest.mark.slow
async def test_http_idle_timeout_flag_ends_abandoned_sessions_and_their_kernels(
    server_tmp: Path,
) -> None:
    with running_http_server(server_tmp, "--idle-timeout", "1") as server:
        headers = {"Authorization": f"Bearer {server.token}"}
        # A client that leaves without ending its MCP session (no DELETE), as stateless
        # clients do.
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(server.url, http_client=http, terminate_on_close=False) as (
                read,
                write,
            ),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            result = await session.call_tool("run_python", {"code": "x = 1"})
            assert not result.is_error, text_of(result)
            kernels = kernels_of(server.proc.pid)
            assert len(kernels) == 1
        # Ended by the server after a second without requests: its kernel is shut down.
        assert not wait_exited(kernels, timeout=60), "".join(server.log)
        assert server.proc.poll() is None  # the server itself serves on


def test_idle_timeout_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mcp", "--transport", "http", "--idle-timeout", "0"]) == 2
    assert "--idle-timeout" in capsys.readouterr().err


def test_the_server_imports_no_kernel_machinery_before_it_answers_initialize() -> None:
    # The stdio `initialize` waited 2.3 s of CPU for imports (jsonschema building
    # rfc3987-syntax's grammars, jupyter-client, zmq, nbformat) and the executor's start; they
    # now happen in the background after the server is up.
    heavy = ("kernelexec._assembly._executor", "jsonschema", "nbformat", "zmq", "jupyter_client")
    code = (
        "import sys, kernelexec._mcp._serve, kernelexec._mcp._server\n"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
async def test_an_executor_that_cannot_start_is_said_on_every_call(
    server_tmp: Path, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the recordings' directory should be")
    log = tmp_path / "server.log"
    async with stdio_session(server_tmp, "--record", str(blocked / "runs"), errlog=log) as (
        client,
        _,
    ):
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert "run_python" in tools
        for _ in range(2):
            result = await client.call_tool("run_python", {"code": "1"})
            assert result.is_error
            assert "could not start its kernels" in text_of(result)
            assert str(blocked) in text_of(result)
    assert "could not be started" in log.read_text()


def test_the_http_server_is_stopped_when_its_start_is_not_seen_in_time(server_tmp: Path) -> None:
    # A loaded machine may take longer than the wait for the server's URL: the server it
    # started must not be left running when that wait fails.
    before = server_children()
    with (
        pytest.raises(AssertionError, match=r"no URL from the HTTP server in 0\.001 s"),
        running_http_server(server_tmp, announce_timeout=0.001),
    ):
        pass
    assert server_children() - before == set()


async def test_variables_tool_changes_and_atomic_runs(server_tmp: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    async with stdio_session(server_tmp, errlog=log) as (client, pid):
        first = await client.call_tool("run_python", {"code": "rows = [1, 2]\nname = 'kx'"})
        assert first.structured_content["changes"] == {
            "added": ["name", "rows"],
            "changed": [],
            "removed": [],
        }
        assert "[changes] added name, rows" in text_of(first)
        failed = await client.call_tool(
            "run_python", {"code": "rows.append(3)\nextra = 1\n1/0", "atomic": True}
        )
        assert failed.is_error and failed.structured_content["rolled_back"] is True
        assert "rolled back" in text_of(failed)
        listed = await client.call_tool("variables", {})
        assert not listed.is_error, text_of(listed)
        found = listed.structured_content["variables"]
        assert [(v["name"], v["type"], v["summary"]) for v in found] == [
            ("name", "builtins.str", "'kx'"),
            ("rows", "builtins.list", "[1, 2]"),
        ]
        assert all(isinstance(v["size_bytes"], int) for v in found)
        assert "rows: builtins.list = [1, 2]" in text_of(listed)
        kernels = kernels_of(pid)
        family = descendants(kernels)
    assert not wait_exited({pid} | kernels | family), log.read_text()
