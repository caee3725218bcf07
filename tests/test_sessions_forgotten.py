"""Finding 6 of the hostile probe: closed or evicted sessions are forgotten by the executor
(bounded memory over any number of agents); the same agent id then gets a new session."""

from __future__ import annotations

import gc
import weakref

import pytest

import kernelexec as kx


@pytest.mark.anyio
async def test_closed_sessions_are_forgotten_and_the_agent_id_works_again() -> None:
    async with kx.AsyncKernelExecutor() as ex:
        refs = []
        for i in range(50):
            session = await ex.session(f"agent-{i}")
            refs.append(weakref.ref(session))
            await session.aclose()
        del session
        gc.collect()
        assert [r for r in refs if r() is not None] == []
        assert ex.sessions == {}

        first = await ex.session("again")
        assert (await first.run_code("x = 1")).ok
        await first.aclose()
        with pytest.raises(kx.ExecutorClosedError):
            await first.run_code("1")
        second = await ex.session("again")
        assert second is not first
        result = await ex.run_code("'x' in globals()", agent_id="again")
        assert result.ok and result.result == "False"


def test_the_sync_facade_forgets_closed_sessions_too() -> None:
    with kx.KernelExecutor() as ex:
        ref = weakref.ref(ex.session("s"))
        ex.session("s").close()
        gc.collect()
        assert ref() is None
        assert ex.run_code("1 + 1", agent_id="s").result == "2"


def test_evicted_sessions_nobody_holds_are_forgotten_and_say_what_was_lost() -> None:
    with kx.KernelExecutor(max_kernels=1) as ex:
        ex.run_code("va = 1", agent_id="a")
        ref = weakref.ref(ex._async.sessions["a"])
        ex.run_code("vb = 1", agent_id="b")  # evicts a's kernel
        gc.collect()
        assert ref() is None, "the executor still holds the evicted session"
        back = ex.run_code("'va' in globals()", agent_id="a")
        assert back.result == "False"
        assert back.kernel_restarted is True and back.lost_variables == ["va"]


def test_a_new_session_reports_no_restart(executor: kx.KernelExecutor) -> None:
    first = executor.run_code("1", agent_id="brand-new")
    assert first.kernel_restarted is False and first.lost_variables == []
