"""Output delivery inside the kernel: flow control towards the host, and whole characters.

Like ``_kernel_side.py`` this module is never imported by the host: its source rides in the
install request and is executed in the kernel (as ``__kernelexec_output__``), standard library
only (pyzmq is looked up in ``sys.modules``, where ipykernel put it, never imported).

**Flow control.** ipykernel publishes output on an XPUB socket, which *drops* a message once the
subscriber's queue is full: about 2,000 messages in flight (ZMQ's high-water mark of 1,000 on
each side). A tool that printed and displayed 10,000 times each while the host's ``on_stdout``
callback stalled lost 18,023 of its 20,000 messages (``benchmarks/outputs.py``). Here the socket
is set to ``XPUB_NODROP``: it refuses instead of dropping, and ipykernel's IOPub thread waits in
its send until the host has read (:class:`_WaitingSocket`). While it waits, code that outputs
waits too (:meth:`Gate.wait`, before a print is buffered or a display is queued), so a slow
consumer slows the tool, and what is in flight stays bounded by the two queues and
:data:`WINDOW` messages queued inside the kernel. ipykernel's own threads (IOPub, control, shell
channel) never wait here: an interrupt always gets through.

**Whole characters.** ipykernel reads fd-level output (C code, subprocesses, ``os.write``) from a
pipe and decodes each read on its own, so a multi-byte character split across two writes
arrived as two U+FFFD. :func:`decode_whole_characters` replaces its reader with one that keeps
an incomplete character for the next read.

**Caught up at the end of a run.** The reader may hold a chunk it has read but not yet handed
to the stream (it waits for the stream's buffer lock, or for the gate), with the pipe already
empty; a run that ended then counted and flushed its output without that chunk, which followed
after the reply and was lost to the caller (under load, every few runs). :meth:`PipeReader.catch_up`
waits, without a clock, until every byte that was in the pipe or in the reader's hands has been
handed to the stream.
"""

from __future__ import annotations

import codecs
import os
import select
import struct
import sys
import threading
from typing import Any

try:
    import fcntl
    import termios
except ImportError:  # not POSIX: the bytes still in the pipe are not known (not waited for)
    fcntl = termios = None  # type: ignore[assignment]

WINDOW = 1_000
"""Messages that may wait in ipykernel's own send queue before code that outputs waits."""

_SEND_TIMEOUT_MS = 500  # the IOPub thread re-checks that the kernel is not stopping this often


