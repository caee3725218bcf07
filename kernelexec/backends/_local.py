"""The local backend: an ipykernel process on this machine, driven by jupyter-client.

Each kernel gets a fresh private directory holding its connection file, its ipc sockets and its
stderr log, so no TCP port is opened and nothing is re-read from a directory the kernel can
write. Shutting the kernel down removes the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from typing import IO, Any

import zmq
import zmq.asyncio
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from kernelexec._exceptions import KernelStartError
from kernelexec._tempdirs import make_owned_dir
from kernelexec.backends._base import ExecuteRequest, KernelBackend, KernelConnection, KernelMessage

# Flags that trim start-up: no history database (nothing written under ~/.ipython), and the
# 0.5 ms sleep ipykernel inserts before every reply turned off.
_KERNEL_FLAGS = (
    "--HistoryManager.enabled=False",
    "--IPythonKernel._execute_sleep=0",
    "--Application.log_level=WARN",
)


# ipykernel_launcher, minus ipykernel's debugger: importing debugpy is about 110 ms of a 0.3 s
# kernel start (python -X importtime), and kernelexec does not speak the debug protocol. The
# block is lifted once ipykernel is up (kernel side ``install``), so tools may import debugpy.
_LEAN_LAUNCHER = (
    "import sys\n"
    "if sys.path and sys.path[0] in ('', '.'):\n"
    "    del sys.path[0]\n"
    "sys.modules.setdefault('debugpy', None)\n"
    "from ipykernel import kernelapp\n"
    "kernelapp.launch_new_instance()\n"
)

_CONTEXT: zmq.asyncio.Context | None = None


def _context() -> zmq.asyncio.Context:
    """kernelexec's zmq context: sockets retry a not-yet-bound kernel every 10 ms, not 100."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = zmq.asyncio.Context()
        _CONTEXT.setsockopt(zmq.RECONNECT_IVL, 10)
    return _CONTEXT


class _FixedSpecs(KernelSpecManager):
    """Hands jupyter-client our in-memory kernelspec instead of searching the disk."""

    def __init__(self, spec: KernelSpec) -> None:
        super().__init__()
        self._spec = spec

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return self._spec


