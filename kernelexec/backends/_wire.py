"""The zmq side of a local kernel: kernelexec's zmq context, and :class:`KernelWire`, which
moves one kernel's messages (framing and signing requests, reading the sockets through the
event loop, dropping what fails the signature or replay checks, queueing the rest).

The process side (``_local``) starts the kernel and hands its jupyter-client manager to
:meth:`KernelWire.open` after each start; :meth:`KernelWire.receive` asks it, through a
callback, whether the kernel still runs.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import zmq
import zmq.asyncio
from jupyter_client.manager import AsyncKernelManager

from kernelexec._exceptions import KernelStartError
from kernelexec.backends import _hostlimits
from kernelexec.backends._base import KernelDied, KernelMessage

log = logging.getLogger("kernelexec")

_CONTEXT: zmq.asyncio.Context | None = None
_OLD_CONTEXTS: list[zmq.asyncio.Context] = []  # kept: their sockets may still be open
_SOCKETS = _hostlimits.ZMQ_DEFAULT_SOCKETS


def context() -> zmq.asyncio.Context:
    """kernelexec's zmq context: sockets retry a not-yet-bound kernel every 10 ms, not 100, and
    it holds the sockets of every kernel reserved (zmq's default cap is 1,023 sockets).

    The cap is fixed once the context has a socket: when more are reserved later, new
    kernels get a new context with a higher cap (the old one stays for its sockets)."""
    global _CONTEXT
    if _CONTEXT is not None and _CONTEXT.get(zmq.MAX_SOCKETS) < _SOCKETS:
        _OLD_CONTEXTS.append(_CONTEXT)
        _CONTEXT = None
    if _CONTEXT is None:
        _CONTEXT = zmq.asyncio.Context()
        _CONTEXT.set(zmq.MAX_SOCKETS, _SOCKETS)
        _CONTEXT.setsockopt(zmq.RECONNECT_IVL, 10)
    return _CONTEXT


def reserve_sockets(kernels: int) -> None:
    """Make room in :func:`context` for the sockets of ``kernels`` kernels (all executors')."""
    global _SOCKETS
    _SOCKETS = max(_SOCKETS, _hostlimits.sockets_needed(kernels))


_POLL = 0.05
"""Seconds of silence after which ``receive`` checks whether the kernel process still runs
(a non-blocking ``waitpid``: no I/O)."""

_RECEIVED = ("shell", "iopub", "control")
_POLLIN = int(zmq.POLLIN)  # a plain int: combining zmq's enum flags costs a call each
_PENDING_MAX = 1_000
"""Messages taken off the sockets and not yet handed to ``receive``. Past this the sockets are
left to fill: the kernel then waits for the host (its iopub socket never drops, see
``_protocol/_kernel_output``), so a slow consumer holds at most this many here, plus ZMQ's
receive queue of 1,000."""
_SEND_TRIES = 200
_SEND_RETRY = 0.005
"""A request meets a full socket queue only when the kernel stopped reading: it is retried for
a second (200 x 5 ms), then dropped; the run times out as it would on a hung kernel."""


class KernelWire:
    """One kernel's channels (shell, iopub, control), from :meth:`open` to :meth:`close`;
    opened again after each restart."""

    def __init__(self) -> None:
        self.dropped = 0
        """Messages dropped for a bad signature, a replay or garbage (since the first open)."""
        self._kc: Any = None
        self._pending: deque[KernelMessage] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds: list[int] = []  # the sockets' fds, watched by the event loop
        self._waiter: asyncio.Future[None] | None = None  # the receive() waiting for messages
        self._drain: list[tuple[str, zmq.Socket[bytes]]] = []
        self._senders: dict[str, zmq.Socket[bytes]] = {}
        self._seen: dict[bytes, None] = {}  # recent signatures: replayed messages are dropped
        self._limits: dict[str, int] = {}  # msg_type -> most bytes read whole (limit())

    def limit(self, msg_type: str, max_bytes: int) -> None:
        """From now on a message of ``msg_type`` whose content and buffers pass ``max_bytes``
        is never checked or parsed whole: it is handed on as a stub (see
        :meth:`KernelConnection.limit_messages`)."""
        self._limits[msg_type] = max_bytes

    def open(self, km: AsyncKernelManager) -> None:
        """Connect to the kernel ``km`` started (on the running event loop)."""
        kc = km.client(context=context())
        kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=True)
        self._kc = kc
        receiving = {
            "shell": kc.shell_channel.socket,
            "iopub": kc.iopub_channel.socket,
            "control": kc.control_channel.socket,
        }
        # Blocking twins of the sockets, read when the event loop sees their fds ready: one
        # callback drains every ready message, no future or poller per message (the asyncio
        # sockets themselves are never awaited, which would take their fds over). Requests
        # go out through the same twins.
        twins: dict[str, zmq.Socket[bytes]] = {
            name: zmq.Socket.shadow(receiving[name].underlying) for name in _RECEIVED
        }
        self._drain = list(twins.items())
        self._senders = {"shell": twins["shell"], "control": twins["control"]}
        self._loop = asyncio.get_running_loop()
        for _, sock in self._drain:
            fd = sock.getsockopt(zmq.FD)
            assert isinstance(fd, int)
            self._loop.add_reader(fd, self._on_readable)
            self._fds.append(fd)
        self._seen.clear()
        self._pending.clear()

    def close(self) -> None:
        """Close the channels and forget what was received; safe to call more than once."""
        kc, self._kc = self._kc, None
        for fd in self._fds:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
        self._fds = []
        if self._waiter is not None:
            _wake(self._waiter)
        self._senders = {}
        drain, self._drain = self._drain, []
        for _, sock in drain:
            sock.close(linger=0)
        if kc is not None:
            # Only the channels started: the client's stop_channels() would first open the
            # stdin and heartbeat sockets it never used, just to ask whether they run.
            for channel in (kc.shell_channel, kc.iopub_channel, kc.control_channel):
                if channel.is_alive():
                    channel.stop()
        self._pending.clear()

    async def send(
        self,
        channel: Literal["shell", "control"],
        msg_type: str,
        content: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        buffers: tuple[bytes, ...] = (),
    ) -> str:
        """Sign and send one request (see ``KernelConnection.send``); its ``msg_id``.

        Raises:
            KernelStartError: the wire is closed (the kernel is shut down).
        """
        kc = self._kc
        if kc is None:
            raise KernelStartError("the kernel is shut down")
        msg = kc.session.msg(msg_type, content, metadata=metadata)
        frames = kc.session.serialize(msg)
        frames.extend(buffers)
        sock = self._senders[channel]
        # Straight into the socket's queue: the asyncio socket's send costs a future and a
        # loop callback per message (a sixth of a warm call's host time).
        for _ in range(_SEND_TRIES):
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:  # the queue is full: a kernel that stopped reading
                await asyncio.sleep(_SEND_RETRY)
        else:
            log.warning("dropped a %s request: the kernel has not read its queue", msg_type)
        self._loop_soon_drain()  # a send can swallow the socket's readiness edge
        return str(msg["header"]["msg_id"])

    async def receive(
        self,
        timeout: float,
        died: KernelDied | None,
        check: Callable[[], KernelDied | None],
    ) -> KernelMessage | KernelDied | None:
        """The next message (see ``KernelConnection.receive``): one already received first,
        else ``died`` (a death already known), else the next to arrive within ``timeout``
        seconds. ``check`` is asked after each :data:`_POLL` seconds of silence whether the
        kernel is gone; what it sent before dying comes before its death."""
        if self._pending:
            return self._pending.popleft()
        if died is not None:
            return died
        self._drain_ready()
        if self._pending:
            return self._pending.popleft()
        deadline = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while True:
            wait = max(0.0, min(deadline - time.monotonic(), _POLL))
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(wait, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._pending:
                self._drain_ready()  # the safety net under a readiness edge never seen
            if self._pending:
                return self._pending.popleft()
            died = check()
            if died is not None:
                self._drain_ready()  # what it sent before dying comes first
                return self._pending.popleft() if self._pending else died
            if time.monotonic() >= deadline:
                return None

    def _on_readable(self) -> None:
        """The event loop saw a socket's fd ready: take what arrived, wake ``receive``."""
        self._drain_ready()
        waiter = self._waiter
        if self._pending and waiter is not None:
            _wake(waiter)

    def _loop_soon_drain(self) -> None:
        if self._loop is not None and self._fds:
            self._loop.call_soon(self._on_readable)

    def _drain_ready(self) -> None:
        # zmq's fd only signals changes (edge-triggered): read until the socket itself says
        # nothing is left, or a message that came in meanwhile would wait for the next edge.
        # Asked before each read rather than read until zmq.Again: an exception per empty
        # socket was eight per call, a sixth of a call's host time (cProfile). Past
        # _PENDING_MAX the rest waits in the socket; ``receive`` drains again once
        # ``_pending`` is empty.
        for channel, sock in self._drain:
            while len(self._pending) < _PENDING_MAX:
                events = sock.getsockopt(zmq.EVENTS)
                if not (isinstance(events, int) and events & _POLLIN):
                    break
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                msg = self._decode(channel, frames)
                if msg is not None:
                    self._pending.append(msg)

    def _decode(self, channel: str, frames: list[bytes]) -> KernelMessage | None:
        # jupyter-client's Session.deserialize would also parse every header date with
        # dateutil, a large share of a warm call's host time; kernelexec needs no dates.
        session = self._kc.session
        try:
            _, parts = session.feed_identities(frames, copy=True)
            if self._limits:
                stub = _oversized(channel, parts, self._limits)
                if stub is not None:
                    return stub
            signature = parts[0]
            if not signature or signature in self._seen:
                return self._drop("an unsigned or replayed message")
            if not hmac.compare_digest(signature, session.sign(parts[1:5])):
                return self._drop("a message with a bad signature")
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
                buffers=tuple(parts[5:]),
            )
        except Exception:
            # Garbage from the kernel (it holds the key and may send anything): drop it.
            return self._drop("a message that does not decode")

    def _drop(self, what: str) -> KernelMessage | None:
        """Count a message that is not let through; always None (nothing to hand on)."""
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.warning("dropped %s from a kernel (%d dropped so far)", what, self.dropped)
        return None


_HEADER_MAX = 1 << 16
_FIELD = re.compile(rb'"(id|module|name)":\s*"([A-Za-z0-9_.\-]{1,100})"')


def _oversized(channel: str, parts: list[bytes], limits: dict[str, int]) -> KernelMessage | None:
    """A stub for a message of a limited type past its limit (``oversized``: its size, and the
    ``id``, ``module`` and ``name`` found in its first kilobyte), or None for any other. Only
    the small header frame is parsed: the rest is never checked or decoded (an oversized
    message is refused, so its signature does not matter)."""
    if len(parts) < 5 or len(parts[1]) > _HEADER_MAX:
        return None
    size = sum(len(part) for part in parts[4:])
    if size <= min(limits.values()):
        return None
    try:
        header = json.loads(parts[1])
        msg_type = str(header["msg_type"])
        parent = json.loads(parts[2]) if len(parts[2]) <= _HEADER_MAX else {}
    except (ValueError, KeyError, TypeError):
        return None
    limit = limits.get(msg_type)
    if limit is None or size <= limit:
        return None
    content: dict[str, Any] = {"oversized": size}
    for key, value in _FIELD.findall(bytes(parts[4][:1024])):
        content.setdefault(key.decode(), value.decode())
    return KernelMessage(
        channel=channel,  # type: ignore[arg-type]
        msg_type=msg_type,
        parent_id=parent.get("msg_id") if isinstance(parent, dict) else None,
        content=content,
        buffers=(),
    )


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
