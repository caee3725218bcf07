"""Code mode on real kernels: host functions exposed to kernel code (``session.expose`` and
``host_functions=``), called over the kernel's own connection."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path
from typing import Any

import pytest

import kernelexec as kx
from kernelexec._codemode._calls import HOST_CALL_MIME

CAPTURED: list[Any] = []


def search(query: str, limit: int = 3) -> list[dict[str, Any]]:
    """Search the corpus for ``query``.

    Args:
        query: What to look for.
        limit: How many hits to return.
    """
    return [{"query": query, "rank": i} for i in range(limit)]


async def afetch(url: str, *, retries: int = 0) -> dict[str, Any]:
    """Fetch a page (async on the host)."""
    return {"url": url, "retries": retries}


def echo(value: Any) -> Any:
    """Return what it got."""
    CAPTURED.append(value)
    return value


def whoami(tag: str, agent_id: str, context: kx.HostCallContext) -> dict[str, str]:
    """Who is calling."""
    return {"tag": tag, "agent": agent_id, "ctx_agent": context.agent_id, "fn": context.function}


def fail(message: str) -> None:
    """Raise on the host."""
    secret = "HOST-ONLY-LOCAL-7731"  # noqa: F841 - a local a traceback would show
    raise ValueError(message)


def opaque() -> Any:
    """Return something that is not JSON."""
    return object()


@pytest.fixture(scope="module")
def session(executor: kx.KernelExecutor) -> kx.Session:
    s = executor.session("codemode-main")
    s.expose(search, afetch, echo, whoami, fail, opaque)
    return s


def run(s: kx.Session, code: str, **kw: Any) -> kx.Execution:
    result = s.run_code(code, **kw)
    assert result.ok, (result.error, result.stdout, result.stderr)
    return result


def test_signature_and_docstring(session: kx.Session) -> None:
    out = run(
        session,
        "import inspect\n"
        "from tools import search, afetch, whoami\n"
        "print(inspect.signature(search))\n"
        "print(inspect.signature(afetch))\n"
        "print(inspect.signature(whoami))\n"
        "print(inspect.iscoroutinefunction(afetch), inspect.iscoroutinefunction(search))\n"
        "help(search)\n",
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "(query: str, limit: int = 3) -> list[dict[str, Any]]"
    assert lines[1] == "(url: str, *, retries: int = 0) -> dict[str, Any]"
    assert lines[2] == "(tag: str) -> dict[str, str]"  # agent_id/context are filled in
    assert lines[3] == "True False"
    assert "Search the corpus for ``query``." in out.stdout
    assert "limit: How many hits to return." in out.stdout


def test_calls_sync_and_async_with_identity(session: kx.Session) -> None:
    out = run(
        session,
        "from tools import search, afetch, whoami\n"
        "print(search('kernels', limit=2))\n"
        "print(await afetch('http://x', retries=1))\n"
        "print(whoami('t'))\n",
    )
    assert out.stdout.splitlines() == [
        "[{'query': 'kernels', 'rank': 0}, {'query': 'kernels', 'rank': 1}]",
        "{'url': 'http://x', 'retries': 1}",
        "{'tag': 't', 'agent': 'codemode-main', 'ctx_agent': 'codemode-main', 'fn': 'whoami'}",
    ]
    assert [(c.name, c.outcome) for c in out.host_calls] == [
        ("search", "ok"),
        ("afetch", "ok"),
        ("whoami", "ok"),
    ]
    assert out.host_calls[0].arguments == {"query": "kernels", "limit": 2}


def test_json_values_round_trip_exactly(session: kx.Session) -> None:
    CAPTURED.clear()
    out = run(
        session,
        "from tools import echo\n"
        "nested = [1]\n"
        "for _ in range(60):\n"
        "    nested = {'d': nested}\n"
        "values = [10**5000 + 7, -(2**200), 0.1, 1e308, 'ünï \\u2603 \\x00', True, None,\n"
        "          {'a': [1, {'b': [None, 2.5, 'x']}]}, [], {}, nested]\n"
        "for v in values:\n"
        "    back = echo(v)\n"
        "    assert back == v and type(back) is type(v), (v, back)\n"
        "print(echo((1, 2)), len(str(echo(10**5000 + 7))))\n",
    )
    assert out.stdout.strip() == "[1, 2] 5001"
    assert CAPTURED[0] == 10**5000 + 7  # the host got the exact integer
    assert CAPTURED[1] == -(2**200)
    assert CAPTURED[4] == "ünï \u2603 \x00"
    assert CAPTURED[7] == {"a": [1, {"b": [None, 2.5, "x"]}]}


def test_arguments_checked_in_kernel_and_on_host(session: kx.Session) -> None:
    out = run(
        session,
        "from tools import search, echo, HostCallInvalidArguments\n"
        "for call in (lambda: search(5), lambda: search(), lambda: search('q', bogus=1),\n"
        "             lambda: echo({1, 2}), lambda: echo(float('nan')), lambda: echo({1: 'a'})):\n"
        "    try:\n"
        "        call()\n"
        "    except HostCallInvalidArguments as e:\n"
        "        print(isinstance(e, TypeError), e)\n",
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 6, out.stdout
    assert all(line.startswith("True ") for line in lines)
    assert "search(): argument 'query': Input should be a valid string" in lines[0]
    assert "missing a required argument: 'query'" in lines[1]
    assert "unexpected keyword argument 'bogus'" in lines[2]
    assert "a set is not a JSON value" in lines[3]
    assert "nan is not a JSON number" in lines[4]
    assert "object key 1 is not a string" in lines[5]
    # Only the schema check reached the host; the rest never left the kernel.
    assert [(c.name, c.outcome) for c in out.host_calls] == [("search", "invalid_args")]


def test_host_exception_arrives_typed_with_its_message_only(session: kx.Session) -> None:
    out = run(
        session,
        "from tools import fail, opaque, HostFunctionError, HostCallError\n"
        "import traceback\n"
        "try:\n"
        "    fail('the index is down')\n"
        "except HostFunctionError as e:\n"
        "    print(type(e).__name__, e.host_type, str(e), isinstance(e, HostCallError))\n"
        "    print('TB', ''.join(traceback.format_exception(e)))\n"
        "try:\n"
        "    opaque()\n"
        "except HostFunctionError as e:\n"
        "    print('OPAQUE', e.host_type, e)\n",
    )
    first = out.stdout.splitlines()[0]
    assert first == "HostFunctionError ValueError the index is down True"
    assert "HOST-ONLY-LOCAL-7731" not in out.stdout
    assert __file__ not in out.stdout and "test_codemode.py" not in out.stdout
    assert "OPAQUE NotJSON opaque() returned a object, which is not a JSON value" in out.stdout
    assert out.host_calls[0].outcome == "error"
    assert out.host_calls[0].error == "ValueError: the index is down"


def test_only_exposed_names_exist_in_the_module(session: kx.Session) -> None:
    out = run(
        session,
        "import tools\n"
        "print(sorted(n for n in vars(tools) if not n.startswith('__')))\n"
        "cells = tools.search.__closure__ or ()\n"
        "print(sorted({getattr(c.cell_contents, '__module__', type(c.cell_contents).__module__)\n"
        "              for c in cells}))\n",
    )
    names = out.stdout.splitlines()[0]
    assert names == (
        "['HostCallCancelled', 'HostCallError', 'HostCallInvalidArguments', "
        "'HostCallLimitExceeded', 'HostCallRefused', 'HostCallTimeout', 'HostFunctionError', "
        "'afetch', 'echo', 'fail', 'opaque', 'search', 'whoami']"
    )
    # The stub closes over its signature and the kernel half's own helpers, nothing of the host.
    assert out.stdout.splitlines()[1] == "['__kernelexec_codemode__', 'builtins']"


def test_concurrent_calls_from_gather_run_together_on_the_host(executor: kx.KernelExecutor) -> None:
    barrier = asyncio.Barrier(4)

    async def rendezvous(i: int) -> int:
        """Returns only once four calls are in flight at the same time."""
        async with barrier:
            return i * 10

    s = executor.session("codemode-gather")
    s.expose(rendezvous, timeout=20)  # a serial host would deadlock, then time out
    out = run(
        s,
        "import asyncio\nfrom tools import rendezvous\n"
        "print(await asyncio.gather(*(rendezvous(i) for i in range(4))))\n",
    )
    assert out.stdout.strip() == "[0, 10, 20, 30]"
    assert [c.outcome for c in out.host_calls] == ["ok"] * 4


def test_sync_host_functions_run_in_threads_concurrently(executor: kx.KernelExecutor) -> None:
    barrier = threading.Barrier(3, timeout=20)

    def meet(i: int) -> int:
        """Blocks until three calls are in flight (on three host threads)."""
        barrier.wait()
        return i

    s = executor.session("codemode-threads")
    s.expose(meet)
    out = run(
        s,
        "import asyncio\nfrom tools import meet\n"
        "print(await asyncio.gather(*(asyncio.to_thread(meet, i) for i in range(3))))\n",
    )
    assert out.stdout.strip() == "[0, 1, 2]"


def test_host_function_timeout(executor: kx.KernelExecutor) -> None:
    cancelled = threading.Event()

    async def stall() -> None:
        """Never answers."""
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    def upstream() -> None:
        """Times out on its own (no timeout configured)."""
        raise TimeoutError("the upstream service timed out")

    s = executor.session("codemode-own-timeout")
    s.expose(stall, timeout=0.3)
    s.expose(upstream)
    out = run(
        s,
        "from tools import stall, upstream, HostCallTimeout\n"
        "for call in (stall, upstream):\n"
        "    try:\n"
        "        await call() if call is stall else call()\n"
        "    except HostCallTimeout as e:\n"
        "        print(isinstance(e, TimeoutError), e)\n",
    )
    assert out.stdout.splitlines() == [
        "True stall() took longer than its timeout of 0.3 s",
        "True the upstream service timed out",
    ]
    assert cancelled.is_set()
    assert [c.outcome for c in out.host_calls] == ["timeout", "timeout"]


@pytest.mark.parametrize("awaited", [True, False])
def test_run_timeout_holds_and_cancels_the_host_call(
    executor: kx.KernelExecutor, awaited: bool
) -> None:
    cancelled, release = threading.Event(), threading.Event()

    async def hang() -> None:
        """Never answers."""
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    def block() -> None:
        """Blocks its host thread until released."""
        release.wait(30)

    s = executor.session(f"codemode-run-timeout-{awaited}")
    s.expose(hang, block)
    try:
        code = "await hang()" if awaited else "block()"
        out = s.run_code(f"from tools import hang, block\n{code}\n", timeout=1)
    finally:
        release.set()
    assert out.error is not None and out.error.kind == "timeout", out.error
    assert [c.outcome for c in out.host_calls] == ["cancelled"]
    if awaited:
        assert cancelled.is_set()  # the host coroutine itself was cancelled
    assert run(s, "print('alive')").stdout == "alive\n"  # the kernel kept its state


def test_interrupt_cancels_the_host_call(executor: kx.KernelExecutor) -> None:
    started, release, cancelled = threading.Event(), threading.Event(), threading.Event()

    async def wait_async() -> None:
        """Waits until cancelled."""
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    def wait_sync() -> str:
        """Blocks its host thread until released."""
        started.set()
        release.wait(30)
        return "late"

    s = executor.session("codemode-interrupt")
    s.expose(wait_async, wait_sync)
    try:
        for code in ("await wait_async()", "wait_sync()"):
            started.clear()
            interrupter = threading.Thread(target=lambda: (started.wait(30), s.interrupt()))
            interrupter.start()
            out = s.run_code(f"from tools import wait_async, wait_sync\n{code}\n", timeout=30)
            interrupter.join()
            assert out.error is not None, out.stdout
            assert out.error.ename in ("KeyboardInterrupt", "CancelledError", "HostCallCancelled")
            assert [c.outcome for c in out.host_calls] == ["cancelled"], code
        assert cancelled.is_set()  # the async host function itself was cancelled
    finally:
        release.set()
    assert run(s, "print(1)").stdout == "1\n"


def test_calls_after_the_run_are_refused(executor: kx.KernelExecutor) -> None:
    entered, release = threading.Event(), threading.Event()

    def block() -> str:
        """Blocks its host thread until released."""
        entered.set()
        release.wait(30)
        return "late"

    def block_entered() -> bool:
        """Waits until ``block`` runs on the host."""
        return entered.wait(30)

    s = executor.session("codemode-after-run")
    s.expose(search, block, block_entered)
    try:
        run(
            s,
            "import threading\nfrom tools import search, block, block_entered\nresults = {}\n"
            "def attempt(key, fn, *args):\n"
            "    try:\n"
            "        results[key] = fn(*args)\n"
            "    except Exception as e:\n"
            "        results[key] = f'{type(e).__name__}: {e}'\n"
            "def after():\n"  # runs once this run has ended (registered after code mode's hook)
            "    get_ipython().events.unregister('post_execute', after)\n"
            "    attempt('after', search, 'x')\n"
            "get_ipython().events.register('post_execute', after)\n"
            "pending = threading.Thread(target=attempt, args=('pending', block))\n"
            "pending.start()\n"
            "assert block_entered()\n",  # the run ends while the host runs block()
        )
        out = run(s, "pending.join(); print(results['after']); print(results['pending'])")
    finally:
        release.set()
    after, pending = out.stdout.splitlines()
    assert after.startswith("HostCallRefused: tools.search(): no run in progress")
    assert pending == "HostCallRefused: the run ended before the host answered"
    assert out.host_calls == []  # nothing of the earlier run reached this one


def test_per_run_call_limit() -> None:
    with kx.KernelExecutor(max_host_calls=5, default_timeout=30) as ex:
        s = ex.session("codemode-limit")
        s.expose(search)
        code = (
            "from tools import search, HostCallLimitExceeded\n"
            "n = 0\n"
            "try:\n"
            "    for _ in range(100):\n"
            "        search('q', limit=0); n += 1\n"
            "except HostCallLimitExceeded as e:\n"
            "    print(n, isinstance(e, PermissionError), e)\n"
        )
        out = run(s, code)
        assert out.stdout.strip() == (
            "5 True this run made more than 5 host calls (the per-run limit, max_host_calls)"
        )
        assert [c.outcome for c in out.host_calls] == ["ok"] * 5 + ["refused"]
        assert run(s, code).stdout.startswith("5 True")  # every run has its own budget


def test_exposed_functions_survive_a_new_kernel(session: kx.Session) -> None:
    run(session, "x = 1")
    session.restart()
    out = run(session, "from tools import search\nprint(search('again', limit=1))")
    assert out.stdout.strip() == "[{'query': 'again', 'rank': 0}]"
    assert out.kernel_restarted


def test_host_functions_for_one_call(executor: kx.KernelExecutor) -> None:
    s = executor.session("codemode-once")

    def secret_word() -> str:
        """Only for one run."""
        return "swordfish"

    out = run(
        s, "from tools import secret_word\nprint(secret_word())", host_functions=[secret_word]
    )
    assert out.stdout == "swordfish\n"
    after = s.run_code("import tools")
    assert after.error is not None and after.error.ename == "ModuleNotFoundError"
    kept = run(s, "try:\n    secret_word()\nexcept Exception as e:\n    print(type(e).__name__, e)")
    assert kept.stdout == "HostCallRefused tools.secret_word is not exposed\n"
    # A persistent module keeps its functions; one call's extras come and go.
    s.expose(search)
    run(s, "import tools\nprint(tools.secret_word())", host_functions=[secret_word])
    out = run(s, "import tools\nprint(hasattr(tools, 'secret_word'), tools.search('z', limit=0))")
    assert out.stdout == "False []\n"
    tool = kx.Tool.from_source(
        "def summarise(q: str) -> int:\n"
        "    from kb import search\n"
        "    return sum(len(hit['query']) for hit in search(q, limit=4))\n"
    )
    result = s.call_tool(tool, {"q": "abc"}, host_functions={"kb": [search]})
    assert result.ok, result.error
    assert result.func_return == 12
    assert [c.module for c in result.host_calls] == ["kb"]
    # The executor's shortcuts take them too.
    out = executor.run_code(
        "from tools import secret_word\nprint(secret_word())",
        agent_id="codemode-once-executor",
        host_functions=[secret_word],
    )
    assert out.stdout == "swordfish\n"


def test_a_tool_exposed_runs_on_the_host(executor: kx.KernelExecutor) -> None:
    tool = kx.Tool.from_source(
        "def host_pid() -> int:\n    '''The host's pid.'''\n    import os\n    return os.getpid()\n"
    )
    s = executor.session("codemode-tool")
    s.expose(tool, module="host.info")
    out = run(s, "from host.info import host_pid\nimport os\nprint(host_pid() != os.getpid())")
    import os

    assert out.stdout == "True\n"
    assert out.host_calls[0].result == os.getpid()


def test_expose_refuses_what_cannot_be_called() -> None:
    def star(*args: int) -> None: ...

    def positional(a: int, /) -> None: ...

    with kx.KernelExecutor(default_timeout=30) as ex:
        s = ex.session("codemode-refuse")
        with pytest.raises(kx.ConfigError, match=r"\*args"):
            s.expose(star)
        with pytest.raises(kx.ConfigError, match="positional-only"):
            s.expose(positional)
        with pytest.raises(kx.ConfigError, match="standard library"):
            s.expose(search, module="json")
        with pytest.raises(kx.ConfigError, match="public identifier"):
            s.expose(lambda: 1)
        with pytest.raises(kx.ConfigError):
            s.run_code("1", host_functions=[star])


def test_recording_keeps_each_host_call() -> None:
    with kx.KernelExecutor(record=True, default_timeout=30) as ex:
        s = ex.session("codemode-record")
        s.expose(search, fail)
        out = run(
            s,
            "from tools import search, fail\nhits = search('rec', limit=1)\n"
            "try:\n    fail('nope')\nexcept Exception:\n    pass\nprint(len(hits))",
        )
        assert out.stdout == "1\n"
        assert not any(HOST_CALL_MIME in (o.get("data") or {}) for o in out.outputs)
        notebook = s.notebook
        assert notebook is not None
        cell = notebook.cells[-1]
        records = [
            o["data"][HOST_CALL_MIME] for o in cell.outputs if o.output_type == "display_data"
        ]
    assert [(r["name"], r["outcome"]) for r in records] == [("search", "ok"), ("fail", "error")]
    assert records[0]["arguments"] == {"query": "rec", "limit": 1}
    assert records[0]["result"] == [{"query": "rec", "rank": 0}]
    assert records[1]["error"] == "ValueError: nope"
    assert all(r["duration_s"] >= 0 for r in records)


def test_replay_answers_host_calls_as_recorded_or_reruns_them(tmp_path: Path) -> None:
    numbers = itertools.count(100)

    def ticket(kind: str, urgent: bool = False) -> int:
        """A new ticket number (never the same twice)."""
        return next(numbers)

    with kx.KernelExecutor(record_dir=tmp_path, default_timeout=30) as ex:
        s = ex.session("codemode-replay")
        s.expose(ticket, fail)
        run(s, "from tools import ticket, fail\nprint(ticket('a'), ticket(kind='b', urgent=True))")
        run(
            s,
            "try:\n    fail('gone')\n"
            "except Exception as e:\n    print(type(e).__name__, e.host_type, e)",
        )
    path = tmp_path / "codemode-replay.ipynb"
    report = kx.replay(path)
    assert report.ok, report.differences  # the stubs answered 100, 101 and the error again
    assert report.cells_run == 2
    numbers = itertools.count(500)
    rerun = kx.replay(path, host_functions=[ticket, fail])
    assert [d.index for d in rerun.differences] == [0]
    assert "-[stdout] 100 101" in rerun.differences[0].diff
    assert "+[stdout] 500 501" in rerun.differences[0].diff
