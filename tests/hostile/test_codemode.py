"""Hostile kernel code against code mode: forged host calls (names never exposed, injected
parameters, repeated and malformed ids, stale parents), floods, and looking for host objects.

Kernel code holds the kernel's session key, so it can send any message the kernel half sends;
the host must decide on what arrives alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import kernelexec as kx

SECRET = "host-secret-5d1c9a"
ECHOED: list[Any] = []


def echo(value: Any) -> Any:
    """Return what it got."""
    ECHOED.append(value)
    return value


def whoami(tag: str, agent_id: str) -> str:
    """The calling agent."""
    return f"{tag}:{agent_id}"


FORGE = """
import json, sys, uuid
from IPython import get_ipython
cm = sys.modules['__kernelexec_codemode__']
k = get_ipython().kernel

def forge(module, name, args=None, call_id=None, raw=None, parent=None, wait=True):
    call_id = call_id or uuid.uuid4().hex
    waiter = cm._Waiter(None)
    if wait:
        cm._state.pending[call_id] = waiter
    content = {'id': call_id, 'module': module, 'name': name,
               'args': raw if raw is not None else json.dumps(args or {})}
    k.session.send(k.iopub_socket, cm.HOST_CALL, content, parent or cm._state.run)
    if wait:
        assert waiter.event.wait(30), 'no answer'
        return {key: waiter.reply.get(key) for key in ('ok', 'kind', 'message', 'value')}
