"""``kernelexec repl``: an interactive prompt on a persistent kernel that behaves like Python's.

Ctrl-C at the prompt drops the line; Ctrl-C while code runs interrupts the code (the kernel and
its state live on, the code ends with ``KeyboardInterrupt``); ``exit``, ``quit`` (with or
without parentheses) and Ctrl-D leave the REPL, and leaving shuts the kernel down. Output is
shown as the code prints it.
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from kernelexec._aio import wait_released
from kernelexec._models import Execution
from kernelexec._sync import KernelExecutor, Session

_LEAVE = re.compile(r"(exit|quit)\s*(\(\s*\))?")
BANNER = "kernelexec repl: a persistent kernel; Ctrl-C interrupts, exit or Ctrl-D quits."


def run_repl(executor_config: dict[str, Any], agent: str) -> str | None:
    """Read, run and print until the user leaves; the recording's path, if it records."""
    from IPython.core.inputtransformer2 import TransformerManager
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    completeness = TransformerManager()  # type: ignore[no-untyped-call]
    prompt: PromptSession[str] = PromptSession(history=InMemoryHistory())

    def read() -> str | None:
        """One complete input (None: Ctrl-D); Ctrl-C drops what was typed."""
        while True:
            lines: list[str] = []
            try:
                lines.append(prompt.prompt(">>> "))
                status, indent = completeness.check_complete("\n".join(lines) + "\n")
                while status == "incomplete":
                    lines.append(prompt.prompt("... ", default=" " * (indent or 0)))
                    if not lines[-1].strip():
                        break
                    status, indent = completeness.check_complete("\n".join(lines) + "\n")
            except KeyboardInterrupt:
                print("KeyboardInterrupt", file=sys.stderr)
                continue
            except EOFError:
                return None
            return "\n".join(lines)

    print(BANNER, file=sys.stderr)
    with (
        KernelExecutor(**executor_config) as ex,
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kx-repl") as worker,
    ):
        session = ex.session(agent)
        while True:
            code = read()
            if code is None or _LEAVE.fullmatch(code.strip()):
                break
            if not code.strip():
                continue
            result = _run(worker, session, code)
            _show(result)
            if result.error is not None and result.error.ename == "KernelExited":
                break  # the code asked the kernel to exit (exit() inside a block, say)
        path = session.record_path
    return str(path) if path is not None else None


def _run(worker: concurrent.futures.Executor, session: Session, code: str) -> Execution:
    """Run ``code`` on a worker thread, so that Ctrl-C reaches this (the main) thread while the
    code runs: each one interrupts the kernel, and the run's result is waited for.

    The wait is :func:`~kernelexec._aio.wait_released` on a bare lock the worker releases,
    not ``Future.result()``: a SIGINT that another thread of this process received does not
    wake a main thread blocked there, and the Ctrl-C then interrupted nothing until the code
    ended (its timeout). The outcome is set before the lock is released, so a Ctrl-C that
    lands once the wait is over still finds it.
    """
    outcome: list[Execution | BaseException] = []
    finished = threading.Lock()
    finished.acquire()

    def run() -> None:
        try:
            outcome.append(
                session.run_code(code, on_stdout=_writer(sys.stdout), on_stderr=_writer(sys.stderr))
            )
        except BaseException as exc:
            outcome.append(exc)
        finally:
            finished.release()

    worker.submit(run)
    while not outcome:
        try:
            wait_released(finished)
        except KeyboardInterrupt:
            session.interrupt()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _writer(stream: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


def _show(result: Execution) -> None:
    """What the run left to show after its streamed output: its value, or its error."""
    if result.result is not None:
        print(result.result)
    if result.error is not None:
        print(
            f"error ({result.error.kind}): {result.error.ename}: {result.error.evalue}",
            file=sys.stderr,
        )
