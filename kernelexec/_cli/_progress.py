"""Progress for people: a ``rich`` spinner on a terminal, plain lines on stderr otherwise."""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any

from kernelexec._envs._builder import EnvProgress


class ProgressDisplay:
    """Shows environment builds and other long steps on stderr (never on stdout).

    Use it as the executor's ``on_progress`` callback, and :meth:`step` around a long step. On a
    terminal a ``rich`` spinner shows the latest line; otherwise one plain line per phase.
    """

    def __init__(self, *, force_plain: bool = False) -> None:
        self._rich = sys.stderr.isatty() and not force_plain
        self._lock = threading.Lock()
        self._status: Any = None
        self._console: Any = None
        if self._rich:
            from rich.console import Console

            self._console = Console(stderr=True)

    def __call__(self, event: EnvProgress) -> None:
        with self._lock:
            tag = f"env {event.fingerprint[:8]}"
            if event.phase == "output":
                if self._status is not None:
                    self._status.update(f"[bold]{tag}[/] {_escape(event.message)[:100]}")
                return
            if event.phase in ("done", "reused", "failed"):
                self._stop()
                self._line(f"{tag}: {event.message}")
                return
            self._line(f"{tag}: {event.message}")
            self._start(f"[bold]{tag}[/] {_escape(event.message)}")

    def step(self, message: str) -> _Step:
        """A context manager showing ``message`` while the block runs."""
        return _Step(self, message)

    def _line(self, text: str) -> None:
        if self._rich:
            self._console.print(_escape(text), highlight=False)
        else:
            print(f"kernelexec: {text}", file=sys.stderr, flush=True)

    def _start(self, text: str) -> None:
        if not self._rich:
            return
        if self._status is None:
            self._status = self._console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def _stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


class _Step:
    def __init__(self, display: ProgressDisplay, message: str) -> None:
        self._display = display
        self._message = message

    def __enter__(self) -> None:
        with self._display._lock:
            self._display._start(_escape(self._message))

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._display._lock:
            self._display._stop()


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
