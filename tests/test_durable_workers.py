"""Several executors, each in a process of its own, on one ``state_dir``: an agent lives in one
at a time, moves on request (``handoff_timeout``, ``AgentBusyError``), is taken over at once
from a killed holder, and no update is lost."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kernelexec as kx
from kernelexec._cli._main import main as cli_main
from kernelexec._durable._handoff import STALE_S
from kernelexec._durable._leases import (
    LeaseBook,
    Mount,
    check_filesystem,
    lock_problem,
    mount_of,
)
from kernelexec._durable._store import agent_key
from kernelexec._sandbox import _cgroups
from kernelexec._tempdirs import sweep_stale
from tests.conftest import wait_exited

pytestmark = pytest.mark.slow  # every test starts kernels and processes of its own

# One worker process: an executor on the state_dir, driven by one JSON command per line.
_WORKER = textwrap.dedent(
    """
    import json, sys, kernelexec as kx
    config = json.loads(sys.argv[1])
    def say(**answer):
        print(json.dumps(answer), flush=True)
    with kx.KernelExecutor(**config) as ex:
        say(ready=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["op"] == "session":
                    ex.session(cmd["agent"])
                    say(ok=True)
                    continue
                out = ex.run_code(
                    cmd["code"],
                    agent_id=cmd["agent"],
                    on_stdout=(lambda t: say(stdout=t)) if cmd.get("stream") else None,
                )
                say(
                    stdout=out.stdout,
                    error=out.error.evalue if out.error else None,
                    restored=out.restored.names if out.restored else None,
                    lost=out.lost_variables,
                )
            except kx.KernelExecError as exc:
                say(raised=type(exc).__name__, message=str(exc))
    """
)


class Worker:
    """A process with an executor of its own on ``state``; ``host``: a host name of its own
    (a UTS namespace: the executor names its host as another host's would)."""

    def __init__(self, state: Path, host: str | None = None, **config: Any) -> None:
        config = {"state_dir": str(state), "default_timeout": 120, **config}
        argv = [sys.executable, "-c", _WORKER, json.dumps(config)]
        if host is not None:
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # Its kernels' directories in this process's temp dir, where kill() sweeps them.
            env={**os.environ, "TMPDIR": tempfile.gettempdir()},
        )
        assert self.next() == {"ready": True}

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"worker {self.proc.pid} ended"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, code: str, agent: str = "a") -> dict[str, Any]:
        self.send(op="run", code=code, agent=agent)
        return self.next()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()  # the executor closes (hibernating its agents)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        assert wait_exited(self.proc.pid)
        self.close()
        sweep_stale(tempfile.gettempdir())  # what the killed host left
        _cgroups.sweep_stale()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.close()


def _ex(state: Path, **config: Any) -> kx.KernelExecutor:
    return kx.KernelExecutor(state_dir=state, default_timeout=120, **config)


def test_two_processes_incrementing_one_agent_lose_no_update(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        ex.run_code("x = 0\nspans = []", agent_id="a").raise_for_error()
    one, two = Worker(state), Worker(state)
    workers += [one, two]
    # Each call holds the kernel a while and records when it ran: two kernels of the agent
    # running at once would show as overlapping spans (or as a lost increment).
    step = (
        "import time\n_t = time.time_ns()\nx += 1\ntime.sleep(0.005)\n"
        "spans.append((_t, time.time_ns()))\nprint(x)"
    )
    for _ in range(20):  # both ask at once, twenty times each
        one.send(op="run", code=step, agent="a")
        two.send(op="run", code=step, agent="a")
        got = [one.next(), two.next()]
        assert [g["error"] for g in got] == [None, None], got
    one.close()
    two.close()
    with _ex(state) as ex:
        out = ex.run_code("print(x, len(spans))\nprint(sorted(spans))", agent_id="a")
        count, spans = out.stdout.split("\n", 1)
        assert count == "40 40"
        ordered = json.loads(spans.replace("(", "[").replace(")", "]"))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))


