"""Live attach: ``kernelexec sessions`` and ``kernelexec attach`` against an attachable executor
running in another process, the console driven through its prompt under a pty."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import kernelexec as kx
from kernelexec._cli._main import main
from kernelexec._tempdirs import process_start_time

HOST = """
import json, sys
import kernelexec as kx
from kernelexec._cli._main import main
from kernelexec._tempdirs import process_start_time

with kx.KernelExecutor(attachable=True) as ex:
    ex.run_code("x = 41", agent_id="agent-7")
    print("READY", flush=True)
    for line in sys.stdin:
        r = ex.run_code(json.loads(line), agent_id="agent-7")
        print(r.model_dump_json(), flush=True)
"""

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
PROMPT = r"In \[\d+\]: "


class Host:
    """An agent process: an attachable executor whose session runs the code it is sent."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOST],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != "READY\n":
            self.close()
            pytest.fail(f"the agent process did not start: {line!r}")

    def run(self, code: str) -> kx.Execution:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        return kx.Execution.model_validate_json(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    runtime = tmp_path / "runtime"
    monkeypatch.setenv("KERNELEXEC_RUNTIME_DIR", str(runtime))
    # The agent process's kernels keep their sockets in a short private dir of their own.
    tmp = tempfile.mkdtemp(prefix="kxa-", dir="/tmp")
    try:
        yield {**os.environ, "KERNELEXEC_RUNTIME_DIR": str(runtime), "TMPDIR": tmp}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def host(env: dict[str, str]) -> Iterator[Host]:
    agent = Host(env)
    try:
        yield agent
    finally:
        agent.close()


def kernelexec(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command line, run in this process (the executors it lists are in others)."""
    status = main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


def _cmdline(pid: int) -> bytes:
    return " ".join(psutil.Process(pid).cmdline()).encode()


def test_sessions_lists_a_live_executor_of_another_process(
    host: Host, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = kernelexec(capsys, "sessions", "--json")
    assert status == 0, err
    (entry,) = json.loads(out)
    assert entry["agent_id"] == "agent-7"
    assert entry["host_pid"] == host.proc.pid
    assert entry["calls"] == 1
    assert entry["backend"] == "local"
    assert len(entry["fingerprint"]) == 16
    assert _cmdline(entry["kernel_pid"]).startswith(b"kernelexec kernel agent-7 [")
    registry = Path(env["KERNELEXEC_RUNTIME_DIR"]) / "sessions"
    assert stat.S_IMODE(registry.stat().st_mode) == 0o700
    files = sorted(registry.iterdir())
    assert [f.name.endswith(".connection.json") for f in files] == [True, False]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    connection = json.loads(Path(entry["connection_file"]).read_text())
    assert connection["transport"] == "ipc" and connection["key"]

    assert host.run("x * 2").result == "82"
    table = kernelexec(capsys, "sessions")[1].splitlines()
    assert table[0].split() == ["AGENT", "ENV", "KERNEL", "PID", "HOST", "PID", "STARTED", "CALLS"]
    assert table[1].split()[0] == "agent-7" and table[1].split()[-1] == "2"

    host.close()  # the executor closed: its files are gone
    assert list(registry.iterdir()) == []
    assert json.loads(kernelexec(capsys, "sessions", "--json")[1]) == []


@pytest.mark.slow
def test_attach_console_inspects_the_live_kernel_without_disturbing_the_agent(
    host: Host, env: dict[str, str]
) -> None:
    pexpect = pytest.importorskip("pexpect")
    console: Any = pexpect.spawn(
        sys.executable,
        ["-m", "kernelexec", "attach", "agent-7"],
        env={**env, "TERM": "dumb"},
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )

    def run(code: str) -> str:
        console.sendline(code)
        console.expect(PROMPT)
        return str(ANSI.sub("", console.before))

    try:
        console.expect("attached to agent 'agent-7'")
        console.expect(PROMPT)
        assert re.search(r"Out\[\d+\]: 42", run("x + 1"))
        run("print('console-only'); y = 'from console'")
        # The agent goes on; the console's output is not in its result, and its state is.
        seen = host.run("print('agent'); x")
        assert (seen.status, seen.stdout, seen.result) == ("success", "agent\n", "41")
        assert host.run("y").result == "'from console'"
        # Nor does the agent's output reach the console.
        echoed = run("1 + 1")
        assert "agent" not in echoed and "2" in echoed
        console.sendline("exit")  # stock jupyter-console would shut the kernel down here
        console.expect(pexpect.EOF)
        console.close()
        assert console.exitstatus == 0
    finally:
        if console.isalive():
            console.terminate(force=True)
    after = host.run("x + 1")
    assert after.result == "42" and not after.kernel_restarted


def test_attach_refuses_what_it_cannot_find(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = kernelexec(capsys, "attach", "nobody")
    assert status == 2
    assert "no live attachable session of agent 'nobody' (live: none)" in err
    # An executor is not attachable unless asked.
    with kx.KernelExecutor() as ex:
        assert ex.run_code("1").ok
        assert json.loads(kernelexec(capsys, "sessions", "--json")[1]) == []
    # The entry of a host killed before it could clean up is dropped.
    registry = Path(env["KERNELEXEC_RUNTIME_DIR"]) / "sessions"
    registry.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (registry / f"{gone.pid}-dead.json").write_text(
        json.dumps({"agent_id": "ghost", "host_pid": gone.pid, "host_start": "1"})
    )
    assert json.loads(kernelexec(capsys, "sessions", "--json")[1]) == []
    assert list(registry.iterdir()) == []


def test_attach_says_which_session_when_it_cannot_choose(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    registry = Path(env["KERNELEXEC_RUNTIME_DIR"]) / "sessions"
    registry.mkdir(parents=True)
    me = {"host_pid": os.getpid(), "host_start": process_start_time(os.getpid())}
    entries = {
        "a": {"agent_id": "twin", "fingerprint": "aaaa1111", "connection_file": "/x", **me},
        "b": {"agent_id": "twin", "fingerprint": "bbbb2222", "connection_file": "/y", **me},
        "c": {"agent_id": "idle", "fingerprint": "cccc3333", "connection_file": None, **me},
    }
    for name, entry in entries.items():
        (registry / f"{name}.json").write_text(json.dumps({**entry, "started": name}))
    status, _, err = kernelexec(capsys, "attach", "twin")
    assert status == 2
    assert "2 sessions of agent 'twin': choose with --host-pid" in err
    assert "--fingerprint aaaa1111" in err and "--fingerprint bbbb2222" in err
    status, _, err = kernelexec(capsys, "attach", "idle")
    assert status == 2 and "has no kernel right now" in err
    status, out, _ = kernelexec(capsys, "sessions")
    assert [line.split()[0] for line in out.splitlines()] == ["AGENT", "twin", "twin", "idle"]
    assert out.splitlines()[3].split()[2] == "-"  # no kernel pid


def test_registry_follows_the_sessions_kernel_and_lifetime(env: dict[str, str]) -> None:
    import gc

    from kernelexec._core._attach import live_sessions

    def entries() -> dict[str, dict[str, Any]]:
        return {e["agent_id"]: e for e in live_sessions()}

    with kx.KernelExecutor(attachable=True, max_kernels=1) as ex:
        held = ex.session("a")
        held.run_code("va = 1")
        first_pid = entries()["a"]["kernel_pid"]
        held.restart()  # a fresh kernel: the entry follows it
        assert entries()["a"]["kernel_pid"] not in (None, first_pid)
        ex.run_code("vb = 1", agent_id="b")  # evicts a's kernel (max_kernels=1)
        assert entries()["a"]["connection_file"] is None and entries()["a"]["kernel_pid"] is None
        del held
        gc.collect()  # nobody holds a's session any more: forgotten, its entry removed
        assert set(entries()) == {"b"}
        ex.session("b").close()
        assert entries() == {}
        ex.run_code("1", agent_id="c")
        assert set(entries()) == {"c"}
    assert entries() == {}
