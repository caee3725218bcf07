"""The gateway backend against a real jupyter-kernel-gateway on 127.0.0.1 (started and stopped
here): the same behaviours as local kernels, and the faults of a remote kernel service."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import psutil
import pytest

import kernelexec as kx
from kernelexec.backends import GatewayBackend, get_backend
from kernelexec.backends._gateway_wire import decode, encode, new_message
from tests.support.deadlines import after_output
from tests.support.gateway import SECRET, Gateway, TcpProxy, free_port

pytest.importorskip("kernel_gateway", reason="jupyter-kernel-gateway is not installed")
pytest.importorskip("websockets", reason="websockets is not installed (kernelexec[gateway])")

EXEC_VAR = "KX_GW_EXEC_VAR"


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    with Gateway(env_whitelist=(EXEC_VAR,)) as gw:
        yield gw


@pytest.fixture(autouse=True)
def no_gateway_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every kernel a test started on the shared gateway is gone when it ends."""
    yield
    if "gateway" in request.fixturenames:
        gw: Gateway = request.getfixturevalue("gateway")
        assert gw.kernels() == [], "kernels left running on the gateway"


REPLACING = 120.0
"""``start_timeout`` for the tests that have a kernel replaced: a replacement on the gateway pays
for the old kernel's DELETE (up to about 5 s of Jupyter's shutdown wait) and a cold start in one
budget, on a machine running two suites."""


def backend(gw: Gateway, **options: object) -> GatewayBackend:
    return GatewayBackend(gw.url, token=gw.token, **options)  # type: ignore[arg-type]


def echo_tool() -> kx.Tool:
    return kx.Tool.from_source(
        '''
def echo(value: str) -> dict:
    """Echo a string and its hash.

    Args:
        value: Any string.
    """
    import hashlib
    return {"value": value, "sha": hashlib.sha256(value.encode()).hexdigest()}
'''
    )


# -- the same behaviours as local kernels ---------------------------------------------------


def test_state_persists_and_sessions_work_in_their_own_directory(gateway: Gateway) -> None:
    with kx.KernelExecutor(backend=backend(gateway), default_timeout=30) as ex:
        a = ex.session("agent-a")
        assert a.run_code("x = 41").ok
        assert a.run_code("x + 1").result == "42"
        assert ex.session("agent-b").run_code("'x' in globals()").result == "False"
        cwd = a.run_code("import os; open('note.txt', 'w').write('hi'); os.getcwd()").result
        assert cwd == repr(str(gateway.work / "kernelexec" / "agent-a"))
        assert (gateway.work / "kernelexec" / "agent-a" / "note.txt").read_text() == "hi"
        assert str(a.workdir) == "kernelexec/agent-a"


NASTY = [
    "quotes ' \" ''' \"\"\" and backslashes \\ \\\\ \\n \\x00",
    "NUL \x00 inside, line\u2028separator\u2029, non-BMP \U0001f600 and e\u0301",
    "\"); import os; os.system('touch /tmp/pwned'); (\"",
    "x" * 100_000,
]


@pytest.mark.parametrize("offer_v1", [True, False], ids=["v1", "json"])
def test_tool_arguments_and_results_are_byte_exact(gateway: Gateway, offer_v1: bool) -> None:
    ident = kx.Tool.from_source("def ident(value):\n    return value\n")
    value = {
        "big": 2**200,
        "float": 0.1 + 0.2,
        "tiny": 5e-324,
        "nested": [None, True, False, [], {}, {"k": [1, 2.5, "s"]}],
    }
    with kx.KernelExecutor(backend=backend(gateway, offer_v1=offer_v1), default_timeout=30) as ex:
        for text in NASTY:
            result = ex.call_tool(echo_tool(), {"value": text})
            assert result.ok, result.error
            assert result.func_return == {
                "value": text,
                "sha": hashlib.sha256(text.encode()).hexdigest(),
            }
        result = ex.call_tool(ident, {"value": value})
        assert result.func_return == value
        assert type(result.func_return["big"]) is int
        # An argument that escaped into code would run in the kernel: look at its /tmp.
        assert ex.run_code("import os; os.path.exists('/tmp/pwned')").result == "False"
    assert not Path("/tmp/pwned").exists()