"""


@pytest.fixture(scope="module")
def executor() -> Iterator[kx.KernelExecutor]:
    """This module's executor (a low call limit for the flood); checked for leaks as the
    shared one is."""
    with kx.KernelExecutor(default_timeout=30, max_host_calls=20) as ex:
        yield ex


def forged(ex: kx.KernelExecutor, agent: str, code: str) -> tuple[list[Any], kx.Execution]:
    s = ex.session(agent)
    s.expose(echo, whoami)
    out = s.run_code(FORGE + code)
    assert out.ok, (out.error, out.stdout)
    return [json.loads(line) for line in out.stdout.splitlines()], out


def test_names_never_exposed_are_refused(executor: kx.KernelExecutor) -> None:
    answers, out = forged(
        executor,
        "hostile-names",
        "import json\n"
        "for module, name in [('tools', 'os'), ('builtins', 'eval'), ('tools', '__init__'),\n"
        "                     ('tools', 'echo.__globals__'), ('kernelexec', 'Tool'), (None, 1)]:\n"
        "    print(json.dumps(forge(module, name, {'value': 1})))\n",
    )
    assert [a["kind"] for a in answers] == ["refused"] * 6
    assert answers[0]["message"] == "tools.os is not exposed"
    assert answers[1]["message"] == "builtins.eval is not exposed"
    assert [c.outcome for c in out.host_calls] == ["refused"] * 6
    assert ECHOED.count(1) == 0


def test_injected_parameters_cannot_be_forged(executor: kx.KernelExecutor) -> None:
    answers, _ = forged(
        executor,
        "hostile-inject",
        "import json\n"
        "print(json.dumps(forge('tools', 'whoami', {'tag': 't', 'agent_id': 'root'})))\n"
        "print(json.dumps(forge('tools', 'echo', {'value': 1, 'context': {}})))\n"
        "print(json.dumps(forge('tools', 'whoami', {'tag': 't'})))\n",
    )
    assert answers[0]["kind"] == "invalid_args"
    assert "unexpected argument 'agent_id'" in answers[0]["message"]
    assert "unexpected argument 'context'" in answers[1]["message"]
    assert answers[2] == {"ok": True, "kind": None, "message": None, "value": '"t:hostile-inject"'}


def test_malformed_and_repeated_ids(executor: kx.KernelExecutor) -> None:
    ECHOED.clear()
    _, out = forged(
        executor,
        "hostile-ids",
        "import json\n"
        "print(json.dumps(forge('tools', 'echo', {'value': 'first'}, call_id='fixed')))\n"
        "forge('tools', 'echo', {'value': 'again'}, call_id='fixed', wait=False)\n"
        "forge('tools', 'echo', {'value': 'int id'}, call_id=5, wait=False)\n"
        "forge('tools', 'echo', {'value': 'long id'}, call_id='x' * 1000, wait=False)\n"
        "print(json.dumps(forge('tools', 'echo', raw='{not json')))\n"
        "print(json.dumps(forge('tools', 'echo', raw='[1, 2]')))\n"
        "from tools import echo\n"
        "print(json.dumps(echo('after')))\n",
    )
    # The repeat and the bad ids were dropped before the next message was read.
    assert ECHOED == ["first", "after"]
    assert [(c.outcome, c.arguments) for c in out.host_calls] == [
        ("ok", {"value": "first"}),
        ("invalid_args", None),
        ("invalid_args", [1, 2]),
        ("ok", {"value": "after"}),
    ]


def test_stale_or_foreign_parents_are_not_served(executor: kx.KernelExecutor) -> None:
    ECHOED.clear()
    s = executor.session("hostile-parents")
    s.expose(echo)
    first = s.run_code(FORGE + "previous = cm._state.run\n")
    assert first.ok, first.error
    out = s.run_code(
        "forge('tools', 'echo', {'value': 'stale'}, parent=previous, wait=False)\n"
        "forge('tools', 'echo', {'value': 'bogus'}, parent={'header': {'msg_id': 'x'}},"
        " wait=False)\n"
        "from tools import echo\nprint(echo('now'))\n"
    )
    assert out.ok, out.error
    assert ECHOED == ["now"]
    assert [c.arguments for c in out.host_calls] == [{"value": "now"}]


def test_a_flood_is_bounded_and_the_session_recovers(executor: kx.KernelExecutor) -> None:
    ECHOED.clear()
    s = executor.session("hostile-flood")
    s.expose(echo)
    # Forged past the kernel half's bound on calls in flight: ZeroMQ may drop some of them
    # (iopub's high-water mark), so counts are bounds, not exact.
    out = s.run_code(
        FORGE + "for i in range(3000):\n    forge('tools', 'echo', {'value': i}, wait=False)\n"
    )
    assert out.ok, out.error
    # The limit ran, at most as many again were refused and kept, the rest refused unkept.
    assert len(out.host_calls) <= 40
    assert sum(c.outcome == "ok" for c in out.host_calls) <= 20
    assert len(ECHOED) <= 20
    assert all(c.outcome in ("ok", "refused", "cancelled") for c in out.host_calls)
    again = s.run_code("from tools import echo\nprint(echo('fresh run'))")
    assert again.ok and again.stdout == "fresh run\n"


def test_many_calls_at_once_all_answered(executor: kx.KernelExecutor) -> None:
    """Beyond the in-flight bound, calls wait in the kernel; none is lost on iopub."""

    async def aecho(value: int) -> int:
        """Echo, async."""
        return value

    with kx.KernelExecutor(default_timeout=60, max_host_calls=5000) as ex:
        s = ex.session("hostile-burst")
        s.expose(aecho)
        out = s.run_code(
            "import asyncio\nfrom tools import aecho\n"
            "values = await asyncio.gather(*(aecho(i) for i in range(3000)))\n"
            "print(values == list(range(3000)))\n"
        )
    assert out.ok, out.error
    assert out.stdout == "True\n"
    assert len(out.host_calls) == 3000


def test_kernel_code_cannot_find_host_objects(executor: kx.KernelExecutor) -> None:
    s = executor.session("hostile-reach")
    s.expose(echo, whoami)
    out = s.run_code(
        "import gc, sys, tools\n"
        f"secret = {SECRET[:8]!r} + {SECRET[8:]!r}\n"
        "found = []\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, dict):\n"
        "        found += [k for k, v in o.items() if isinstance(v, str) and v == secret"
        " and k != 'secret']\n"
        "print(found)\n"
        "print([m for m in sys.modules if m.startswith(('kernelexec', 'tests'))])\n"
        "print(tools.whoami.__wrapped__ if hasattr(tools.whoami, '__wrapped__') else 'none')\n"
    )
    assert out.ok, out.error
    assert out.stdout.splitlines() == ["[]", "[]", "none"]
