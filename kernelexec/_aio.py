"""Event-loop helpers: awaiting work that must end even when its caller is cancelled (stopping
code, shutdowns), and :class:`LoopThread`, the loop on a thread of its own that code outside a
loop hands its coroutines to.

``asyncio.shield`` alone does not finish such work: the shielded work goes on, but the caller
returns at once, and under anyio's task groups a cancelled caller is cancelled again at every
later await, so work that was meant to finish first (deleting a gateway kernel, replacing a
stuck one) is left running on its own, or never finishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def finish_shielded(work: Awaitable[T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled (again) meanwhile, and return
    its result; those cancellations are absorbed (the caller raises its own afterwards)."""
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise


async def finish_then_cancel(work: Awaitable[T]) -> T:
    """:func:`finish_shielded`, then raise ``CancelledError`` if the caller was cancelled
    while ``work`` ran: the cancellation waits for the work instead of being lost."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def call_blocking(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` on ``loop`` (running in another thread) and wait for its result.

    When the wait ends early (Ctrl-C in the waiting thread), ``work`` is cancelled on its loop.
    ``work`` runs in a copy of the caller's context (``call_soon_threadsafe`` copies it), so
    the caller's OpenTelemetry span is its parent.

    The wait is on a bare lock that the loop releases, never on a lock both threads take: a
    ``KeyboardInterrupt`` lands between any two bytecodes of the waiting thread, inside
    ``threading`` and ``concurrent.futures`` too, and one landing there could leave such a
    lock taken, so that the loop thread then blocked on it for good and a Ctrl-C hung the
    program (``run_coroutine_threadsafe`` and ``Future.result`` did, under load). The main
    thread waits in slices (:func:`wait_released`): a SIGINT that another thread received
    is raised there too.
    """
    call: _BlockingCall[T] | None = None
    try:
        call = _BlockingCall(work)
        loop.call_soon_threadsafe(call.start)
    except BaseException as exc:
        if call is None or isinstance(exc, RuntimeError):  # not scheduled: it will never run
            work.close()
        else:  # interrupted: scheduled or not, the loop sorts it out (``cancel``)
            call.abandon(loop)
        raise
    try:
        return call.result()
    except BaseException:
        call.abandon(loop)
        raise


class _BlockingCall(Generic[T]):
    """One :func:`call_blocking`: ``start`` and ``cancel`` run on the loop, in the order they
    were scheduled; the waiting thread only acquires ``done``, which the loop releases once."""

    def __init__(self, work: Coroutine[Any, Any, T]) -> None:
        self._work = work
        self._task: asyncio.Task[T] | None = None
        self._done = threading.Lock()
        self._done.acquire()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._work)
        self._task.add_done_callback(lambda _: self._done.release())

    def cancel(self) -> None:
        if self._task is None:  # the caller was interrupted before ``start`` was scheduled
            self._work.close()
        else:
            self._task.cancel()

    def abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """The caller stops waiting: cancel the work on its loop (nothing if the loop ended)."""
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.cancel)

    def result(self) -> T:
        wait_released(self._done)
        assert self._task is not None
        if self._task.cancelled():
            raise concurrent.futures.CancelledError
        return self._task.result()


_SIGNAL_CHECK_S = 0.05
"""How long the main thread waits on a lock between two checks for a signal another thread
took (the longest a Ctrl-C then waits to be raised)."""


def wait_released(lock: threading.Lock) -> None:
    """Acquire ``lock``, which another thread releases; on the main thread, in slices that let
    a Ctrl-C through whichever thread the signal reached.

    Python raises ``KeyboardInterrupt`` in the main thread only, but the kernel hands a
    process-wide SIGINT to any thread that does not block it, and nothing wakes a main thread
    blocked on a lock when another thread took the signal: the interrupt then waited for the
    lock's release (the whole call). Another thread takes it when the main thread, woken for
    the signal, is not running yet (a busy host) and that thread changes its signal mask
    meanwhile, as every thread start and every subprocess launch does.
    """
    if threading.current_thread() is not threading.main_thread():
        lock.acquire()
        return
    while not lock.acquire(timeout=_SIGNAL_CHECK_S):
        pass  # a pending signal's handler runs here, between two bytecodes


async def await_on(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` on ``loop`` (running in another thread) and await it from the caller's own
    loop; cancelling the caller cancels ``work`` there."""
    return await asyncio.wrap_future(_submit(work, loop))


def _submit(
    work: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
) -> concurrent.futures.Future[T]:
    try:
        return asyncio.run_coroutine_threadsafe(work, loop)
    except RuntimeError:  # the loop is closed: ``work`` will never run
        work.close()
        raise


class LoopThread:
    """An event loop on a daemon thread of its own, for code that is not on that loop.

    The blocking facade and Letta's process-wide executor each own one (the framework adapters
    reach the facade's through :func:`call_blocking` and :func:`await_on`). It runs as
    ``asyncio.run`` does: when :meth:`stop` ends it, the calls still running are cancelled,
    async generators and the default executor's threads are shut down, and the loop is
    closed. Daemon: a host that never stops it can still exit (a ``weakref.finalize`` of the
    owner stops it at exit, the loop still running).

    Args:
        name: The thread's name (what a debugger or ``py-spy`` shows).
    """

    def __init__(self, name: str) -> None:
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._loop is None:  # asyncio.run itself failed (nothing else can fail there)
            self._thread.join()
            raise RuntimeError(f"the event loop of thread {name!r} did not start")

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._started.set()
        await self._done

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (closed once :meth:`stop` returned)."""
        assert self._loop is not None
        return self._loop

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped

    def is_current(self) -> bool:
        """Whether the calling thread is the loop's own (where a blocking call would hang)."""
        return threading.get_ident() == self._thread.ident

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop and wait for its result; see
        :func:`call_blocking`. Not from the loop's own thread (see :meth:`is_current`)."""
        return call_blocking(self.loop, fn(*args, **kwargs))

    async def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop and await it from another loop; see
        :func:`await_on`."""
        return await await_on(self.loop, fn(*args, **kwargs))

    def stop(self) -> None:
        """End the loop as ``asyncio.run`` ends (cancelling what still runs on it) and wait for
        the thread. Idempotent; from the loop's own thread it does not wait."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        done, loop = self._done, self.loop
        assert done is not None
        loop.call_soon_threadsafe(_resolve, done)
        if not self.is_current():
            self._thread.join()


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
