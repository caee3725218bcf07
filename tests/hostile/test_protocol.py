"""Hostile: a kernel abuses the Jupyter protocol (forged results, bad signatures) and the host's
side of it (connection files, keys)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec.backends._local import LocalConnection
from tests.conftest import kernel_children, our_temp_dirs

pytestmark = pytest.mark.usefixtures("executor")


@pytest.fixture(scope="module")
def executor() -> Iterator[kx.KernelExecutor]:
    before, before_dirs = kernel_children(), our_temp_dirs()
    with kx.KernelExecutor(default_timeout=30) as ex:
        yield ex
    assert not kernel_children() - before
    assert not our_temp_dirs() - before_dirs


def _connection(session: kx.Session) -> LocalConnection:
    conn = session._inner._lease.connection
    assert isinstance(conn, LocalConnection)
    return conn


def forge(value: int) -> int:
    """Tries to forge its own result on every channel it can reach."""
    import json
    import sys

    from IPython import get_ipython
    from IPython.display import display

    kernel = get_ipython().kernel
    print(json.dumps({"return": 999}))
    sys.stdout.write('{"status": "ok", "user_expressions": {"return": 999}}\n')
    display({"application/json": {"return": 999}}, raw=True)
    kernel.session.send(
        kernel.iopub_socket,
        "execute_result",
        {"data": {"text/plain": "999"}, "metadata": {}, "execution_count": 1},
        parent=kernel.get_parent(),
    )
    return value


def test_forging_the_result_channel(executor: kx.KernelExecutor) -> None:
    tool = kx.Tool.from_function(forge)
    result = executor.session("forge").call_tool(tool, {"value": 7})
    assert result.ok, result.error
    assert result.func_return == 7


def test_messages_with_a_bad_signature_are_dropped_and_counted(
    executor: kx.KernelExecutor,
) -> None:
    s = executor.session("badsig")
    s.run_code("1")
    conn = _connection(s)
    before = conn.dropped
    result = s.run_code(
        "from jupyter_client.session import Session\n"
        "k = get_ipython().kernel\n"
        "bad = Session(key=b'not-the-key', username='kernel')\n"
        "for _ in range(3):\n"
        "    bad.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'FORGED'},"
        " parent=k.get_parent())\n"
        "unsigned = Session(key=b'')\n"
        "unsigned.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'UNSIGNED'},"
        " parent=k.get_parent())\n"
        "k.iopub_socket.send_multipart([b'garbage', b'<IDS|MSG>', b'x'])\n"
        "'sent'"
    )
    assert result.ok and result.result == "'sent'"
    assert "FORGED" not in result.stdout and "UNSIGNED" not in result.stdout
    assert conn.dropped - before == 5
    assert s.run_code("'still fine'").result == "'still fine'"


def test_connection_files_are_private_fresh_and_removed(executor: kx.KernelExecutor) -> None:
    s = executor.session("files")
    s.run_code("1")
    conn = _connection(s)
    path = conn._process.km.connection_file  # type: ignore[union-attr]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o777 == 0o700
    key = json.loads(Path(path).read_text())["key"]
    assert len(key) >= 32
    s.restart()
    s.run_code("1")
    assert not os.path.exists(path)
    new_path = _connection(s)._process.km.connection_file  # type: ignore[union-attr]
    assert json.loads(Path(new_path).read_text())["key"] != key
