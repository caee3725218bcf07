"""Bringing a kernel up, for every backend: start or restart it, wait until it is ready, and
install kernelexec's kernel-side helper.

A kernel is ready when one ``kernel_info`` request has both its reply on shell and an iopub
message (its status), so no output of the first run can be missed. jupyter-client's
``wait_for_ready`` ends with 0.2 s of listening for iopub silence, a third of a cold start;
this does not.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time

from kernelexec._aio import finish_then_cancel
from kernelexec._core._run import run_internal
from kernelexec._exceptions import KernelStartError
from kernelexec._protocol._host import ExecuteRequest, answers_fences, serves_calls
from kernelexec.backends._base import KernelBackend, KernelConnection, KernelDied, KernelLaunch

_RESEND = 0.1
"""Seconds before ``kernel_info`` is asked again: an iopub socket that joins late misses the
status of the first request."""


async def start_kernel(
    backend: KernelBackend, launch: KernelLaunch, bootstrap: ExecuteRequest, timeout: float
) -> KernelConnection:
    """A started, ready kernel with the helper installed, within ``timeout`` seconds in all.

    Raises:
        KernelStartError: it did not start or become ready; nothing is left running.
    """
    deadline = time.monotonic() + timeout
    conn = await backend.start(launch, timeout=timeout)
    try:
        await _ready_and_installed(conn, bootstrap, deadline)
    except BaseException:
        await shutdown_fully(conn)
        raise
    return conn


async def shutdown_fully(conn: KernelConnection) -> None:
    """Shut ``conn`` down to the end, even when the caller is cancelled meanwhile (an executor
    closing while a pool starts or culls a kernel); the cancellation goes on afterwards."""
    await finish_then_cancel(conn.shutdown())


async def restart_kernel(conn: KernelConnection, bootstrap: ExecuteRequest, timeout: float) -> None:
    """Restart ``conn``'s kernel (state lost) and make it ready as :func:`start_kernel` does."""
    deadline = time.monotonic() + timeout
    try:
        await asyncio.wait_for(conn.restart(), timeout)
    except asyncio.TimeoutError:
        raise KernelStartError(
            f"the kernel did not restart within {timeout:g} s{conn.diagnostics()}"
        ) from None
    await _ready_and_installed(conn, bootstrap, deadline)


async def make_ready(conn: KernelConnection, bootstrap: ExecuteRequest, timeout: float) -> None:
    """Wait until an already started kernel (a branch) is ready and run ``bootstrap`` in it,
    as :func:`start_kernel` does.

    Raises:
        KernelStartError: it did not become ready or the bootstrap failed.
    """
    await _ready_and_installed(conn, bootstrap, time.monotonic() + timeout)


async def _ready_and_installed(
    conn: KernelConnection, bootstrap: ExecuteRequest, deadline: float
) -> None:
    await wait_ready(conn, deadline)
    conn.serves_calls = conn.fenced = False
    out = await run_internal(conn, bootstrap, max(0.1, deadline - time.monotonic()))
    if out.died or out.timed_out or (out.reply or {}).get("status") != "ok":
        detail = (out.collected.error or out.reply or {}).get("evalue", "no reply")
        raise KernelStartError(f"installing kernelexec's helper in the kernel failed: {detail}")
    conn.serves_calls = conn.custom_messages and serves_calls(out.reply or {})
    conn.fenced = conn.custom_messages and answers_fences(out.reply or {})


async def wait_ready(conn: KernelConnection, deadline: float) -> None:
    """Return once the kernel answers ``kernel_info`` on shell and its iopub reaches us.

    Raises:
        KernelStartError: the kernel died, or did not answer by ``deadline`` (monotonic time).
    """
    asked: set[str] = set()
    replied = published = False
    while not (replied and published):
        now = time.monotonic()
        if now > deadline:
            raise KernelStartError(
                f"kernel did not become ready in time{_out_of_descriptors()}{conn.diagnostics()}"
            )
        asked.add(await conn.send("shell", "kernel_info_request", {}))
        until = min(deadline, now + _RESEND)
        while not (replied and published):
            left = until - time.monotonic()
            if left <= 0:
                break
            msg = await conn.receive(left)
            if isinstance(msg, KernelDied):
                raise KernelStartError(
                    f"kernel exited ({msg.reason}) before it was ready"
                    f"{msg.detail or conn.diagnostics()}"
                )
            if msg is None or msg.parent_id not in asked:
                continue
            replied |= msg.channel == "shell" and msg.msg_type == "kernel_info_reply"
            published |= msg.channel == "iopub"


def _out_of_descriptors() -> str:
    """Why the kernel may not have answered when this process has no descriptor left: zmq
    then retries its connections in silence, and the start can only time out."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        if exc.errno == errno.EMFILE:
            return f" (this process is out of file descriptors: {exc.strerror})"
    return ""
