"""Hostile (issue 41 items 4, 5 and 7): what an agent framework adapter's command and state can
cost or give the host. A tenant's command printing without end, or a sparse file in its
workspace, must cost the host a bounded amount of memory; and a forged openai-agents session
state must not attach to another agent's kernel or point the SDK at a host path.

Seen before the fix: ``exec_command`` printing 1.5 GiB took the host from 139 MiB to 3.2 GiB
(the host kept every byte, the kernel side's cap was per poll); ``persist_workspace`` read a
sparse file densely and held the archive whole; ``resume`` attached to whatever agent id the
state named.
"""

from __future__ import annotations

import asyncio
import gc
import io
import shutil
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

pytest.importorskip("agents.sandbox")

from agents import set_tracing_disabled
from agents.sandbox.errors import WorkspaceArchiveReadError
from agents.sandbox.snapshot import LocalSnapshot, LocalSnapshotSpec

import kernelexec as kx
from kernelexec._files._commands import MAX_OUTPUT
from kernelexec.compat.openai_agents import KernelSandboxClient

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

set_tracing_disabled(True)

MIB = 1 << 20
SLACK = 96 * MIB
"""Host memory a bounded operation may add (the kept output, buffers in flight, allocator)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


async def test_a_command_printing_far_more_than_the_bound_costs_the_host_only_the_bound(
    executor: kx.KernelExecutor,
) -> None:
    client = KernelSandboxClient(executor=executor)
    try:
        session = await client.create()
        async with session:
            before = rss()
            # 256 MiB of output, 16 times the bound.
            result = await session.exec("yes 0123456789abcdef0123456789abcde | head -c 268435456")
            grown = rss() - before
            out = result.stdout
            assert result.exit_code == 0
            assert out.startswith(b"0123456789abcdef0123456789abcde\n")
            assert len(out) < MAX_OUTPUT + 200
            marker = f"[kernelexec: output cut after {MAX_OUTPUT} bytes; "
            assert marker.encode() in out
            assert out.endswith(f"{(256 * MIB) - MAX_OUTPUT} more bytes dropped]\n".encode())
            assert grown < MAX_OUTPUT + SLACK, f"the host grew by {grown / MIB:.0f} MiB"
    finally:
        await client.aclose()


def test_deepagents_and_pydantic_ai_say_what_was_cut(executor: kx.KernelExecutor) -> None:
    pytest.importorskip("deepagents")
    pytest.importorskip("pydantic_ai.workspaces")
    import asyncio

    from kernelexec.compat.deepagents import KernelSandbox
    from kernelexec.compat.pydantic_ai import KernelWorkspace

    command = f"head -c {MAX_OUTPUT + 5 * MIB} /dev/zero | tr '\\0' x"
    sandbox = KernelSandbox(executor=executor)
    try:
        response = sandbox.execute(command)
    finally:
        sandbox.close()
    assert response.truncated is True
    assert response.output.endswith(f"{5 * MIB} more bytes dropped]\n")
    assert len(response.output) < MAX_OUTPUT + 200

    async def run() -> object:
        workspace = KernelWorkspace(executor=executor)
        try:
            return await workspace.run(command, shell=True)
        finally:
            await workspace.aclose()

    result = asyncio.run(run())
    stdout = getattr(result, "stdout", "")
    assert stdout.endswith(f"{5 * MIB} more bytes dropped]\n")
    assert len(stdout) < MAX_OUTPUT + 200


def test_the_core_result_carries_the_flag(executor: kx.KernelExecutor) -> None:
    session = executor.session(f"cut-{uuid.uuid4().hex[:6]}")
    try:
        result = session.commands.run(
            "head -c 3000000 /dev/zero; head -c 10 /dev/zero >&2", max_output=MIB
        )
    finally:
        session.close()
    assert (result.stdout_dropped, result.stderr_dropped, result.truncated) == (
        3000000 - MIB,
        0,
        True,
    )
    assert result.stdout.startswith("\0" * MIB)
    assert (
        result.stdout[MIB:]
        == f"\n[kernelexec: output cut after {MIB} bytes; {3000000 - MIB} more bytes dropped]\n"
    )
    assert result.stderr == "\0" * 10


async def test_a_big_sparse_file_is_persisted_sparse_and_never_held_whole(
    executor: kx.KernelExecutor,
) -> None:
    client = KernelSandboxClient(executor=executor)
    try:
        session = await client.create()
        async with session:
            made = await session.exec("truncate -s 1G hole.bin && printf end >> hole.bin")
            assert made.exit_code == 0, made.stderr
            before = rss()
            with await session.persist_workspace() as packed:
                grown = rss() - before
                archive = packed.read()
            assert grown < SLACK, f"the host grew by {grown / MIB:.0f} MiB"
            assert len(archive) < MIB  # the hole is not in it
            await session.exec("rm hole.bin")
            await session.hydrate_workspace(io.BytesIO(archive))
            back = await session.exec("stat -c %s hole.bin; tail -c 3 hole.bin")
            assert back.stdout == f"{(1 << 30) + 3}\nend".encode()
    finally:
        await client.aclose()


async def test_an_archive_past_the_bound_is_refused(executor: kx.KernelExecutor) -> None:
    client = KernelSandboxClient(executor=executor, max_archive_bytes=MIB)
    try:
        session = await client.create()
        async with session:
            await session.exec("head -c 3000000 /dev/urandom > dense.bin")
            with pytest.raises(WorkspaceArchiveReadError) as caught:
                await session.persist_workspace()
            assert caught.value.context.get("reason") == "archive_too_large"
            # Nothing staged is left in the workspace.
            assert (await session.exec("ls -A")).stdout.split() == [b"dense.bin"]
    finally:
        await client.aclose()


async def test_a_forged_state_cannot_attach_to_another_agents_kernel(
    executor: kx.KernelExecutor,
) -> None:
    victim_id = f"victim-{uuid.uuid4().hex[:6]}"
    victim = executor.session(victim_id)
    victim.run_code("secret = 's3cret'")
    other = KernelSandboxClient(executor=executor)  # another tenant's adapter
    attacker = KernelSandboxClient(executor=executor)
    try:
        theirs = await other.create()
        mine = await attacker.create()
        for target in (victim_id, theirs.state.agent_id):
            forged = attacker.deserialize_session_state(
                {**mine.state.model_dump(mode="json"), "agent_id": target}
            )
            with pytest.raises(kx.ConfigError, match="cannot resume agent_id"):
                await attacker.resume(forged)
        assert victim.run_code("secret").result == "'s3cret'"
        # Its own state still resumes.
        again = await attacker.resume(mine.state)
        assert again.state.agent_id == mine.state.agent_id
    finally:
        await attacker.aclose()
        await other.aclose()
        victim.close()


async def test_a_forged_snapshot_cannot_name_a_host_path(executor: kx.KernelExecutor) -> None:
    root = Path(tempfile.mkdtemp(prefix="kx-oa-snap-"))
    client = KernelSandboxClient(executor=executor)
    try:
        session = await client.create(snapshot=LocalSnapshotSpec(base_path=root))
        state = session.state
        assert isinstance(state.snapshot, LocalSnapshot)
        for where in ("/etc", "/root", str(root.parent)):
            payload = state.model_dump(mode="json")
            payload["snapshot"] = {"type": "local", "id": "passwd", "base_path": where}
            forged = client.deserialize_session_state(payload)
            with pytest.raises(kx.ConfigError, match="cannot resume a snapshot"):
                await client.resume(forged)
        again = await client.resume(state)  # one in the client's own directory
        assert again.state.snapshot.base_path == root
    finally:
        await client.aclose()
        await asyncio.to_thread(shutil.rmtree, root)