def test_a_session_asked_for_elsewhere_moves_with_its_state(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    holder = Worker(state)
    workers.append(holder)
    made = holder.run("data = [1, 2, 3]\nfh = open('/dev/null')")
    assert made["error"] is None
    with _ex(state) as ex:
        s = ex.session("a")  # held by the worker: it hibernates the agent and lets go
        got = s.run_code("print(sum(data))")
        assert got.stdout == "6\n"
        assert got.restored is not None and got.restored.names == ["data"]
        assert got.lost_variables == ["fh"] and "fh" in got.restored.not_restored
    # The executor closed (hibernating it): the worker takes it back on its next call.
    back = holder.run("data.append(4)\nprint(data)")
    assert back["stdout"] == "[1, 2, 3, 4]\n" and back["restored"] == ["data"]


def test_a_holder_busy_past_the_timeout_is_named_in_agent_busy_error(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    holder = Worker(state)
    workers.append(holder)
    holder.send(
        op="run",
        agent="a",
        stream=True,
        code="import time\nprint('running', flush=True)\ntime.sleep(600)",
    )
    assert holder.next() == {"stdout": "running\n"}  # its call runs now
    # 5 s for the holder to answer "busy" on a loaded host (the refusal waits that long).
    with _ex(state, handoff_timeout=5) as ex:
        with pytest.raises(kx.AgentBusyError) as caught:
            ex.session("a")
        assert isinstance(caught.value, kx.StateError)
        message = str(caught.value)
        assert f"process {holder.proc.pid} on host {socket.gethostname()!r}" in message
        assert "handoff_timeout=5s: its session was running a call" in message
        assert ex.sessions == {}  # nothing was made
    holder.kill()


def test_a_checkpoint_too_large_is_the_reason_given(tmp_path: Path, workers: list[Worker]) -> None:
    state = tmp_path / "state"
    holder = Worker(state, max_checkpoint_bytes=50_000)
    workers.append(holder)
    assert holder.run("big = b'b' * 80_000\nsmall = 1")["error"] is None
    with _ex(state) as ex, pytest.raises(kx.AgentBusyError, match=r"refused: .*=50000"):
        ex.session("a")
    kept = holder.run("print(len(big), small)")  # the holder kept the agent and its kernel
    assert kept["stdout"] == "80000 1\n" and kept["restored"] is None


def test_a_killed_holder_is_taken_over_at_once_from_its_last_checkpoint(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    holder = Worker(state, checkpoint="after_call")
    workers.append(holder)
    assert holder.run("n = 1")["error"] is None
    assert holder.run("n += 1")["error"] is None
    holder.kill()
    # A wait of handoff_timeout would pass the test's own time limit.
    with _ex(state, handoff_timeout=3600) as ex:
        got = ex.run_code("print(n)", agent_id="a")
        assert got.stdout == "2\n" and got.lost_variables == []
        assert got.restored is not None and got.restored.names == ["n"]


def test_sessions_shows_each_agents_holder(
    tmp_path: Path, workers: list[Worker], capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        ex.run_code("v = 1", agent_id="resting").raise_for_error()
    holder = Worker(state)
    workers.append(holder)
    assert holder.run("w = 2", agent="busy")["error"] is None
    assert holder.run("w", agent="busy")["error"] is None
    holder.send(op="session", agent="resting")
    assert holder.next() == {"ok": True}  # held, with no kernel yet
    assert cli_main(["sessions", "--state-dir", str(state), "--json"]) == 0
    listed = {a["agent_id"]: a for a in json.loads(capsys.readouterr().out)}
    who = {"pid": holder.proc.pid, "host": socket.gethostname()}
    assert {k: listed["resting"]["holder"][k] for k in who} == who
    assert {k: listed["busy"]["holder"][k] for k in who} == who
    assert cli_main(["sessions", "--state-dir", str(state)]) == 0
    table = capsys.readouterr().out
    assert f"pid {holder.proc.pid}" in table
    holder.close()
    assert cli_main(["sessions", "--state-dir", str(state), "--json"]) == 0
    listed = {a["agent_id"]: a for a in json.loads(capsys.readouterr().out)}
    assert listed["resting"]["holder"] is None and listed["busy"]["holder"] is None
    assert cli_main(["sessions", "--state-dir", str(state)]) == 0
    assert "none" in capsys.readouterr().out


_NFS = (
    "36 25 0:45 / /srv/state rw,relatime shared:30 - nfs4 fs1:/export rw,vers=4.2,local_lock=none"
)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (_NFS, None),
        (_NFS.replace("local_lock=none", "local_lock=flock"), "local to each host"),
        (_NFS.replace("nfs4", "nfs").replace("vers=4.2", "vers=3,nolock"), "nolock"),
        ("40 25 0:50 / /srv/state rw - fuse.sshfs me@h:/s rw,user_id=0", "local to each host"),
        ("41 25 0:51 / /srv/state rw - cifs //h/s rw,vers=3.0", "local to each host"),
        ("42 25 0:52 / /srv/state rw - lustre mgs@tcp:/fs rw,localflock", "without flock"),
        ("43 25 0:53 / /srv/state rw - lustre mgs@tcp:/fs rw,flock", None),
        ("44 25 8:1 / /srv rw - ext4 /dev/sda1 rw", None),
    ],
)
def test_filesystems_whose_locks_stay_on_one_host_are_named(line: str, problem: str | None) -> None:
    mountinfo = f"1 0 8:1 / / rw - ext4 /dev/root rw\n{line}\n"
    mount = mount_of("/srv/state/agents", mountinfo)
    assert isinstance(mount, Mount) and mount.point in ("/srv/state", "/srv")
    found = lock_problem(mount)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_a_state_dir_on_a_refused_filesystem_is_a_config_error_naming_it(
    tmp_path: Path,
) -> None:
    # A real mount of such a filesystem needs a server (NFS, SMB) or FUSE, which this machine
    # lacks: the check is given the mount table of a host where the directory is on sshfs.
    real = os.path.realpath(tmp_path)
    table = f"1 0 8:1 / / rw - ext4 /dev/root rw\n7 1 0:9 / {real} rw - fuse.sshfs u@h:/d rw\n"
    with pytest.raises(kx.ConfigError, match=r"fuse\.sshfs filesystem \(u@h:/d at "):
        check_filesystem(tmp_path, table)
    check_filesystem(tmp_path)  # this machine's own table: accepted
    with _ex(tmp_path / "state") as ex:
        assert ex.run_code("print(1)").stdout == "1\n"


def test_two_executors_at_once_hold_different_agents_without_waiting(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    one, two = Worker(state, handoff_timeout=5), Worker(state, handoff_timeout=5)
    workers += [one, two]
    for i in range(3):
        one.send(op="run", code=f"mine = {i}", agent="one")
        two.send(op="run", code=f"mine = {i}", agent="two")
        assert one.next()["error"] is None and two.next()["error"] is None
    assert one.run("print(mine)", agent="one") == {
        "stdout": "2\n",
        "error": None,
        "restored": None,  # never moved
        "lost": [],
    }
    assert two.run("print(mine)", agent="two")["stdout"] == "2\n"


def test_a_session_whose_agent_moved_away_asks_for_it_back(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    # 5 s for the worker to checkpoint and let the agent go on a loaded host (the busy
    # refusal below waits that long).
    with _ex(state, handoff_timeout=5) as ex:
        mine = ex.session("a")
        mine.run_code("x = 1").raise_for_error()
        other = Worker(state)
        workers.append(other)
        assert other.run("x += 1")["restored"] == ["x"]  # taken from this executor
        back = mine.run_code("x += 1\nprint(x)")  # asks the worker, which lets it go
        assert back.stdout == "3\n" and back.restored is not None
        other.send(
            op="run",
            agent="a",
            stream=True,
            code="import time\nprint('running', flush=True)\ntime.sleep(600)",
        )
        assert other.next() == {"stdout": "running\n"}  # the worker has it again, busy
        with pytest.raises(kx.AgentBusyError, match=f"process {other.proc.pid} on host"):
            mine.run_code("print(x)")
        other.kill()
        after = mine.run_code("print(x)")  # the holder is gone: taken over at once
        assert after.stdout == "3\n"


def test_a_hung_holder_is_named_as_not_renewing_its_lease(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    holder = Worker(state)
    workers.append(holder)
    assert holder.run("x = 1")["error"] is None
    os.kill(holder.proc.pid, signal.SIGSTOP)  # alive, its lock held, answering nothing
    try:
        with _ex(state, handoff_timeout=STALE_S + 2) as ex, pytest.raises(kx.AgentBusyError) as e:
            ex.session("a")
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    assert f"process {holder.proc.pid} on host" in str(e.value)
    assert "has not renewed its lease for" in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="a host name of its own needs root (unshare --uts)")
def test_a_silent_holder_on_another_host_is_taken_over_and_stands_down_when_it_wakes(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    holder = Worker(state, host="kx-other-host", checkpoint="after_call")
    workers.append(holder)
    assert holder.run("x = 1")["error"] is None
    kernel = int(holder.run("print(__import__('os').getpid())")["stdout"])
    # Its host "dies": no heartbeat any more, and its lock stays held (as on NFS until the
    # server gives up on that host). A wait of handoff_timeout would pass the test's limit.
    os.kill(holder.proc.pid, signal.SIGSTOP)
    woken = False
    try:
        with _ex(state, handoff_timeout=3600, checkpoint="after_call") as ex:
            got = ex.run_code("print(x)\nx = 100", agent_id="a")
            assert got.stdout == "1\n" and got.lost_variables == []
            assert got.restored is not None and got.restored.names == ["x"]
            holders = {h.agent_id: (h.host, h.pid) for h in LeaseBook(state).held().values()}
            assert holders == {"a": (socket.gethostname(), os.getpid())}
            # The old holder wakes with a call waiting: it finds its lease broken before it
            # uses its kernel, writes nothing, drops that kernel, and asks for the agent back
            # like any other executor (that call on its old kernel would print 1).
            holder.send(op="run", code="print(x)", agent="a")
            os.kill(holder.proc.pid, signal.SIGCONT)
            woken = True
            back = holder.next()
            assert back["stdout"] == "100\n", back
            assert back["restored"] == ["x"] and back["lost"] == []
            assert wait_exited(kernel, timeout=120), "the woken holder kept its kernel"
    finally:
        if not woken:
            os.kill(holder.proc.pid, signal.SIGCONT)


def test_a_lease_is_broken_only_while_what_was_seen_still_holds(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    there, here = LeaseBook(state), LeaseBook(state)
    there.host = "kx-other-host"
    there.open()
    here.open()
    try:
        assert there.try_take("a", "")
        key = agent_key("a", "")
        seen, lock_id = here.holder(key), here.lock_id(key)
        assert seen is not None and lock_id is not None
        there.renew()  # it renewed after it was seen: alive
        assert not here.break_stale(key, seen, lock_id)
        seen = here.holder(key)
        assert seen is not None
        assert not here.break_stale(key, seen, lock_id + 1)  # another lock file than seen
        # A holder on this host is never broken: its lock goes with its process.
        assert not here.break_stale(key, dataclasses.replace(seen, host=here.host), lock_id)
        assert there.mine(key) and there.lost() == []
        assert here.break_stale(key, seen, lock_id)
        assert not here.break_stale(key, seen, lock_id)  # once
        assert there.lost() == [key] and not there.mine(key)
        there.forget(key)
        assert here.try_take("a", "")
        assert here.mine(key)  # a fresh lock file (its inode number may be the old one's)
        there.release(key)  # a forgotten lease: the new holder's record stays
        now = here.holder(key)
        assert now is not None and now.token == here.token
    finally:
        here.close()
        there.close()


def test_a_holder_killed_after_unsaved_calls_has_the_next_owner_told(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        ex.run_code("x = 1", agent_id="a").raise_for_error()  # checkpointed at close
    holder = Worker(state)  # checkpoint="on_evict": saves only when the kernel goes
    workers.append(holder)
    assert holder.run("x += 1\ny = 2")["restored"] == ["x"]
    holder.kill()
    with _ex(state) as ex:
        got = ex.run_code("print(x)", agent_id="a")
        assert got.stdout == "1\n"  # the last checkpoint: the calls since are lost...
        assert got.lost_variables == ["y"]  # ...and said to be
        assert got.restored is not None
        assert any("its host ended after calls" in p for p in got.restored.problems)
        again = ex.session("a")
        again.hibernate()  # a checkpoint of its own: nothing to tell any more
        later = again.run_code("print(x)")
        assert later.restored is not None and later.restored.problems == []


def test_the_working_directory_moves_with_the_agent_and_back(
    tmp_path: Path, workers: list[Worker]
) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        mine = ex.session("a")
        mine.run_code("open('notes.txt', 'w').write('here')").raise_for_error()
        other = Worker(state)
        workers.append(other)
        moved = other.run("print(open('notes.txt').read())\nopen('notes.txt', 'w').write('there')")
        assert moved["stdout"] == "here\n"
        back = mine.run_code("print(open('notes.txt').read())")  # not this directory's old copy
        assert back.stdout == "there\n"
