"""Hostile kernel code against the host's resources in code mode: arguments and answers too big
to hold, more calls in flight than a session may have, and a tenant whose slow host functions
would hold the threads every kernel start needs.

Kernel code holds the kernel's session key, so it can forge any host call the kernel half
sends; the bounds must hold on the host, whatever arrives.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from typing import Any

import kernelexec as kx
from kernelexec._codemode._calls import HOST_THREADS

FORGE = """
import json, sys, uuid
from IPython import get_ipython
cm = sys.modules['__kernelexec_codemode__']
k = get_ipython().kernel

def send(module, name, raw):
    call_id = uuid.uuid4().hex
    waiter = cm._Waiter(None)
    cm._state.pending[call_id] = waiter
    content = {'id': call_id, 'module': module, 'name': name, 'args': raw}
    k.session.send(k.iopub_socket, cm.HOST_CALL, content, cm._state.run)
    return waiter

def answer(waiter, wait=30):
    assert waiter.event.wait(wait), 'no answer'
    return {key: waiter.reply.get(key) for key in ('ok', 'kind', 'message')}
"""

RECEIVED: list[int] = []


def echo(value: str) -> int:
    """Take a text; return its length."""
    RECEIVED.append(len(value))
    return len(value)


def big(size: int) -> str:
    """A text of ``size`` characters."""
    return "y" * size


def test_oversized_arguments_and_answers_are_refused_unread() -> None:
    """Forged 10 MiB arguments (the red team's 60 of them raised the host's memory by 1.2 GiB)
    are refused before they are parsed; the function never runs; an answer past the bound is
    not sent; honest code is stopped in the kernel before it sends."""
    RECEIVED.clear()
    with kx.KernelExecutor(default_timeout=120) as ex:
        s = ex.session("hostile-bytes")
        s.expose(echo, big)
        out = s.run_code(
            FORGE + "huge = json.dumps({'value': 'x' * (10 << 20)})\n"
            "for _ in range(3):\n"
            "    print(json.dumps(answer(send('tools', 'echo', huge))))\n"
            "from tools import echo, big, HostCallLimitExceeded\n"
            "try:\n"
            "    echo('z' * (2 << 20))\n"
            "except HostCallLimitExceeded as exc:\n"
            "    print(json.dumps({'kernel': str(exc)}))\n"
            "try:\n"
            "    big(2 << 20)\n"
            "except HostCallLimitExceeded as exc:\n"
            "    print(json.dumps({'answer': str(exc)}))\n"
            "print(json.dumps({'after': echo('fine')}))\n"
        )
        assert out.ok, (out.error, out.stdout[-2000:])
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        again = s.run_code("from tools import echo\nprint(echo('again'))")
    forged = [line for line in lines if "kind" in line]
    seen = {key: line[key] for line in lines for key in line if key in ("kernel", "answer")}
    assert [a["kind"] for a in forged] == ["limit"] * 3, forged
    assert "max_host_call_bytes" in forged[0]["message"]
    assert "a host call takes at most 1048576" in forged[0]["message"]
    assert "max_host_call_bytes" in seen.get("kernel", ""), lines
    assert "max_host_call_bytes" in seen.get("answer", ""), lines
    assert lines[-1] == {"after": 4}
    assert RECEIVED == [4, 5]  # the forged and the honest oversized calls never ran
    refused = [c for c in out.host_calls if c.name == "echo" and c.outcome == "refused"]
    assert len(refused) == 3 and all(c.arguments is None for c in refused)
    assert again.ok and again.stdout == "5\n"


def test_calls_in_flight_past_the_session_bound_are_refused() -> None:
    """100 forged calls of a function that blocks: the first 64 (the default bound) are taken,
    the rest refused at once naming the bound, not queued on the host holding their
    arguments; once the blocked ones answer, the session works as before."""
    release = threading.Event()
    started: list[int] = []

    def hold(i: int) -> int:
        """Block until the test lets go."""
        started.append(i)
        release.wait(60)
        return i

    def on_stdout(text: str) -> None:
        if "refusals seen" in text:
            release.set()

    try:
        with kx.KernelExecutor(default_timeout=120) as ex:
            s = ex.session("hostile-inflight")
            s.expose(hold)
            out = s.run_code(
                FORGE + "waiters = [send('tools', 'hold', json.dumps({'i': i}))"
                " for i in range(100)]\n"
                "late = [answer(w, 20) for w in waiters[64:]]\n"
                "print('refusals seen', flush=True)\n"
                "early = [answer(w, 60) for w in waiters[:64]]\n"
                "print(json.dumps(early + late))\n",
                on_stdout=on_stdout,
            )
            assert out.ok, (out.error, out.stdout[-2000:])
            again = s.run_code("from tools import hold\nprint(hold(7))")
    finally:
        release.set()
    answers = json.loads(out.stdout.splitlines()[-1])
    assert all(a["ok"] for a in answers[:64])
    assert [a["kind"] for a in answers[64:]] == ["limit"] * 36
    assert "max_host_calls_in_flight" in answers[64]["message"]
    assert sorted(started[:64]) == list(range(64))
    assert again.ok and again.stdout == "7\n"


def test_a_tenants_blocked_host_functions_do_not_stall_other_kernel_starts() -> None:
    """One session's plain host functions block with 40 calls in flight (more than the event
    loop's default pool has threads). Another agent's first call (a kernel start, which
    uses that pool) still completes: host functions run on their session's own threads."""
    release = threading.Event()
    running = threading.Event()
    lock = threading.Lock()
    count = [0]
    default_pool = min(32, (os.cpu_count() or 1) + 4)
    enough = min(HOST_THREADS, default_pool)  # on the old code: every default thread held

    def block() -> str:
        """Block until the test lets go."""
        with lock:
            count[0] += 1
            if count[0] >= enough:
                running.set()
        release.wait(120)
        return "done"

    results: dict[str, Any] = {}
    with (
        kx.KernelExecutor(default_timeout=180, prewarm=0) as ex,
        concurrent.futures.ThreadPoolExecutor(2) as callers,
    ):
        tenant = ex.session("hostile-slow-host")
        tenant.expose(block)
        tenant.run_code("1")  # its kernel is up before the calls start
        blocked = callers.submit(
            tenant.run_code,
            "import threading\nfrom tools import block\nout = []\n"
            "ts = [threading.Thread(target=lambda: out.append(block())) for _ in range(40)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(len(out))\n",
        )
        try:
            assert running.wait(60), "the tenant's host calls never started"
            other = callers.submit(ex.session("bystander").run_code, "print(6 * 7)")
            try:
                results["bystander"] = other.result(timeout=60)
            except concurrent.futures.TimeoutError:
                results["bystander"] = "still waiting after 60 s"
        finally:
            release.set()
        results["tenant"] = blocked.result(timeout=120)
        if isinstance(results["bystander"], str):
            other.result(timeout=120)  # let it end before the executor closes
    bystander = results["bystander"]
    assert not isinstance(bystander, str), bystander
    assert bystander.ok and bystander.stdout == "42\n", bystander
    assert results["tenant"].ok and results["tenant"].stdout == "40\n"
