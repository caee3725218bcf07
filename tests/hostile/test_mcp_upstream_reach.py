"""Hostile (issue 41 items 3 and 6): what ``kernelexec mcp --upstream`` can give kernel code.

A secret the operator hands an upstream with ``--upstream-env NAME`` (from the server's own
environment) reaches the upstream and no kernel: it is in no process's command line, and no
kernel can read another user's environment. What stays true, and is documented: at
``"process"`` a kernel reads every host process's command line (so a token put there is read);
at ``"bwrap"`` it sees only its own processes. And every MCP session reaches the same upstream
process, so a stateful upstream is a channel between sessions.

Seen before the fix: the only way to give an upstream a token was its command line
(``--upstream "kv=env KV_TOKEN=... server"``), which kernel code at ``"process"`` read from
``/proc/<pid>/cmdline``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from kernelexec._cli._main import main
from tests.hostile.conftest import HAVE_BWRAP, needs_root
from tests.test_mcp import server_env, server_tmp, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow, needs_root]
__all__ = ["server_tmp"]  # the fixture, used by name

UPSTREAM = textwrap.dedent(
    '''
    import os
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("kv")
    notes = {}


    @server.tool()
    def token_ok(expected: str) -> bool:
        """Whether this server got the token."""
        return os.environ.get("KX_UPSTREAM_TOKEN") == expected


    @server.tool()
    def put(key: str, value: str) -> str:
        """Keep a note."""
        notes[key] = value
        return "ok"


    @server.tool()
    def get(key: str) -> str:
        """A note kept by anyone."""
        return notes.get(key, "")


    server.run(transport="stdio")
    '''
)

SCAN = textwrap.dedent(
    """
    import os
    found = {"cmdline": [], "environ": [], "script": 0, "environ_read": 0}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for kind in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{kind}", "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            if kind == "environ" and int(pid) != os.getpid():
                found["environ_read"] += 1
            if TOKEN.encode() in data:
                found[kind].append(pid)
            if kind == "cmdline" and SCRIPT.encode() in data:
                found["script"] += 1
    found
    """
)


@asynccontextmanager
async def server(
    tmp: Path, script: Path, token: str, isolation: str, errlog: Path
) -> AsyncIterator[ClientSession]:
    env = {**server_env(tmp), "KX_UPSTREAM_TOKEN": token}
    args = [
        "-m",
        "kernelexec",
        "mcp",
        "--isolation",
        isolation,
        "--upstream",
        f"kv={sys.executable} {script}",
        "--upstream-env",
        "KX_UPSTREAM_TOKEN",
    ]
    params = StdioServerParameters(command=sys.executable, args=args, env=env)
    with errlog.open("w") as err:
        async with (
            stdio_client(params, errlog=err) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


async def run_python(client: ClientSession, code: str, session: str | None = None) -> str:
    args = {"code": code} if session is None else {"code": code, "session": session}
    result = await client.call_tool("run_python", args)
    assert not result.is_error, text_of(result)
    return str(result.structured_content["result"])


LEVELS = [
    "process",
    pytest.param("bwrap", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="no bwrap")),
]


@pytest.mark.parametrize("isolation", LEVELS)
async def test_an_upstream_env_secret_reaches_the_upstream_and_no_kernel(
    server_tmp: Path, tmp_path: Path, isolation: str
) -> None:
    script = tmp_path / f"kv-{uuid.uuid4().hex[:8]}.py"
    script.write_text(UPSTREAM)
    script.chmod(0o644)
    await asyncio.to_thread(tmp_path.chmod, 0o755)
    token = f"kxtoken-{uuid.uuid4().hex}"
    async with server(server_tmp, script, token, isolation, tmp_path / "log") as client:
        got = await run_python(
            client, f"from tools.kv import token_ok\ntoken_ok(expected={token!r})"
        )
        assert got == "True"
        code = f"TOKEN = {token!r}\nSCRIPT = {str(script)!r}\n" + SCAN
        found = json.loads(
            (await run_python(client, code + "\nimport json; json.dumps(found)")).strip("'")
        )
    assert found["cmdline"] == [] and found["environ"] == []  # the secret: nowhere
    assert found["environ_read"] == 0  # no other process's environment
    # No host process's command line: at "process" the kernel's own /proc hides other users'
    # processes (hidepid), at "bwrap" it has its own pid namespace.
    assert found["script"] == 0


async def test_every_session_reaches_the_same_upstream(server_tmp: Path, tmp_path: Path) -> None:
    script = tmp_path / "kv.py"
    script.write_text(UPSTREAM)
    token = uuid.uuid4().hex
    async with server(server_tmp, script, token, "process", tmp_path / "log") as client:
        await run_python(client, "from tools.kv import put\nput(key='n', value='from a')", "a")
        seen = await run_python(client, "from tools.kv import get\nget(key='n')", "b")
    assert seen == "'from a'"  # one upstream process: a channel between sessions


def test_a_missing_or_bad_upstream_env_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KX_NOT_SET_ANYWHERE", raising=False)
    assert main(["mcp", "--upstream", "x=true", "--upstream-env", "KX_NOT_SET_ANYWHERE"]) != 0
    assert "not set in the server's environment" in capsys.readouterr().err
    assert main(["mcp", "--upstream", "x=true", "--upstream-env", "A=B"]) != 0
    assert "not an environment variable name" in capsys.readouterr().err
