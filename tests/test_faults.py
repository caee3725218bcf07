"""Faults against real kernels: timeouts, deaths, floods, hostile messages, concurrency."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._tempdirs import OWNER_FILE, _start_time, sweep_stale
from tests.conftest import wait_exited
from tests.support.deadlines import after_output

# 5. timeouts -------------------------------------------------------------------------------


def test_interruptible_timeout_keeps_state(executor: kx.KernelExecutor) -> None:
    s = executor.session("timeout-soft")
    s.run_code("kept = [1, 2, 3]")

    def attempt(timeout: float) -> kx.Execution:
        result = s.run_code("import time\nprint('started')\ntime.sleep(60)", timeout=timeout)
        assert result.error is not None
        assert result.error.kind == "timeout"
        assert result.error.ename == "TimeoutError"
        want = f"timed out after {timeout:g} s; interrupted, kernel state kept"
        assert result.error.evalue == want
        assert result.kernel_restarted is False
        assert s.run_code("kept").result == "[1, 2, 3]"
        return result

    result, _ = after_output(attempt, lambda r: r.stdout != "")
    assert result.stdout == "started\n"
    with pytest.raises(kx.ExecutionTimeout) as raised:
        result.raise_for_error()
    assert isinstance(raised.value, TimeoutError) and raised.value.execution is result
    assert str(raised.value) == f"timeout: TimeoutError: {result.error.evalue}"


def test_raise_for_error_raises_the_runs_error_on_demand(executor: kx.KernelExecutor) -> None:
    s = executor.session("raise-for-error")
    ok = s.run_code("6 * 7")
    ok.raise_for_error()  # a success raises nothing
    failed = s.run_code("raise ValueError('bad input: 7')")
    assert failed.status == "error"
    with pytest.raises(kx.ExecutionError) as raised:
        failed.raise_for_error()
    assert type(raised.value) is kx.ExecutionError  # not a timeout
    assert not isinstance(raised.value, TimeoutError)
    assert raised.value.execution is failed
    assert str(raised.value) == "exception: ValueError: bad input: 7"


def test_code_ignoring_interrupt_is_restarted_and_names_lost_state() -> None:
    spin = kx.Tool.from_source(
        textwrap.dedent(
            """
            def spin() -> None:
                import signal
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                while True:
                    pass
            """
        )
    )
    with kx.KernelExecutor(interrupt_grace=0.5) as ex:
        s = ex.session("stuck")
        s.run_code("precious = 1\ndef helper(): pass")
        result = s.call_tool(spin, {}, timeout=1.0)
        assert result.error is not None
        assert result.error.kind == "timeout"
        assert result.kernel_restarted is True
        assert result.lost_variables == ["helper", "precious"]
        assert "did not stop when interrupted" in result.error.evalue
        after = s.run_code("'precious' in globals(), 6 * 7")
        assert after.ok and after.result == "(False, 42)"
        assert after.kernel_restarted is False


# 6. kernel death ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import os; os._exit(3)", "exit code 3"),
        ("import ctypes; ctypes.string_at(0)", "SIGSEGV"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ],
    ids=["os_exit", "segfault", "sigkill"],
)
def test_kernel_death_is_reported_and_replaced(
    executor: kx.KernelExecutor, code: str, reason: str
) -> None:
    s = executor.session(f"death-{reason}")
    s.run_code("before = 1")
    result = s.run_code(code, timeout=30)
    assert result.error is not None
    assert result.error.kind == "kernel_died"  # noticed as a death, not as a timeout
    assert reason in result.error.evalue
    assert result.kernel_restarted is True
    assert result.lost_variables == ["before"]
    assert s.run_code("'before' in globals()").result == "False"


def test_exit_in_code_is_reported_and_the_next_call_works(executor: kx.KernelExecutor) -> None:
    s = executor.session("exit")
    s.run_code("x = 1")
    result = s.run_code("exit()")
    assert result.error is not None and result.error.kind == "kernel_died"
    assert result.lost_variables == ["x"]
    assert s.run_code("1 + 1").result == "2"


def test_kernel_killed_between_calls_is_noticed(executor: kx.KernelExecutor) -> None:
    s = executor.session("killed-outside")
    pid = int(s.run_code("import os; os.getpid()").result or 0)
    s.run_code("y = 2")
    os.kill(pid, signal.SIGKILL)
    assert wait_exited(pid)
    result = s.run_code("'y' in globals()")
    assert result.ok, result.error
    assert result.result == "False"
    assert result.kernel_restarted is True
    assert "y" in result.lost_variables


def test_code_that_ends_its_kernel_at_once_runs_once() -> None:
    # The kernel may run the code and die before any of its messages leaves it: the request
    # is not sent again to a fresh kernel (which would do twice what it did).
    with kx.KernelExecutor() as ex:
        s = ex.session("once")
        for _ in range(5):
            r = s.run_code("open('ran.txt', 'a').write('x')\nimport os\nos._exit(1)")
            assert r.error is not None and r.error.kind == "kernel_died", r.error
        assert s.files.read("ran.txt") == b"xxxxx"


# 11. output is bounded ---------------------------------------------------------------------


def test_output_flood_is_truncated_with_marker() -> None:
    with kx.KernelExecutor(max_output_chars=10_000) as ex:
        result = ex.run_code(
            "import sys, os\n"
            "print('x' * 5_000_000)\n"
            "for i in range(100_000): print(i)\n"
            "os.write(1, b'y' * 2_000_000)\n"
        )
        assert result.ok, result.error
        assert "output truncated" in result.stdout
        assert len(result.stdout) + len(result.stderr) < 12_000
        again = ex.run_code("print('fresh budget')")
        assert again.stdout == "fresh budget\n"


# 12. rich outputs and callbacks --------------------------------------------------------------


def test_rich_outputs_are_collected_in_order(executor: kx.KernelExecutor) -> None:
    code = textwrap.dedent(
        """
        from IPython.display import display, HTML, Image, JSON
        import base64
        png = base64.b64decode(
            "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
        )
        print("first")
        display(HTML("<b>bold</b>"))
        display(Image(data=png, format="png"))
        display(JSON({"k": [1, 2]}))
        "last"
        """
    )
    result = executor.run_code(code, agent_id="rich")
    assert result.ok, result.error
    kinds = [o["output_type"] for o in result.outputs]
    assert kinds == ["stream", "display_data", "display_data", "display_data", "execute_result"]
    assert result.outputs[1]["data"]["text/html"] == "<b>bold</b>"
    assert result.outputs[2]["data"]["image/png"].startswith("iVBORw0KGgo")
    assert result.outputs[3]["data"]["application/json"] == {"k": [1, 2]}
    assert result.result == "'last'"


def test_callbacks_receive_output_as_it_arrives(executor: kx.KernelExecutor) -> None:
    seen: list[tuple[str, object]] = []
    result = executor.run_code(
        "import sys\nfrom IPython.display import display, HTML\n"
        "print('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\n"
        "display(HTML('<i>x</i>'))",
        agent_id="callbacks",
        on_stdout=lambda t: seen.append(("stdout", t)),
        on_stderr=lambda t: seen.append(("stderr", t)),
        on_display=lambda o: seen.append(("display", o["data"]["text/html"])),
    )
    assert result.ok
    assert ("stdout", "out\n") in seen
    assert ("stderr", "err\n") in seen
    assert ("display", "<i>x</i>") in seen


def test_clear_output_and_display_updates(executor: kx.KernelExecutor) -> None:
    result = executor.run_code(
        "from IPython.display import display, clear_output\n"
        "print('gone')\nclear_output()\n"
        "h = display('v1', display_id=True)\nh.update('v2')\n",
        agent_id="clear",
    )
    assert result.ok, result.error
    assert [o["output_type"] for o in result.outputs] == ["display_data"]
    assert result.outputs[0]["data"]["text/plain"] == "'v2'"


# protocol abuse from inside the kernel ----------------------------------------------------------


def test_forged_and_badly_signed_messages_are_ignored(executor: kx.KernelExecutor) -> None:
    # The bad signature is made on the way out, not by swapping the session's key: ipykernel 7's
    # shell channel thread checks incoming requests with that key, and a fence arriving while
    # the key was wrong was dropped (the run then timed out, now and then under load).
    code = textwrap.dedent(
        """
        k = get_ipython().kernel
        sess, sock = k.session, k.iopub_socket
        parent = k.get_parent()

        class BadSignature:  # the session signs as usual; the signature is spoilt on the way
            def send_multipart(self, parts, *args, **kwargs):
                parts = list(parts)
                parts[parts.index(b"<IDS|MSG>") + 1] = b"0" * 64
                return sock.send_multipart(parts, *args, **kwargs)

        sess.send(BadSignature(), "stream", {"name": "stdout", "text": "BADSIG\\n"}, parent=parent)
        other = {"header": {"msg_id": "someone-else"}}
        sess.send(sock, "stream", {"name": "stdout", "text": "OTHER\\n"}, parent=other)
        sock.send_multipart([b"garbage", b"<IDS|MSG>", b"x"])
        print("real")
        """
    )
    s = executor.session("forged")
    result = s.run_code(code)
    assert result.ok, result.error
    assert result.stdout.startswith("real\n")
    assert "BADSIG" not in result.stdout and "OTHER" not in result.stdout
    # The kernel's session did send the badly signed message for this run; the host refused
    # it, and says one message did not arrive.
    assert result.lost_outputs == 1
    assert s.run_code("2 + 2").result == "4"


# 10. ordering and parallelism ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_calls_on_one_session_run_in_submission_order() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("order")
        await s.run_code("log = []")
        calls = [
            s.run_code(f"import time; time.sleep({0.05 if i % 2 else 0}); log.append({i})")
            for i in range(8)
        ]
        results = await asyncio.gather(*calls)
        assert all(r.ok for r in results)
        assert (await s.run_code("log")).result == str(list(range(8)))


@pytest.mark.anyio
async def test_sessions_run_in_parallel(tmp_path: object) -> None:
    # A rendezvous: each session says it is here, then waits for the other. Sessions run one
    # after the other, in either order, deadlock into the first one's timeout.
    # Two kernels sharing a host file is what tenants must not do: both run as the host's user.
    here = {name: os.path.join(str(tmp_path), name) for name in ("a", "b")}

    def meet(me: str, other: str) -> str:
        return (
            f"import os, time\nopen({here[me]!r}, 'w').close()\n"
            f"while not os.path.exists({here[other]!r}): time.sleep(0.01)\n'met'"
        )

    async with kx.AsyncKernelExecutor(isolation="none") as ex:
        a, b = await ex.session("par-a"), await ex.session("par-b")
        await asyncio.gather(a.run_code("1"), b.run_code("1"))
        ra, rb = await asyncio.gather(
            a.run_code(meet("a", "b"), timeout=60), b.run_code(meet("b", "a"), timeout=60)
        )
        assert (ra.ok, ra.result) == (True, "'met'"), ra.error
        assert (rb.ok, rb.result) == (True, "'met'"), rb.error


@pytest.mark.anyio
async def test_a_cancelled_call_interrupts_the_kernel() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        s = await ex.session("cancel")
        await s.run_code("kept = 5")
        started = asyncio.Event()
        call = asyncio.ensure_future(
            s.run_code(
                "import time; print('go', flush=True); time.sleep(60)",
                on_stdout=lambda _: started.set(),
            )
        )
        await asyncio.wait_for(started.wait(), 20)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # Without the interrupt this would queue behind the 60 s sleep and time out.
        after = await s.run_code("kept", timeout=10)
        assert after.ok, after.error
        assert after.result == "5"


def test_stale_dirs_of_dead_owners_are_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = {
        "kx-dead": f"{dead.pid} 1\n",  # owner gone
        ".kx-in-dead": f"{dead.pid} 1\n",  # a capped directory's contents, its host killed
        "kernelexec-reused": f"{os.getpid()} 999999999\n",  # pid alive, but another process
        "kx-alive": f"{os.getpid()} {_start_time(os.getpid())}\n",
        "kx-unowned": None,  # not made by this version: left alone
        "other-dead": f"{dead.pid} 1\n",  # not ours by name
    }
    for name, owner in cases.items():
        (tmp_path / name).mkdir()
        if owner is not None:
            (tmp_path / name / OWNER_FILE).write_text(owner)
    # Named like kernelexec's, with a marker kernelexec did not write (issue 36: swept by name).
    (tmp_path / "kx-work").mkdir()
    (tmp_path / "dead-owner").write_text(f"{dead.pid} 1\n")
    (tmp_path / "kx-work" / OWNER_FILE).symlink_to(tmp_path / "dead-owner")
    (tmp_path / "kx-linked").mkdir()
    os.link(tmp_path / "dead-owner", tmp_path / "kx-linked" / OWNER_FILE)  # a second name
    (tmp_path / "kx-planted").mkdir()
    (tmp_path / "kx-planted" / OWNER_FILE).write_text(f"{dead.pid} 1\n")
    if os.geteuid() == 0:  # a marker of another user than the directory's
        os.chown(tmp_path / "kx-planted" / OWNER_FILE, 12345, 12345)
    else:
        (tmp_path / "kx-planted" / OWNER_FILE).chmod(0o000)  # one it cannot read
    removed = sweep_stale(str(tmp_path))
    assert sorted(Path(p).name for p in removed) == [".kx-in-dead", "kernelexec-reused", "kx-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dead-owner",
        "kx-alive",
        "kx-linked",
        "kx-planted",
        "kx-unowned",
        "kx-work",
        "other-dead",
    ]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the earlier token came from /proc"
)
def test_owner_token_is_the_one_earlier_versions_wrote() -> None:
    # Two kernelexec versions on one machine must agree on which owners are alive, or each
    # sweeps the other's live kernel directories.
    stat = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    assert _start_time(os.getpid()) == stat