class Gate:
    """Holds code that outputs while the host has not read what was already sent."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.cond = threading.Condition()
        self.queued = 0  # messages handed to the IOPub thread, not yet in the socket
        self.stuck = False  # the IOPub thread waits for the host to read
        self.waits = 0  # times code had to wait here (for tests and diagnostics)
        self.holds = 0  # times the IOPub thread found the host's queue full
        self.exempt: set[int] = set()  # ipykernel's own threads: never held

    def wait(self) -> None:
        """Return when there is room; at once on an exempt thread or when nothing is held."""
        if not (self.stuck or self.queued >= self.window):
            return
        if threading.get_ident() in self.exempt:
            return
        with self.cond:
            if self.stuck or self.queued >= self.window:
                self.waits += 1
            while self.stuck or self.queued >= self.window:
                self.cond.wait(0.5)  # SIGINT lands here as KeyboardInterrupt: the tool stops

    def queue(self) -> None:
        with self.cond:
            self.queued += 1

    def sent(self) -> None:
        with self.cond:
            self.queued = max(0, self.queued - 1)
            if self.queued == self.window - 1:
                self.cond.notify_all()

    def hold(self) -> None:
        with self.cond:
            self.stuck = True
            self.holds += 1

    def release(self) -> None:
        with self.cond:
            self.stuck = False
            self.cond.notify_all()


class _WaitingSocket:
    """ipykernel's iopub socket, with a send that waits for the host instead of failing.

    The socket has ``XPUB_NODROP`` and a send timeout: a send finds the host's queue full,
    marks the gate held and retries until the host has read (or the kernel is stopping).
    Everything else is the socket's own.
    """

    def __init__(self, sock: Any, gate: Gate, thread: Any, zmq: Any) -> None:
        self._sock = sock
        self._gate = gate
        self._thread = thread
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def send_multipart(self, parts: Any, flags: int = 0, **kwargs: Any) -> Any:
        if flags & self._noblock:
            return self._sock.send_multipart(parts, flags, **kwargs)
        try:
            return self._sock.send_multipart(parts, flags | self._noblock, **kwargs)
        except self._again:
            pass
        self._gate.hold()
        try:
            while True:
                try:
                    return self._sock.send_multipart(parts, flags, **kwargs)
                except self._again:
                    if getattr(self._thread, "_stopped", False):
                        raise  # the kernel is shutting down: give up on this message
        finally:
            self._gate.release()


def install_flow_control(kernel: Any, streams: list[Any]) -> Gate | None:
    """Make the kernel's output wait for the host instead of being dropped (see the module's
    docstring); None when this ipykernel lacks what it needs (then nothing changes)."""
    zmq = sys.modules.get("zmq")
    thread: Any = getattr(kernel, "iopub_thread", None)
    sock = getattr(thread, "socket", None)
    if zmq is None or sock is None or not hasattr(zmq, "XPUB_NODROP"):
        return None
    needed = ("schedule", "send_multipart", "_really_send", "thread")
    if not all(hasattr(thread, name) for name in needed):
        return None
    try:
        if sock.getsockopt(zmq.TYPE) != zmq.XPUB:
            return None
    except Exception:
        return None
    gate = Gate()
    for owner in (thread, kernel):
        for name in ("thread", "control_thread", "shell_channel_thread"):
            ident = getattr(getattr(owner, name, None), "ident", None)
            if isinstance(ident, int):
                gate.exempt.add(ident)
    queue_send = thread.send_multipart
    really_send = thread._really_send

    def send_multipart(*args: Any, **kwargs: Any) -> Any:
        gate.queue()
        return queue_send(*args, **kwargs)

    def send_now(*args: Any, **kwargs: Any) -> Any:
        try:
            return really_send(*args, **kwargs)
        finally:
            gate.sent()

    def on_iopub_thread() -> None:
        # Socket options belong to the thread that uses the socket.
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        thread.socket = _WaitingSocket(sock, gate, thread, zmq)

    thread.send_multipart = send_multipart
    thread._really_send = send_now
    thread.schedule(on_iopub_thread)
    for stream in streams:
        _hold_writes(stream, gate)
        if hasattr(stream, "flush_timeout"):
            # A flush waits for the IOPub thread; ipykernel gives up after 10 s and the reply
            # would then leave before the output it counts. The host's deadline bounds it.
            stream.flush_timeout = 24 * 3600
    return gate


def _hold_writes(stream: Any, gate: Gate) -> None:
    original = stream.write

    def write(text: Any) -> Any:
        gate.wait()
        return original(text)

    stream.write = write


def decode_whole_characters(stream: Any) -> PipeReader | None:
    """Replace ipykernel's reader of a captured fd with a :class:`PipeReader`; None when the
    stream is not read that way (nothing done).

    Called once at install, when nothing else writes to the fd: the old reader is woken by one
    NUL byte (as ipykernel's own ``close`` does) and stops without forwarding it. It is waited
    for without a limit, as ``close`` does: given up on (it had 2 s, not always enough on a
    loaded machine), it went on reading, forwarded the NUL and left no reader to catch up with.
    """
    old = getattr(stream, "watch_fd_thread", None)
    fid = getattr(stream, "_fid", None)
    names = ("_should_watch", "_original_stdstream_fd", "_original_stdstream_copy")
    if old is None or not isinstance(fid, int) or not all(hasattr(stream, n) for n in names):
        return None
    if not old.is_alive() or not stream._should_watch or not hasattr(select, "poll"):
        return None
    stream._should_watch = False
    os.write(stream._original_stdstream_fd, b"\0")
    old.join()
    stream._should_watch = True
    reader = PipeReader(stream, fid)
    stream.watch_fd_thread = reader.thread
    reader.thread.start()
    return reader


class PipeReader:
    """Reads a captured fd's pipe into its stream, whole characters only, and says how far.

    It reads only while holding ``cond``, after ``poll`` said there is data, so under ``cond``
    the bytes it has taken plus those left in the pipe are all that was written to the fd so
    far; ``forwarded`` counts the bytes whose text the stream has (an incomplete character
    at the end of a read is kept for the next, and counted).
    """

    def __init__(self, stream: Any, fid: int) -> None:
        self.stream = stream
        self.fid = fid
        self.cond = threading.Condition()
        self.taken = 0  # bytes read from the pipe
        self.forwarded = 0  # bytes handed to the stream
        self.thread = threading.Thread(target=self._run, name="kernelexec fd reader", daemon=True)

    def catch_up(self) -> None:
        """Return once everything written to the fd before this call has reached the stream
        (at once when the pipe is empty and the reader holds nothing), or the reader stopped.

        Output written meanwhile (a subprocess still running) is not waited for.
        """
        with self.cond:
            target = self.taken + _unread(self.fid)
            while self.forwarded < target and self.thread.is_alive():
                self.cond.wait(0.5)  # SIGINT lands here as KeyboardInterrupt

    def _run(self) -> None:
        """ipykernel's ``_watch_pipe_fd`` with an incremental decoder and the counts."""
        stream = self.stream
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        poller = select.poll()
        poller.register(self.fid, select.POLLIN)
        try:
            while True:
                poller.poll()  # without the lock: a catch-up counts what waits in the pipe
                with self.cond:
                    data = os.read(self.fid, 1 << 16)  # returns at once: the pipe has data
                    self.taken += len(data)
                if not data or not stream._should_watch:
                    return
                text = decoder.decode(data)
                if text:
                    stream.write(text)
                with self.cond:
                    self.forwarded += len(data)
                    self.cond.notify_all()
                os.write(stream._original_stdstream_copy, data)
        except Exception:
            stream._exc = sys.exc_info()
        finally:
            with self.cond:
                self.cond.notify_all()  # a catch-up stops waiting for a reader that stopped


def _unread(fid: int) -> int:
    """Bytes waiting in the pipe ``fid``; 0 where that cannot be asked."""
    if fcntl is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(fid, termios.FIONREAD, b"\0" * 4))[0])
    except OSError:
        return 0