class LocalBackend(KernelBackend):
    """Starts ipykernel processes on this machine.

    Args:
        python: The interpreter that runs the kernel; it must have ipykernel installed.
            Defaults to the interpreter running kernelexec.
        extra_args: Extra command-line arguments for ``ipykernel_launcher``.
    """

    def __init__(self, python: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.python = python or sys.executable
        self.extra_args = tuple(extra_args)

    def describe(self) -> str:
        return f"local:{self.python}"

    async def start(self, *, env: dict[str, str], timeout: float) -> KernelConnection:
        conn = LocalConnection(self.python, self.extra_args, env)
        try:
            await conn.launch(timeout)
        except BaseException:
            await asyncio.shield(conn.shutdown())
            raise
        return conn


class LocalConnection(KernelConnection):
    """A kernel process on this machine with its zmq channels."""

    def __init__(self, python: str, extra_args: tuple[str, ...], env: dict[str, str]) -> None:
        self._python = python
        self._extra_args = extra_args
        self._env = dict(env)
        self._dir = ""
        self._km: AsyncKernelManager | None = None
        self._shell: zmq.asyncio.Socket | None = None
        self._iopub: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        self._pending: deque[KernelMessage] = deque()
        self._stderr: IO[bytes] | None = None
        self._exit_code: int | None = None
        self._kc: Any = None
        self._start_timeout = 30.0
        self._drain: list[tuple[str, zmq.Socket[bytes]]] = []
        self._seen: dict[bytes, None] = {}  # recent signatures: replayed messages are dropped

    @property
    def kernel_id(self) -> str:
        return os.path.basename(self._dir) if self._dir else "(not started)"

    async def launch(self, timeout: float) -> None:
        """Start the process in a fresh private directory and wait until it answers."""
        self._start_timeout = timeout
        # Short paths: ipc socket names must fit in sun_path (108 bytes).
        self._dir = make_owned_dir("kx-")
        spec = KernelSpec(
            argv=[
                self._python,
                "-c",
                _LEAN_LAUNCHER,
                "-f",
                "{connection_file}",
                *_KERNEL_FLAGS,
                *self._extra_args,
            ],
            display_name="kernelexec",
            language="python",
            interrupt_mode="signal",
            metadata={},
            env={},
        )
        km = AsyncKernelManager(
            kernel_spec_manager=_FixedSpecs(spec),
            kernel_name="kernelexec",
            transport="ipc",
            ip=os.path.join(self._dir, "s"),
            connection_file=os.path.join(self._dir, "kernel.json"),
        )
        self._km = km
        # Kernel stdout gets fd-level output that ipykernel also forwards as messages; it must
        # never be a pipe nobody drains. stderr is kept (bounded by the kernel's lifetime) so a
        # failed start can be explained.
        self._stderr = open(os.path.join(self._dir, "stderr.log"), "wb")  # noqa: SIM115, ASYNC230
        env = dict(self._env)
        env["IPYTHONDIR"] = os.path.join(self._dir, "ipython")
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        try:
            await km.start_kernel(
                env=env, cwd=self._dir, stdout=subprocess.DEVNULL, stderr=self._stderr
            )
        except Exception as exc:
            raise KernelStartError(f"could not launch {self._python}: {exc}") from exc
        kc = km.client(context=_context())
        kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        self._kc = kc
        self._shell = kc.shell_channel.socket
        self._iopub = kc.iopub_channel.socket
        self._poller.register(self._shell, zmq.POLLIN)
        self._poller.register(self._iopub, zmq.POLLIN)
        # Blocking twins of the two sockets, to drain every ready message without a future each.
        self._drain = [
            ("shell", zmq.Socket.shadow(self._shell.underlying)),
            ("iopub", zmq.Socket.shadow(self._iopub.underlying)),
        ]
        self._seen.clear()
        await self._wait_ready(timeout)

    async def _wait_ready(self, timeout: float) -> None:
        """Wait until the kernel answers on shell and its iopub reaches us.

        jupyter-client's ``wait_for_ready`` ends with 0.2 s of listening for iopub silence, a
        third of a cold start; here the kernel is ready as soon as one ``kernel_info`` request
        has both its reply and an iopub message (its status), so no output can be missed.
        """
        deadline = time.monotonic() + timeout
        asked: set[str] = set()
        replied = published = False
        while not (replied and published):
            if time.monotonic() > deadline:
                raise KernelStartError(
                    f"kernel did not become ready within {timeout:g} s{self._stderr_tail()}"
                )
            asked.add(str(self._kc.kernel_info()))
            until = time.monotonic() + 0.1  # resend: a slow-joining iopub misses the first
            while time.monotonic() < until and not (replied and published):
                msg = await self.receive(max(0.0, until - time.monotonic()))
                if msg is None or msg.parent_id not in asked:
                    continue
                replied |= msg.channel == "shell" and msg.msg_type == "kernel_info_reply"
                published |= msg.channel == "iopub"
            if not (replied and published) and not await self.is_alive():
                code = self._exit_code
                raise KernelStartError(
                    f"kernel exited (status {code}) before it was ready{self._stderr_tail()}"
                )
        self._pending.clear()

    def _stderr_tail(self, limit: int = 2000) -> str:
        path = os.path.join(self._dir, "stderr.log")
        try:
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - limit))
                text = fh.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"\nkernel stderr:\n{text}" if text else ""

    async def execute(self, request: ExecuteRequest) -> str:
        content = {
            "code": request.code,
            "silent": request.silent,
            "store_history": request.store_history,
            "user_expressions": request.user_expressions,
            "allow_stdin": False,
            "stop_on_error": False,
        }
        msg = self._kc.session.msg("execute_request", content, metadata=request.metadata)
        self._kc.shell_channel.send(msg)
        return str(msg["header"]["msg_id"])

    async def receive(self, timeout: float) -> KernelMessage | None:
        if self._pending:
            return self._pending.popleft()
        if not await self._poller.poll(timeout * 1000):
            return None
        for channel, sock in self._drain:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = self._decode(channel, frames)
                if msg is not None:
                    self._pending.append(msg)
        return self._pending.popleft() if self._pending else None

    def _decode(self, channel: str, frames: list[bytes]) -> KernelMessage | None:
        # jupyter-client's Session.deserialize would also parse every header date with
        # dateutil, a large share of a warm call's host time; kernelexec needs no dates.
        session = self._kc.session
        try:
            _, parts = session.feed_identities(frames, copy=True)
            signature = parts[0]
            if not signature or signature in self._seen:
                return None
            if not hmac.compare_digest(signature, session.sign(parts[1:5])):
                return None
            self._seen[signature] = None
            if len(self._seen) > 4096:
                del self._seen[next(iter(self._seen))]
            header = json.loads(parts[1])
            parent = json.loads(parts[2]) or {}
            content = json.loads(parts[4])
            return KernelMessage(
                channel=channel,  # type: ignore[arg-type]
                msg_type=str(header["msg_type"]),
                parent_id=parent.get("msg_id"),
                content=content if isinstance(content, dict) else {},
                metadata=json.loads(parts[3]) or {},
            )
        except Exception:
            # Garbage from the kernel (it holds the key and may send anything): drop it.
            return None

    async def is_alive(self) -> bool:
        km = self._km
        if km is None or not km.has_kernel:
            return False
        alive = bool(await km.is_alive())
        if not alive and self._exit_code is None:
            proc = getattr(km.provisioner, "process", None)
            self._exit_code = getattr(proc, "returncode", None)
        return alive

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    async def interrupt(self) -> None:
        km = self._km
        if km is not None and km.has_kernel:
            with contextlib.suppress(Exception):
                await km.interrupt_kernel()

    async def restart(self) -> None:
        await self.shutdown()
        self._pending.clear()
        self._exit_code = None
        self._poller = zmq.asyncio.Poller()
        await self.launch(self._start_timeout)

    async def shutdown(self) -> None:
        km, self._km = self._km, None
        kc, self._kc = self._kc, None
        if kc is not None:
            kc.stop_channels()
        self._shell = self._iopub = None
        for _, sock in self._drain:
            sock.close(linger=0)
        self._drain = []
        if km is not None:
            if km.has_kernel:
                try:
                    await km.shutdown_kernel(now=True)
                except Exception:
                    await _kill_process_group(km)
            with contextlib.suppress(Exception):
                await km.cleanup_resources()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


async def _kill_process_group(km: AsyncKernelManager) -> None:
    proc = getattr(km.provisioner, "process", None)
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)
