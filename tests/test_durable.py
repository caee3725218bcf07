"""Durable sessions (``state_dir``): hibernate, restore, resume after a restart or a killed host,
and checkpoints that are private, checked and never loaded into the wrong session."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._cli._main import main as cli_main
from kernelexec._durable._store import MANIFEST, PREVIOUS, StateStore, agent_key
from kernelexec._sandbox import _cgroups
from kernelexec._tempdirs import sweep_stale
from tests.conftest import wait_exited

pytestmark = pytest.mark.slow  # every test starts kernels of its own


def _host_env() -> dict[str, str]:
    """A host process's environment: its kernels' directories go to this process's temp dir,
    where ``sweep_stale(tempfile.gettempdir())`` finds what a killed host left (not /tmp)."""
    return {**os.environ, "TMPDIR": tempfile.gettempdir()}


def _ex(state_dir: Path, **config: object) -> kx.KernelExecutor:
    return kx.KernelExecutor(state_dir=state_dir, default_timeout=60, **config)


def _agent_dir(state_dir: Path, agent: str) -> Path:
    return state_dir / "agents" / agent_key(agent, "")


def test_many_agents_sharing_few_kernels_keep_their_state(tmp_path: Path) -> None:
    agents = [f"agent-{i}" for i in range(6)]
    with _ex(tmp_path / "state", max_kernels=2) as ex:
        for i, agent in enumerate(agents):
            first = ex.run_code(
                f"mine = {agent!r} * 2\nn = {i}\nitems = list(range(n))", agent_id=agent
            )
            assert first.ok and first.restored is None
            assert ex.kernel_count <= 2
        for i, agent in enumerate(agents):
            again = ex.run_code("print(mine, n, sum(items))", agent_id=agent)
            assert again.stdout == f"{agent * 2} {i} {sum(range(i))}\n", again
            assert again.lost_variables == []
            assert again.kernel_restarted is False
            if i < 4:  # evicted meanwhile: came back from the state_dir
                assert again.restored is not None
                assert again.restored.names == ["items", "mine", "n"]
            assert ex.kernel_count <= 2


def test_unsaveable_names_are_named_and_reported_lost(tmp_path: Path) -> None:
    with _ex(tmp_path / "state") as ex:
        s = ex.session("a")
        s.run_code(
            "import threading\n"
            "fh = open('notes.txt', 'w')\n"
            "gen = (i for i in range(3))\n"
            "lock = threading.Lock()\n"
            "box = [fh]\n"
            "keep = {'k': 1}\n"
            "def double(v):\n"
            "    return 2 * v\n"
        ).raise_for_error()
        saved = s.hibernate()
        assert saved.saved == ["double", "keep", "threading"]
        assert saved.not_saved == {
            "box": "holds an open file",
            "fh": "holds an open file",
            "gen": "holds a generator",
            "lock": "holds a lock",
        }
        assert ex.kernel_count == 0  # the kernel went
        after = s.run_code("print(double(keep['k']))")
        assert after.stdout == "2\n"
        assert after.lost_variables == ["box", "fh", "gen", "lock"]
        assert after.restored is not None
        assert after.restored.not_restored["gen"] == "not saved: holds a generator"
        missing = s.run_code("fh")
        assert missing.error is not None and missing.error.ename == "NameError"


def test_names_made_by_recorded_cells_are_replayed(tmp_path: Path) -> None:
    with _ex(tmp_path / "state", record=True) as ex:
        s = ex.session("rec")
        s.run_code("path = 'log.txt'\nopen(path, 'w').write('one\\n')").raise_for_error()
        s.run_code("fh = open(path)").raise_for_error()
        s.run_code("count = 3").raise_for_error()
        s.hibernate()
        after = s.run_code("print(fh.read().strip(), count)")
        assert after.stdout == "one 3\n"
        assert after.restored is not None and after.restored.replayed == ["fh"]
        assert after.lost_variables == []


def test_a_clean_restart_resumes_every_agent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        ex.run_code(
            "class Point:\n"
            "    def __init__(self, x):\n"
            "        self.x = x\n"
            "def norm(p):\n"
            "    return abs(p.x)\n"
            "p = Point(-4)\n"
            "shared = [1, 2]\n"
            "alias = {'s': shared}\n"
            "blob = bytes(range(256)) * 10\n"
            "import os\n"
            "os.environ['KX_MARK'] = 'set'\n"
            "open('data.txt', 'w').write('kept')",
            agent_id="one",
        ).raise_for_error()
        ex.run_code("word = 'two'", agent_id="two").raise_for_error()
    listed = StateStore(state).agents()
    assert sorted(a.agent_id for a in listed) == ["one", "two"]
    with _ex(state) as ex:
        one = ex.run_code(
            "print(norm(p), alias['s'] is shared, len(blob), blob[:3] == bytes([0, 1, 2]), "
            "os.environ.get('KX_MARK'), open('data.txt').read())",
            agent_id="one",
        )
        assert one.stdout == "4 True 2560 True set kept\n", one
        assert one.restored is not None and "p" in one.restored.names
        two = ex.run_code("print(word)", agent_id="two")
        assert two.stdout == "two\n"
        fresh = ex.run_code("print(1)", agent_id="three")
        assert fresh.restored is None


def test_after_call_checkpoints_survive_a_sigkilled_host(tmp_path: Path) -> None:
    state = tmp_path / "state"
    host = textwrap.dedent(
        f"""
        import sys, kernelexec as kx
        ex = kx.KernelExecutor(state_dir={str(state)!r}, checkpoint="after_call",
                               workdir={str(tmp_path / "work")!r})
        s = ex.session("k")
        s.run_code("n = 0\\nhist = []").raise_for_error()
        for i in range(3):
            s.run_code(f"n += 1\\nhist.append({{i}})").raise_for_error()
            print("done", i, flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_host_env(),
    )
    assert proc.stdout is not None and proc.stdin is not None
    lines = [proc.stdout.readline().strip() for _ in range(3)]
    assert lines == ["done 0", "done 1", "done 2"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stdin.close()
    sweep_stale(tempfile.gettempdir())
    _cgroups.sweep_stale()
    with _ex(state) as ex:
        back = ex.run_code("print(n, hist)", agent_id="k")
        assert back.stdout == "3 [0, 1, 2]\n", back
        assert back.restored is not None and back.lost_variables == []


def test_after_call_saves_only_what_changed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _ex(state, checkpoint="after_call") as ex:
        s = ex.session("inc")
        s.run_code("big = b'x' * 100_000\nsmall = 1").raise_for_error()
        where = _agent_dir(state, "inc")
        first = (where / MANIFEST).read_bytes()
        s.run_code("print(len(big))").raise_for_error()
        assert (where / MANIFEST).read_bytes() == first  # nothing changed: nothing written
        records = {p.name for p in where.glob("*.rec")}
        s.run_code("small = 2").raise_for_error()
        assert (where / MANIFEST).read_bytes() != first
        added = {p.name for p in where.glob("*.rec")} - records
        assert [os.path.getsize(where / n) for n in added] != [100_000]  # big not rewritten
        assert all(os.path.getsize(where / n) < 1000 for n in added)


def test_a_damaged_checkpoint_never_yields_a_wrong_value(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        s = ex.session("d")
        s.run_code("x = 'right' * 10").raise_for_error()
        s.hibernate()
        where = _agent_dir(state, "d")
        (record,) = where.glob("*.rec")
        data = bytearray(record.read_bytes())
        data[-3] ^= 0x01  # one bit flipped; the size is the same
        record.write_bytes(bytes(data))
        after = s.run_code("x")
        assert after.error is not None and after.error.ename == "NameError"
        assert after.lost_variables == ["x"]
        assert after.restored is not None
        assert "damaged" in after.restored.not_restored["x"]
        # A truncated manifest: the one before is used instead.
        s.run_code("x = 'first'").raise_for_error()
        s.hibernate()
        s.run_code("x = 'second'").raise_for_error()
        s.hibernate()
        manifest = where / MANIFEST
        manifest.write_bytes(manifest.read_bytes()[:40])
        back = s.run_code("print(x)")
        assert back.stdout == "first\n"
        assert back.restored is not None and back.restored.problems
        # Both manifests damaged: nothing is loaded, and the result says why.
        s.hibernate()
        for name in (MANIFEST, PREVIOUS):
            (where / name).write_bytes(b"{}")
        gone = s.run_code("x")
        assert gone.error is not None and gone.error.ename == "NameError"
        assert gone.restored is not None and len(gone.restored.problems) == 2


def test_state_dir_is_private_and_ids_cannot_escape_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    hostile = ["../../escape", "/etc/passwd", "a/../../b", "..", "x\0y"]
    with _ex(state) as ex:
        for agent in hostile:
            ex.run_code(f"v = {agent!r}", agent_id=agent).raise_for_error()
            ex.session(agent).hibernate()
        with _ex(state) as other:  # several executors share a state_dir (test_durable_workers)
            assert other.sessions == {}
    assert sorted(os.listdir(tmp_path)) == ["state"]
    for root, dirs, files in os.walk(state):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert sorted(a.agent_id for a in StateStore(state).agents()) == sorted(hostile)
    with _ex(state) as ex:
        for agent in hostile:
            assert ex.run_code("print(v)", agent_id=agent).stdout == f"{agent}\n"


def test_one_agents_checkpoint_is_never_loaded_into_another(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        ex.run_code("secret = 'of a'", agent_id="a").raise_for_error()
        ex.session("a").hibernate()
        ex.run_code("mine = 'of b'", agent_id="b").raise_for_error()
        ex.session("b").hibernate()
    # Someone copies a's checkpoint over b's.
    a, b = _agent_dir(state, "a"), _agent_dir(state, "b")
    for f in b.iterdir():
        f.unlink()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
        os.chmod(b / f.name, 0o600)
    with _ex(state) as ex:
        got = ex.run_code("print(sorted(k for k in dir() if not k.startswith('_')))", agent_id="b")
        assert "secret" not in got.stdout
        assert got.restored is not None and got.restored.names == []
        assert any("another agent" in p for p in got.restored.problems)


def test_size_limit_names_the_biggest_names(tmp_path: Path) -> None:
    with _ex(tmp_path / "state", max_checkpoint_bytes=50_000) as ex:
        s = ex.session("big")
        s.run_code("huge = b'h' * 80_000\nlarge = list(range(20_000))\nsmall = 1").raise_for_error()
        with pytest.raises(kx.CheckpointTooLargeError, match=r"huge \(80000 bytes\), large"):
            s.hibernate()
        kept = s.run_code("print(len(huge), small)")  # the kernel and its state stayed
        assert kept.stdout == "80000 1\n" and kept.restored is None


def test_delete_state_and_the_sessions_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    with _ex(state) as ex:
        ex.run_code("a = 1", agent_id="keep").raise_for_error()
        ex.run_code("b = 2", agent_id="drop").raise_for_error()
    assert cli_main(["sessions", "--state-dir", str(state), "--json"]) == 0
    listed = capsys.readouterr().out
    assert '"agent_id": "keep"' in listed and '"agent_id": "drop"' in listed
    assert cli_main(["sessions", "--delete", "drop"]) == 2  # needs --state-dir
    assert "--delete needs --state-dir" in capsys.readouterr().err
    assert cli_main(["sessions", "--state-dir", str(state), "--delete", "drop"]) == 0
    assert "deleted the state of 'drop'" in capsys.readouterr().out
    assert [a.agent_id for a in StateStore(state).agents()] == ["keep"]
    with _ex(state) as ex:
        assert ex.delete_state("nobody") is False
        assert ex.run_code("print(a)", agent_id="keep").stdout == "1\n"
        dropped = ex.run_code("b", agent_id="drop")
        assert dropped.error is not None and dropped.restored is None


def test_without_a_state_dir_hibernate_says_so(executor: kx.KernelExecutor) -> None:
    with pytest.raises(kx.ConfigError, match="state_dir"):
        executor.session("no-state").hibernate()


def test_a_256_mib_namespace_restores(tmp_path: Path) -> None:
    with _ex(tmp_path / "state") as ex:
        s = ex.session("large")
        s.run_code(
            "blob = bytes(256 * 1024 * 1024)\nints = list(range(2_000_000))"
        ).raise_for_error()
        saved = s.hibernate()
        assert saved.bytes > 256 * 1024 * 1024
        back = s.run_code("print(len(blob), ints[-1], sum(ints[:10]))")
        assert back.stdout == f"{256 * 1024 * 1024} 1999999 45\n"
        assert back.restored is not None and back.restored.names == ["blob", "ints"]


@pytest.mark.parametrize(
    "level",
    [
        "none",
        "process",
        pytest.param(
            "bwrap",
            marks=pytest.mark.skipif(
                __import__("shutil").which("bwrap") is None, reason="needs bubblewrap"
            ),
        ),
    ],
)
def test_every_isolation_level_hibernates_and_resumes(tmp_path: Path, level: str) -> None:
    state = tmp_path / "state"
    with _ex(state, isolation=level) as ex:
        ex.run_code(
            "def triple(v):\n    return 3 * v\n"
            f"seen = {{'level': {level!r}}}\n"
            "open('f.txt', 'w').write('w')",
            agent_id="iso",
        ).raise_for_error()
        assert ex.session("iso").hibernate().saved == ["seen", "triple"]
        back = ex.run_code("print(triple(2), seen['level'], open('f.txt').read())", agent_id="iso")
        assert back.stdout == f"6 {level} w\n", back
    with _ex(state, isolation=level) as ex:
        again = ex.run_code("print(triple(3), open('f.txt').read())", agent_id="iso")
        assert again.stdout == "9 w\n", again


def test_a_venv_kernel_saves_functions_by_value(tmp_path: Path) -> None:
    env = kx.VenvEnv()
    state = tmp_path / "state"
    with _ex(state, env=env, cache_dir=tmp_path / "cache") as ex:
        ex.run_code("class K:\n    v = 5\ndef make():\n    return K()\nk = make()", agent_id="v")
        assert ex.session("v").hibernate().saved == ["K", "k", "make"]
        back = ex.run_code(
            "import sys\nprint(make().v + k.v, sys.prefix != sys.base_prefix)", agent_id="v"
        )
        assert back.stdout == "10 True\n", back
        assert back.restored is not None and back.lost_variables == []


def test_the_gateway_backend_refuses_after_call_checkpoints_clearly(tmp_path: Path) -> None:
    from kernelexec.backends import GatewayBackend

    # Durable gateway sessions themselves: tests/test_gateway_durable.py (a real gateway).
    with pytest.raises(kx.ConfigError, match="save on_evict"):
        kx.KernelExecutor(
            backend=GatewayBackend("http://127.0.0.1:9"),
            state_dir=tmp_path / "state",
            checkpoint="after_call",
        )


def test_an_idle_culled_session_is_hibernated_and_restored(tmp_path: Path) -> None:
    culled = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "idle kernel of 'idle'" in record.getMessage():
                culled.set()

    handler = Watch()
    logger = logging.getLogger("kernelexec")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with _ex(tmp_path / "state", idle_timeout=0.3) as ex:
            s = ex.session("idle")
            made = s.run_code("z = 41; __import__('os').getpid()")
            assert made.result is not None
            assert culled.wait(30)
            assert wait_exited(int(made.result))
            back = s.run_code("z + 1")
            assert back.result == "42"
            assert back.restored is not None and back.restored.names == ["z"]
            assert back.kernel_restarted is False and back.lost_variables == []
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


def test_an_after_call_checkpoint_too_large_stops_and_deletes_the_stale_one(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    with _ex(state, checkpoint="after_call", max_checkpoint_bytes=50_000) as ex:
        s = ex.session("grow")
        s.run_code("small = 1").raise_for_error()
        assert (_agent_dir(state, "grow") / MANIFEST).exists()
        s.run_code("big = b'x' * 80_000").raise_for_error()  # the call itself succeeds
        assert not (_agent_dir(state, "grow") / MANIFEST).exists()  # no stale checkpoint
        assert s.run_code("print(len(big), small)").stdout == "80000 1\n"
        with pytest.raises(kx.CheckpointTooLargeError, match=r"big \(80000 bytes\)"):
            s.hibernate()


def test_replay_after_a_restart_uses_the_recording_on_disk(tmp_path: Path) -> None:
    state, records = tmp_path / "state", tmp_path / "records"
    with _ex(state, record_dir=records) as ex:
        ex.run_code(
            "path = 'log.txt'\nopen(path, 'w').write('two\\n')", agent_id="r"
        ).raise_for_error()
        ex.run_code("fh = open(path)", agent_id="r").raise_for_error()
    with _ex(state, record_dir=records) as ex:
        back = ex.run_code("print(fh.read().strip())", agent_id="r")
        assert back.stdout == "two\n", back
        assert back.restored is not None and back.restored.replayed == ["fh"]
        assert back.lost_variables == []


def test_setup_code_and_session_files_with_a_restore(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _ex(state, setup_code="def helper():\n    return 7") as ex:
        s = ex.session("setup")
        s.run_code("kept = helper() * 6\nopen('out.txt', 'w').write('saved')").raise_for_error()
    with _ex(state, setup_code="def helper():\n    return 7") as ex:
        s = ex.session("setup")
        assert s.files.read("out.txt") == b"saved"  # the file operation woke the agent
        back = s.run_code("print(kept, helper())")
        assert back.stdout == "42 7\n", back
        assert back.restored is not None and "kept" in back.restored.names
        assert back.lost_variables == []


def test_forks_and_snapshot_restores_of_a_durable_session(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with _ex(state, checkpoint="after_call") as ex:
        s = ex.session("root")
        s.run_code("x = 1").raise_for_error()
        (child,) = s.fork()
        child.run_code("x += 10").raise_for_error()  # the child checkpoints as itself
        snap = s.snapshot()
        s.run_code("x = 5").raise_for_error()
        s.restore(snap)  # the kernel goes back to x == 1: the x == 5 checkpoint is stale
        s.run_code("y = 2").raise_for_error()
        child_id = child.agent_id
        snap.close()
    with _ex(state) as ex:
        assert ex.run_code("print(x, y)", agent_id="root").stdout == "1 2\n"
        assert ex.run_code("print(x)", agent_id=child_id).stdout == "11\n"


def _killed_host(state: Path, body: str, config: str = "") -> list[str]:
    """Run ``body`` in a host process of its own (``ex`` its executor, given ``config``), then
    SIGKILL it once it printed ``ready``; sweep what it left. Returns the lines before."""
    host = (
        "import sys, kernelexec as kx\n"
        f"ex = kx.KernelExecutor(state_dir={str(state)!r}, {config})\n"
        + textwrap.dedent(body)
        + "print('ready', flush=True)\nsys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_host_env(),
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        lines: list[str] = []
        while (line := proc.stdout.readline()) != "ready\n":
            assert line, f"the host ended first, after {lines}"
            lines.append(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    sweep_stale(tempfile.gettempdir())
    _cgroups.sweep_stale()
    return [line.strip() for line in lines]


def test_a_host_killed_before_the_first_checkpoint_says_what_was_lost(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _killed_host(
        state,
        """
        s = ex.session("early")
        s.run_code("a = 1").raise_for_error()
        s.run_code("b = [a, 2]\\ndef f(): return b").raise_for_error()
        """,
    )
    ended = "the host ended before the session's first checkpoint"
    # The next host resumes it, is told, and is killed too before a checkpoint.
    told = _killed_host(
        state,
        """
        s = ex.session("early")
        back = s.run_code("c = 3\\nprint('a' in globals())")
        print(back.stdout.strip(), back.lost_variables, back.restored.problems, flush=True)
        print(back.restored.not_restored["a"], flush=True)
        """,
    )
    assert told == [
        f"False ['a', 'b', 'f'] [\"{ended}: its state is lost\"]",
        f"lost: {ended}",
    ]
    with _ex(state) as ex:
        assert StateStore(state).agents() == []  # nothing was ever checkpointed
        again = ex.run_code("1", agent_id="early")  # what the last host had, not the first
        assert again.lost_variables == ["c"]
        assert again.restored is not None and again.restored.names == []
        assert again.restored.problems == [f"{ended}: its state is lost"]
        fresh = ex.run_code("print(1)", agent_id="never-seen")
        assert fresh.restored is None and fresh.lost_variables == []


def test_a_host_killed_in_its_first_after_call_checkpointed_call_says_so(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _killed_host(
        state,
        """
        import threading
        s = ex.session("busy")
        started = threading.Event()
        threading.Thread(
            target=s.run_code,
            args=("x = 1\\nprint('in', flush=True)\\nimport time\\ntime.sleep(600)",),
            kwargs={"on_stdout": lambda text: started.set()},
            daemon=True,
        ).start()
        started.wait()
        """,
        config="checkpoint='after_call'",
    )
    with _ex(state, checkpoint="after_call") as ex:
        back = ex.run_code("x", agent_id="busy")
        assert back.error is not None and back.error.ename == "NameError"
        assert back.lost_variables == []  # it had none when the call began
        assert back.restored is not None and back.restored.problems == [
            "the host ended before the session's first checkpoint: its state is lost"
        ]
