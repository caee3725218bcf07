"""``kernelexec mcp --upstream NAME=COMMAND``: code in the kernel calls another MCP server's
tools as ``tools.NAME.<tool>`` (a real upstream server, over stdio, driven by the SDK's client)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from kernelexec._cli._main import main
from tests.test_mcp import server_tmp, stdio_session, text_of, wait_exited

pytestmark = pytest.mark.anyio
__all__ = ["server_tmp"]  # the fixture, used by name

UPSTREAM = textwrap.dedent(
    '''
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("calc")


    @server.tool()
    def add(a: int, b: int = 0) -> int:
        """Add two integers."""
        return a + b


    @server.tool()
    def lookup(key: str) -> dict:
        """A record by key."""
        return {"key": key, "size": len(key)}


    @server.tool()
    def explode(message: str) -> str:
        """Fails."""
        raise ValueError(message)


    server.run(transport="stdio")
    '''
)


@pytest.mark.slow
async def test_kernel_code_calls_upstream_tools(server_tmp: Path, tmp_path: Path) -> None:
    script = tmp_path / "upstream.py"
    script.write_text(UPSTREAM)
    log = tmp_path / "server.log"
    upstream = f"calc={sys.executable} {script}"
    async with stdio_session(server_tmp, "--upstream", upstream, errlog=log) as (client, pid):
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert "tools.calc: add, lookup, explode" in (listed["run_python"].description or "")
        code = (
            "import inspect\nfrom tools.calc import add, lookup, explode, HostFunctionError\n"
            "print(inspect.signature(add))\n"
            "print(sum(add(a=i, b=i) for i in range(10)))\n"
            "import json\nrecord = lookup('abc')\n"  # text when the tool declares no output schema
            "print(sorted((json.loads(record) if isinstance(record, str) else record).items()))\n"
            "try:\n    explode('no')\nexcept HostFunctionError as e:\n    print('failed:', e)\n"
        )
        result = await client.call_tool("run_python", {"code": code})
        assert not result.is_error, text_of(result)
        stdout = result.structured_content["stdout"]
        lines = stdout.splitlines()
        assert lines[0] == "(a: int, b: int = 0)"
        assert lines[1] == "90"
        assert lines[2] == "[('key', 'abc'), ('size', 3)]"
        assert lines[3].startswith("failed: Error executing tool explode")  # the SDK's words
    assert not wait_exited({pid}), "the server did not exit"
    assert "upstream calc: add, lookup, explode" in log.read_text()


def test_bad_upstream_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mcp", "--upstream", "no equals sign"]) != 0
    assert "NAME=COMMAND" in capsys.readouterr().err
