"""Kernel code choosing the text the host logs: a newline (or a carriage return, a Unicode line
separator, an escape sequence) in an error message must not start a log line of its own. A log
reader, or a shipper that splits on lines, would take ``FORGED ...`` for a record of the host.

The records are read through a handler attached here, formatted as a plain text log would be.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._durable._kernel_state import HOOK_KEY

FORGED = "FORGED CRITICAL kernelexec: the audit log is clean"
LURE = f"ordinary failure\\n{FORGED}\\r{FORGED}\\u2028{FORGED}\\x1b[2K"


class _Lines(logging.Handler):
    """Every record of the ``kernelexec`` logger, formatted as a plain text log has it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(self.format(record))


@pytest.fixture
def logged() -> Iterator[_Lines]:
    logger = logging.getLogger("kernelexec")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _assert_not_forged(handler: _Lines) -> None:
    lines = [line for text in handler.text for line in text.splitlines()]
    assert any(FORGED in line for line in lines), "the lure never reached the log"
    forged = [line for line in lines if line.startswith("FORGED")]
    assert forged == [], forged
    assert not any("\x1b" in text for text in handler.text)


def echo(value: int) -> int:
    """Return what it got."""
    return value


def test_a_failed_code_mode_install_logs_the_kernels_message_on_one_line(
    logged: _Lines,
) -> None:
    with kx.KernelExecutor(default_timeout=30) as ex:
        s = ex.session("hostile-log-codemode")
        planted = s.run_code(
            "import sys, types\n"
            "fake = types.ModuleType('__kernelexec_codemode__')\n"
            f"def fail(*args):\n    raise RuntimeError('{LURE}')\n"
            "fake.install = fake._apply = fail  # what the install calls on a kept module\n"
            "sys.modules['__kernelexec_codemode__'] = fake\n"
        )
        assert planted.ok, planted.error
        out = s.run_code("print('still here')", host_functions=[echo])
    assert out.stdout == "still here\n"
    _assert_not_forged(logged)


def test_a_forged_checkpoint_failure_logs_on_one_line(tmp_path: Path, logged: _Lines) -> None:
    with kx.KernelExecutor(state_dir=tmp_path / "state", checkpoint="after_call") as ex:
        s = ex.session("hostile-log-state")
        assert s.run_code("x = 1").ok
        out = s.run_code(
            "import sys\n"
            "hooks = sys.modules['__kernelexec__']._state['report_hooks']\n"
            f"hooks[{HOOK_KEY!r}] = lambda: {{'error': '{LURE}'}}\n"
        )
        assert out.ok, out.error
    _assert_not_forged(logged)