def test_timeout_interrupts_and_keeps_state(gateway: Gateway) -> None:
    with kx.KernelExecutor(backend=backend(gateway), default_timeout=30) as ex:
        s = ex.session()
        s.run_code("x = 'kept'")

        def attempt(timeout: float) -> tuple[kx.Execution, bool]:
            started = threading.Event()
            r = s.run_code(
                "print('sleeping', flush=True)\nimport time\ntime.sleep(60)",
                timeout=timeout,
                on_stdout=lambda _: started.set(),
            )
            assert r.error is not None and r.error.kind == "timeout"
            assert "state kept" in r.error.evalue
            assert not r.kernel_restarted
            assert s.run_code("x").result == "'kept'"
            return r, started.is_set()

        (r, _), _ = after_output(attempt, lambda attempted: attempted[1], (2.0, 10.0, 30.0))
        assert r.stdout == "sleeping\n"


@pytest.mark.slow
def test_kernel_killed_from_inside_is_replaced(gateway: Gateway) -> None:
    with kx.KernelExecutor(
        backend=backend(gateway), default_timeout=30, start_timeout=REPLACING
    ) as ex:
        s = ex.session()
        s.run_code("x = 1")
        r = s.run_code("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        assert r.error is not None and r.error.kind == "kernel_died"
        assert "the kernel died" in r.error.evalue
        assert r.kernel_restarted and r.lost_variables == ["x"]
        assert s.run_code("'x' in globals(), 1 + 1").result == "(False, 2)"
        assert len(gateway.kernels()) == 1


def test_env_scoping(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KX_GW_HOST_ONLY", "host-secret")
    probe = "import os; (os.environ.get({!r}), os.environ.get({!r}), os.environ.get({!r}))"
    code = probe.format("KX_GW_HOST_ONLY", SECRET, EXEC_VAR)
    with kx.KernelExecutor(
        backend=backend(gateway), env_vars={EXEC_VAR: "for-kernels"}, default_timeout=30
    ) as ex:
        # Neither the host's nor the gateway's own variables reach the kernel; env_vars do.
        assert ex.run_code(code).result == "(None, None, 'for-kernels')"
        per_call = ex.run_code(
            "import os; os.environ['KX_GW_CALL']", env_vars={"KX_GW_CALL": "only now"}
        )
        assert per_call.result == "'only now'"
        assert ex.run_code("import os; 'KX_GW_CALL' in os.environ").result == "False"


def test_executor_env_vars_reach_kernels_the_gateway_does_not_whitelist(
    gateway: Gateway,
) -> None:
    # The gateway passes on only KG_ENV_WHITELIST (EXEC_VAR here); the executor's env_vars
    # must reach the kernel all the same, in code, in tool calls and after a restart.
    probe = kx.Tool.from_source(
        "def probe() -> str:\n    import os\n    return os.environ.get('KX_SET', 'unset')\n"
    )
    with kx.KernelExecutor(
        backend=backend(gateway),
        env_vars={"KX_SET": "s1"},
        default_timeout=30,
        start_timeout=REPLACING,
    ) as ex:
        s = ex.session()
        assert s.run_code("import os; os.environ.get('KX_SET')").result == "'s1'"
        assert ex.session("tools").call_tool(probe).func_return == "s1"
        per_call = s.run_code("os.environ['KX_SET']", env_vars={"KX_SET": "call"})
        assert per_call.result == "'call'"
        assert s.run_code("os.environ['KX_SET']").result == "'s1'"
        died = s.run_code("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        assert died.kernel_restarted
        assert s.run_code("import os; os.environ.get('KX_SET')").result == "'s1'"


def test_recording_and_replay(gateway: Gateway, tmp_path: Path) -> None:
    add = kx.Tool.from_source("def add(a: int, b: int) -> int:\n    return a + b\n")
    with kx.KernelExecutor(backend=backend(gateway), record_dir=tmp_path, default_timeout=30) as ex:
        s = ex.session("rec")
        s.run_code("base = 40\nprint('base set')")
        assert s.call_tool(add, {"a": 1, "b": 1}).func_return == 2
        s.run_code("base + 2")
        path = s.record_path
    assert path is not None and path.exists()
    report = kx.replay(path, backend=backend(gateway))
    assert report.cells_run >= 4
    assert report.ok, report.differences


def test_two_executors_share_one_gateway(gateway: Gateway) -> None:
    with (
        kx.KernelExecutor(backend=backend(gateway), default_timeout=30) as one,
        kx.KernelExecutor(backend=backend(gateway), workdir="second", default_timeout=30) as two,
    ):
        one.run_code("who = 'one'")
        two.run_code("who = 'two'")
        cwd = "import os; os.getcwd()"
        assert one.run_code(cwd).result == repr(str(gateway.work / "kernelexec" / "default"))
        assert two.run_code(cwd).result == repr(str(gateway.work / "second" / "default"))
        pids = {ex.run_code("import os; os.getpid()").result for ex in (one, two)}
        assert one.run_code("who").result == "'one'"
        assert two.run_code("who").result == "'two'"
        assert len(pids) == 2
        assert len(gateway.kernels()) == 2


def test_backend_by_name_and_its_checks(gateway: Gateway) -> None:
    options = {"url": gateway.url, "token": gateway.token}
    with kx.KernelExecutor(backend="gateway", backend_options=options) as ex:
        assert ex.run_code("1 + 1").result == "2"
        assert len(gateway.kernels()) == 1
    with pytest.raises(kx.ConfigError, match="cannot run a VenvEnv"):
        kx.KernelExecutor(backend=backend(gateway), env=kx.VenvEnv(requirements=("six",)))
    with pytest.raises(kx.ConfigError, match="token"):
        get_backend("gateway", url=f"{gateway.url}/?token={gateway.token}")
    with pytest.raises(kx.ConfigError, match="http"):
        GatewayBackend("ftp://127.0.0.1:1")
    assert gateway.token not in repr(backend(gateway))


def test_a_token_over_plain_http_to_another_host_warns(caplog: pytest.LogCaptureFixture) -> None:
    GatewayBackend("http://gateway.invalid:8888", token="s3cret-token")
    GatewayBackend("https://gateway.invalid:8888", token="s3cret-token")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "clear text" in warnings[0]
    assert "s3cret-token" not in warnings[0]


@pytest.mark.anyio
async def test_pool_prewarms_and_culls_on_the_gateway(gateway: Gateway) -> None:
    async with kx.AsyncKernelExecutor(
        backend=backend(gateway), prewarm=1, idle_timeout=2, default_timeout=30
    ) as ex:
        await ex.warm_up()
        assert len(gateway.kernels()) == 1  # warm before any session asked
        s = await ex.session("pooled")
        await s.run_code("x = 1")
        assert s.has_kernel
        deadline = time.monotonic() + 30
        while s.has_kernel and time.monotonic() < deadline:  # noqa: ASYNC110 (no event to await)
            await asyncio.sleep(0.05)  # waiting for the culling task's effect, not a duration
        assert not s.has_kernel
        r = await s.run_code("2")
        assert r.kernel_restarted and r.lost_variables == ["x"]


# -- faults ---------------------------------------------------------------------------------


def test_wrong_or_missing_token_is_refused_without_showing_it(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "not-the-token-" + gateway.token[:8]
    with (
        kx.KernelExecutor(backend=GatewayBackend(gateway.url, token=wrong)) as ex,
        pytest.raises(kx.ConfigError, match="refused the token") as info,
    ):
        ex.run_code("1")
    assert wrong not in str(info.value) and gateway.url in str(info.value)
    with (
        kx.KernelExecutor(backend=GatewayBackend(gateway.url)) as ex,
        pytest.raises(kx.ConfigError, match="requires a token"),
    ):
        ex.run_code("1")
    with kx.KernelExecutor(backend=backend(gateway)) as ex:  # websockets logs its handshake
        assert ex.run_code("1").ok
    assert any("Authorization" in r.getMessage() for r in caplog.records)
    assert all(
        wrong not in r.getMessage() and gateway.token not in r.getMessage() for r in caplog.records
    )


def test_unknown_kernelspec_is_a_short_clear_error(gateway: Gateway) -> None:
    with (
        kx.KernelExecutor(backend=backend(gateway, kernel_name="no-such-spec")) as ex,
        pytest.raises(kx.KernelStartError, match="could not start kernel 'no-such-spec'") as info,
    ):
        ex.run_code("1")
    assert "Traceback" not in str(info.value) and len(str(info.value)) < 600


def test_kernelspecs_are_part_of_the_fingerprint(gateway: Gateway) -> None:
    one = kx.KernelExecutor(backend=backend(gateway))
    other = kx.KernelExecutor(backend=backend(gateway, kernel_name="py-other"))
    assert one.fingerprint != other.fingerprint
    one.close()
    other.close()


def test_a_message_over_max_message_bytes_is_a_clear_death(gateway: Gateway) -> None:
    with kx.KernelExecutor(
        backend=backend(gateway, max_message_bytes=50_000),
        default_timeout=30,
        start_timeout=REPLACING,
    ) as ex:
        assert ex.run_code("x = 1; print('small')").ok
        r = ex.run_code("print('z' * 100_000)")
        assert r.error is not None and r.error.kind == "kernel_died"
        assert "larger than max_message_bytes=50000" in r.error.evalue
        # The evalue says what stopped the fresh kernel, the gateway's log why (seen once in
        # about forty runs of two suites at once, with neither kept).
        why = f"{r.error.evalue}\n--- the gateway's log:\n{gateway.log[-4000:]}"
        assert r.kernel_restarted and r.lost_variables == ["x"], why
        assert ex.run_code("1 + 1").result == "2"


@pytest.mark.anyio
async def test_a_fresh_kernel_does_not_carry_the_last_ones_disconnection(gateway: Gateway) -> None:
    async with kx.AsyncKernelExecutor(
        backend=backend(gateway, max_message_bytes=50_000),
        default_timeout=30,
        start_timeout=REPLACING,
    ) as ex:
        s = await ex.session()
        r = await s.run_code("print('z' * 100_000)")
        assert r.error is not None and r.error.kind == "kernel_died" and r.kernel_restarted
        conn = s.lease.connection
        assert conn is not None
        # What a failure of the fresh kernel would end with: nothing of the 1009 close.
        assert conn.diagnostics() == ""
        assert (await s.run_code("1 + 1")).result == "2"


def test_unreachable_gateway_names_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with (
        kx.KernelExecutor(backend=GatewayBackend(url, token="t")) as ex,
        pytest.raises(kx.KernelStartError, match="unreachable") as info,
    ):
        ex.run_code("1")
    assert url in str(info.value)


@pytest.mark.slow
def test_kernel_deleted_behind_our_back(gateway: Gateway) -> None:
    with kx.KernelExecutor(
        backend=backend(gateway), default_timeout=30, start_timeout=REPLACING
    ) as ex:
        s = ex.session()
        s.run_code("x = 1")
        (kernel,) = gateway.kernels()
        gateway.delete_kernel(kernel["id"])
        r = s.run_code("x")
        # The code had not reached the deleted kernel: it ran on a fresh one, which says so.
        assert r.kernel_restarted and r.lost_variables == ["x"]
        assert r.error is not None and r.error.ename == "NameError"
        assert s.run_code("2 + 2").result == "4"


def test_websocket_dropped_mid_call_reconnects_and_finishes(gateway: Gateway) -> None:
    proxy = TcpProxy(gateway.port)
    try:
        with kx.KernelExecutor(
            backend=GatewayBackend(proxy.url, token=gateway.token), default_timeout=30
        ) as ex:
            s = ex.session()
            s.run_code("x = 7")
            r = s.run_code(
                "import time\nprint('before', flush=True)\ntime.sleep(1)\nprint('after')\nx * 6",
                on_stdout=lambda text: proxy.cut() if "before" in text else None,
            )
            assert r.ok, r.error
            assert r.stdout == "before\nafter\n"
            assert r.result == "42" and not r.kernel_restarted
            assert proxy.accepted >= 2  # it really reconnected
    finally:
        proxy.close()


def test_a_broken_websocket_handshake_is_kernelexecs_own_error(gateway: Gateway) -> None:
    # The proxy closes every websocket upgrade unanswered: the websockets library raises its
    # own InvalidMessage, which must never reach the caller.
    proxy = TcpProxy(gateway.port)
    proxy.drop_websockets = True
    try:
        with kx.KernelExecutor(
            backend=GatewayBackend(proxy.url, token=gateway.token), default_timeout=30
        ) as ex:
            with pytest.raises(kx.KernelStartError) as info:
                ex.run_code("1")
            assert type(info.value).__module__.startswith("kernelexec")
            assert proxy.url in str(info.value)
    finally:
        proxy.close()


def test_a_websocket_that_cannot_reconnect_mid_call_is_a_kernel_death(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = TcpProxy(gateway.port)
    try:
        be = GatewayBackend(proxy.url, token=gateway.token, reconnect_timeout=1)
        with kx.KernelExecutor(backend=be, default_timeout=30) as ex:
            s = ex.session()
            s.run_code("x = 7")

            def cut(text: str) -> None:
                if "before" in text:
                    proxy.drop_websockets = True
                    proxy.cut()

            r = s.run_code(
                "import time\nprint('before', flush=True)\ntime.sleep(60)", on_stdout=cut
            )
            assert r.error is not None and r.error.kind == "kernel_died", r.error
            assert "could not reconnect" in r.error.evalue
            assert "no fresh kernel could be started" in r.error.evalue
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any("agent 'default': no fresh kernel could be started: " in m for m in said)
            proxy.drop_websockets = False
            back = s.run_code("'x' in globals()")
            assert back.result == "False"
            assert back.kernel_restarted and back.lost_variables == ["x"]
    finally:
        proxy.close()


@pytest.mark.slow
def test_gateway_stopped_mid_session_and_back() -> None:
    with Gateway() as gw:
        be = GatewayBackend(gw.url, token=gw.token, reconnect_timeout=1)
        with kx.KernelExecutor(backend=be, default_timeout=30) as ex:
            s = ex.session()
            s.run_code("x = 1")
            gw.stop()
            with pytest.raises(kx.KernelStartError, match="unreachable") as info:
                s.run_code("x")
            assert gw.url in str(info.value)
            gw.start()
            r = s.run_code("'x' in globals()")
            assert r.result == "False"
            assert r.kernel_restarted and r.lost_variables == ["x"]
            assert gw.kernels() != []
        assert gw.kernels() == []


@pytest.mark.slow
def test_gateway_killed_mid_call_gives_a_result_and_the_next_call_says_what_was_lost(
    tmp_path: Path,
) -> None:
    with Gateway() as gw:
        be = GatewayBackend(gw.url, token=gw.token, reconnect_timeout=1)
        with kx.KernelExecutor(backend=be, default_timeout=30, record_dir=tmp_path) as ex:
            s = ex.session("a")
            assert s.run_code("x = 1").ok
            r = s.run_code(
                "import time\nprint('running', flush=True)\ntime.sleep(60)",
                on_stdout=lambda text: gw.kill() if "running" in text else None,
            )
            assert r.error is not None and r.error.kind == "kernel_died", r.error
            assert gw.url in r.error.evalue and "(x)" in r.error.evalue
            assert r.stdout == "running\n"
            assert not r.kernel_restarted  # no kernel could be started yet
            # While the gateway is down, a call cannot start a kernel: it says so, and the
            # lost state is still owed to the call that gets one.
            with pytest.raises(kx.KernelStartError, match="unreachable"):
                s.run_code("x")
            gw.start()
            back = s.run_code("'x' in globals()")
            assert back.result == "False"
            assert back.kernel_restarted and back.lost_variables == ["x"]
            path = s.record_path
        assert path is not None
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        sources = [c.source for c in cells]
        assert sources[:2] == ["x = 1", "import time\nprint('running', flush=True)\ntime.sleep(60)"]
        assert any("kernel_died" in json.dumps(c.metadata) for c in cells)
        assert gw.kernels() == []


@pytest.fixture(scope="module")
def strict_gateway() -> Iterator[Gateway]:
    """A gateway with Kernel Gateway's output rate limit on and room for one kernel."""
    with Gateway(rate_limit=10_000, max_kernels=1) as gw:
        yield gw


def test_output_dropped_by_the_gateway_is_reported_truncated(strict_gateway: Gateway) -> None:
    gw = strict_gateway
    with kx.KernelExecutor(
        backend=backend(gw), max_output_chars=1_000_000, default_timeout=30
    ) as ex:
        r = ex.run_code("print('y' * 200_000)\n'done'")
        assert r.ok and r.result == "'done'"
        assert "y" * 1000 not in r.stdout
        assert "[kernelexec: output truncated: the gateway dropped output" in r.stderr


def test_gateway_kernel_limit_is_pool_exhausted(strict_gateway: Gateway) -> None:
    gw = strict_gateway
    with (
        kx.KernelExecutor(backend=backend(gw), default_timeout=30) as one,
        kx.KernelExecutor(backend=backend(gw), default_timeout=30) as two,
    ):
        assert one.run_code("1").ok
        with pytest.raises(kx.PoolExhaustedError, match="Resource Limit"):
            two.run_code("1")
    assert gw.kernels() == []


# -- the wire format and the optional dependency ---------------------------------------------


@pytest.mark.parametrize("v1", [True, False])
def test_frames_round_trip_with_buffers(v1: bool) -> None:
    msg = new_message("s", "u", "comm_msg", {"data": {"k": "\u2028"}}, {"m": 1})
    msg["parent_header"] = {"msg_id": "p1"}
    buffers = (b"\x00\x01binary", b"")
    decoded = decode(encode(msg, "iopub", buffers, v1), v1)
    assert decoded is not None
    msg_id, got = decoded
    assert msg_id == msg["header"]["msg_id"]
    assert (got.channel, got.msg_type, got.parent_id) == ("iopub", "comm_msg", "p1")
    assert got.content == {"data": {"k": "\u2028"}}
    assert got.buffers == buffers
    plain = decode(encode(msg, "shell", (), v1), v1)
    assert plain is not None and plain[1].buffers == ()


@pytest.mark.parametrize("frame", [b"", b"\xff" * 40, "not json", "[]", '{"channel": "stdin"}'])
def test_garbage_frames_are_dropped(frame: str | bytes) -> None:
    assert decode(frame, True) is None
    assert decode(frame, False) is None


def test_importing_backends_does_not_import_websockets() -> None:
    code = "import sys, kernelexec.backends; print('websockets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.anyio
async def test_a_start_cancelled_mid_request_leaves_no_kernel_on_the_gateway(
    gateway: Gateway,
) -> None:
    # A relay holds the gateway's answer to POST /api/kernels: the kernel is up on the gateway
    # and the start request is still in flight for the client, for as long as the test needs.
    assert gateway.proc is not None
    server = psutil.Process(gateway.proc.pid)
    before = {p.pid for p in server.children(recursive=True)}
    proxy = TcpProxy(gateway.port)
    proxy.hold_kernel_starts = True
    try:
        be = GatewayBackend(proxy.url, token=gateway.token)
        async with kx.AsyncKernelExecutor(backend=be, default_timeout=30) as ex:
            call = asyncio.create_task(ex.run_code("1", agent_id="cancelled"))
            answered = await asyncio.to_thread(proxy.start_answered.wait, 60)
            assert answered, "the gateway did not answer the kernel start in 60 s"
            assert not call.done()  # the start request is in flight
            started = [p for p in server.children(recursive=True) if p.pid not in before]
            assert started
            call.cancel()
            proxy.release_kernel_starts()
            with pytest.raises(asyncio.CancelledError):
                await call
    finally:
        proxy.close()
    # The kernel the gateway started for the cancelled request is deleted, so it exits.
    _, alive = await asyncio.to_thread(psutil.wait_procs, started, 60)
    assert alive == [] and gateway.kernels() == []


def test_session_files_through_the_gateway(gateway: Gateway) -> None:
    """File data crosses the gateway's websocket as binary frames, with the kernel's rights,
    before any run (the kernel has not entered its working directory yet) and past
    ``max_result_chars``."""
    big = os.urandom(50 << 20)
    blob = bytes(range(256)) * 100
    with kx.KernelExecutor(backend=backend(gateway), max_result_chars=1_000) as ex:
        s = ex.session("files")
        assert s.files.write("in/data.csv", "a,b\n1,2\n").size == 8
        s.files.write("blob.bin", blob)
        assert s.files.read("blob.bin") == blob
        assert [f.path for f in s.files.list(recursive=True)] == ["blob.bin", "in", "in/data.csv"]
        here = gateway.work / "kernelexec" / "files"
        assert (here / "in" / "data.csv").read_text() == "a,b\n1,2\n"
        made = s.run_code("open('out.txt', 'w').write(open('in/data.csv').read().upper())")
        assert made.ok, made.error
        assert s.files.read("out.txt") == b"A,B\n1,2\n"
        assert s.files.write("big.bin", big).size == len(big)
        assert s.files.read("big.bin") == big
        s.files.remove("in", recursive=True)
        with pytest.raises(FileNotFoundError):
            s.files.read("in/data.csv")
        with pytest.raises(kx.PathRefusedError):
            s.files.read("../../escape")


def test_session_files_through_the_gateway_with_legacy_framing(gateway: Gateway) -> None:
    blob = os.urandom(5 << 20)
    with kx.KernelExecutor(backend=backend(gateway, offer_v1=False)) as ex:
        s = ex.session("files-legacy")
        s.files.write("blob.bin", blob)
        assert s.files.read("blob.bin") == blob
