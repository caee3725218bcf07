"""What a run skipped, counted by reason, and a guard that fails a run with a skip its machine
should not need (hooks in ``tests/conftest.py``).

A host without root, bubblewrap, cgroups or the package index skips much of the hostile and
conformance suites, and such a run is green. ``.ci/run`` sets :data:`EXPECTED_ENV` to a file
naming the skips the CI machine may see (``.ci/expected-skips``); any other skip fails the run.

The file holds one regular expression a line, searched in ``"<test file>: <reason>"``; ``#``
starts a comment line. A line ``NAME=value <regex>`` applies only while the environment
variable ``NAME`` has that value (the fallback pass switches fork servers off, for one).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

EXPECTED_ENV = "KERNELEXEC_EXPECTED_SKIPS"

_CONDITION = re.compile(r"^([A-Z][A-Z0-9_]*)=(\S*)\s+(.+)$")


@dataclass(frozen=True)
class Skip:
    """One skipped test (or module): where the skip was raised, and why."""

    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def skip_of(report: pytest.CollectReport | pytest.TestReport) -> Skip | None:
    """The skip a report records, or None (it passed, failed, or is an expected failure)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, _, reason = longrepr
    else:
        path, reason = report.nodeid.split("::")[0], str(longrepr)
    where = Path(str(path))
    if where.is_absolute() and where.is_relative_to(Path.cwd()):
        where = where.relative_to(Path.cwd())
    return Skip(where.as_posix(), str(reason).removeprefix("Skipped: "))


def expected(text: str, env: dict[str, str]) -> list[re.Pattern[str]]:
    """The patterns of an expected-skips file (see the module docstring) that apply in ``env``."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        condition = _CONDITION.match(line)
        if condition is not None:
            name, value, line = condition.groups()
            if env.get(name, "") != value:
                continue
        patterns.append(re.compile(line))
    return patterns


def unexpected(skips: list[Skip], patterns: list[re.Pattern[str]]) -> list[Skip]:
    """The skips no pattern allows."""
    return [s for s in skips if not any(p.search(str(s)) for p in patterns)]


def summary(skips: list[Skip]) -> list[str]:
    """The skip count and each reason with how many tests it skipped, most first."""
    counts = Counter(str(s) for s in skips)
    lines = [f"{len(skips)} skipped"]
    lines += [f"{n:4d} x {what}" for what, n in counts.most_common()]
    return lines


class Guard:
    """Collects the run's skips (on the xdist controller, the workers' reports too) and,
    where :data:`EXPECTED_ENV` names a file, fails the run on a skip it does not allow."""

    def __init__(self) -> None:
        self.skips: list[Skip] = []
        self.refused: list[Skip] = []
        self.file = os.environ.get(EXPECTED_ENV, "")

    def note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        skip = skip_of(report)
        if skip is not None:
            self.skips.append(skip)

    def finish(self, session: pytest.Session) -> None:
        if not self.file:
            return
        allowed = expected(Path(self.file).read_text(), dict(os.environ))
        self.refused = unexpected(self.skips, allowed)
        if self.refused and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def report(self, write: pytest.TerminalReporter) -> None:
        if not self.skips:
            return
        write.section("skips")
        for line in summary(self.skips):
            write.line(line)
        if self.refused:
            write.line(
                f"{len(self.refused)} skipped that {self.file} does not expect on this "
                "machine (the run fails):",
                red=True,
            )
            for line in summary(self.refused)[1:]:
                write.line(line, red=True)
