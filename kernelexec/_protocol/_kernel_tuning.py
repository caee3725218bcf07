"""Install-time tuning of ipykernel and IPython inside the kernel: less memory, less work per call.

Like ``_kernel_side.py`` this module is never imported by the host: its source rides in the
install request and is executed in the kernel (as ``__kernelexec_tuning__``), standard library
only. Each function changes one thing the kernel does that kernelexec measured as costly (no
output history, no empty flushes, faster header dates, no discarded debug records, the heap
given back) or that loses output (the wait for fd-level output at the end of a run); the
kernel side's ``install`` decides which apply.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import select
import sys
import time
from typing import Any


class _NoOutputHistory(dict):  # type: ignore[type-arg]
    """Stands in for IPython's output and exception history: everything put in is dropped.

    IPython 9 keeps every printed byte, displayed bundle (``%history -o``) and formatted
    traceback of a kernel's lifetime there.
    """

    def __missing__(self, key: Any) -> list[Any]:
        return []

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def keep_no_output_history(shell: Any) -> None:
    # ``_tee`` is IPython 9's per-cell wrapper of sys.stdout/err.write that fills the history.
    shell._tee = lambda channel: contextlib.nullcontext()
    if hasattr(shell, "_format_exception_for_storage"):
        shell._format_exception_for_storage = lambda *args, **kwargs: None  # formats it again
    history = getattr(shell, "history_manager", None)
    for name in ("outputs", "exceptions"):
        if history is not None and hasattr(history, name):
            setattr(history, name, _NoOutputHistory())


def skip_empty_flush(stream: Any) -> None:
    """Make ``flush()`` return at once when nothing is buffered.

    ipykernel flushes stdout and stderr several times per execution, and each flush is a round
    trip to its IOPub thread even with nothing to send (about a tenth of a warm call's kernel
    time, measured with py-spy). A write always sets ``_flush_pending`` until its data is
    flushed, so when neither flag is set there is nothing a flush could send.
    """
    original = stream.flush
    if not hasattr(stream, "_flush_pending"):
        return  # an ipykernel without these internals: keep its behaviour

    def flush() -> None:
        if stream._flush_pending or getattr(stream, "_subprocess_flush_pending", False):
            original()

    stream.flush = flush


def wait_for_fd_output(readers: list[Any], streams: list[Any]) -> None:
    """Let the fd-capture threads hand over output written before the run ended.

    C-level and subprocess output reaches the kernel through a pipe that a thread reads; at the
    end of a run some of it may be in the pipe still, or read but not yet written to the stream,
    and it would then be sent after the run is over (and lost to the caller). kernelexec's own
    readers (``_kernel_output.PipeReader``) say exactly when they have caught up. For a stream
    still read by ipykernel's thread (an ipykernel the reader does not fit) this can only wait
    while its pipe has data, at most 50 ms, and a moment for the chunk in the thread's hands.
    """
    for reader in readers:
        reader.catch_up()
    fds = [s._fid for s in streams if isinstance(getattr(s, "_fid", None), int)]
    if not fds:
        return
    deadline = time.monotonic() + 0.05
    waited = False
    poller = select.poll()  # not select(): a descriptor above 1023 is fine here
    for fd in fds:
        poller.register(fd, select.POLLIN)
    while time.monotonic() < deadline:
        try:
            readable = [fd for fd, ev in poller.poll(0) if ev & select.POLLIN]
        except (OSError, ValueError):
            return
        if not readable:
            break
        waited = True
        time.sleep(0.0005)
    if waited:
        time.sleep(0.001)  # the reader holds the last chunk for a moment before writing it


def fast_dates() -> None:
    """Parse the dates in every incoming message's headers with ``datetime.fromisoformat``.

    jupyter-client's ``Session.deserialize`` parses them with dateutil, about 12 us per header
    and a twelfth of a served call's kernel time (py-spy). Python 3.11's ``fromisoformat``
    reads the same ISO 8601 strings to the same values; anything it refuses (and every
    string on older Pythons) goes the original way.
    """
    # Already imported by ipykernel; looked up, not imported (this module is standard library
    # only: another kernel may lack jupyter-client).
    session = sys.modules.get("jupyter_client.session")
    jsonutil = sys.modules.get("jupyter_client.jsonutil")
    if session is None or jsonutil is None:
        return
    original: Any = getattr(session, "extract_dates", None)
    pattern = getattr(jsonutil, "ISO8601_PAT", None)
    ensure_tz = getattr(jsonutil, "_ensure_tzinfo", None)
    if original is None or pattern is None or ensure_tz is None or sys.version_info < (3, 11):
        return

    def extract_dates(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {key: extract_dates(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [extract_dates(item) for item in obj]
        if isinstance(obj, str) and pattern.match(obj):
            try:
                return ensure_tz(datetime.datetime.fromisoformat(obj))
            except ValueError:
                return original(obj)
        return obj

    setattr(session, "extract_dates", extract_dates)  # noqa: B010 (not exported: mypy)


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system once the kernel is up.

    Starting a kernel leaves a few MiB of freed, still-resident heap (its configuration,
    compiling this module): returned, an idle forked kernel holds about 2 MiB less
    (glibc's ``malloc_trim``, measured; 1 ms). Elsewhere nothing happens.
    """
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def quiet_debug_log(kernel: Any) -> None:
    """Raise the kernel logger's level to what its handlers let through.

    traitlets sets an application's logger to DEBUG and filters in its handler, so each of the
    debug lines ipykernel logs for every message builds a log record that is then thrown away
    (about a tenth of a served call's kernel time, measured with py-spy).
    """
    log = getattr(kernel, "log", None)
    handlers = getattr(log, "handlers", None)
    if not isinstance(log, logging.Logger) or not handlers or log.level > logging.DEBUG:
        return
    least = min(h.level for h in handlers)
    if least > logging.DEBUG and not log.propagate:
        log.setLevel(least)
