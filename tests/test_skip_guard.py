"""The guard on skips (``tests/support/skips.py``, issue 42): a run prints what it skipped and
why, and under ``.ci/run`` fails on a skip the CI machine should not need."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.skips import EXPECTED_ENV, Skip, expected, unexpected

ROOT = Path(__file__).resolve().parent.parent
CI_FILE = ROOT / ".ci" / "expected-skips"
TARGET = (
    "tests/test_docs_extras.py::test_example_runs_with_only_what_its_page_names[docs/gateway.md:9]"
)
"""A test that skips on every machine: an example the documentation marks as not run."""

NO_BWRAP = Skip(
    "tests/hostile/test_reaping.py", "bubblewrap is not installed (apt-get install -y bubblewrap)"
)
NOT_FETCHED = Skip(
    "tests/test_smolagents.py",
    "smolagents' suite was not fetched into /x/.cache/suites/smolagents-1.26.0/tests "
    "(make test fetches it)",
)
NO_FORK_SERVER = Skip(
    "tests/test_forkserver.py", "fork servers are off here (no pidfds, or switched off)"
)


def test_the_ci_machine_may_skip_none_of_the_hostile_suite_nor_the_upstream_suites() -> None:
    allowed = expected(CI_FILE.read_text(), {})
    assert unexpected([NO_BWRAP, NOT_FETCHED, NO_FORK_SERVER], allowed) == [
        NO_BWRAP,
        NOT_FETCHED,
        NO_FORK_SERVER,
    ]
    documented = Skip("tests/test_docs_extras.py", "needs a running Jupyter Kernel Gateway")
    assert unexpected([documented], allowed) == []


def test_a_line_with_a_condition_applies_only_under_it() -> None:
    text = "# comment\n\nKERNELEXEC_NO_FORK_SERVER=1 ^tests/test_forkserver\\.py: fork servers\n"
    assert unexpected([NO_FORK_SERVER], expected(text, {})) == [NO_FORK_SERVER]
    off = {"KERNELEXEC_NO_FORK_SERVER": "1"}
    assert unexpected([NO_FORK_SERVER], expected(text, off)) == []
    assert unexpected([NO_BWRAP], expected(text, off)) == [NO_BWRAP]


def _pytest(expected_file: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != EXPECTED_ENV}
    if expected_file is not None:
        env[EXPECTED_ENV] = str(expected_file)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", TARGET],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_run_prints_its_skips_and_fails_on_one_not_expected(tmp_path: Path) -> None:
    reason = "tests/test_docs_extras.py: needs a running Jupyter Kernel Gateway and its token"
    plain = _pytest(None)
    assert plain.returncode == 0, plain.stdout[-3000:]
    assert f"1 skipped\n   1 x {reason}\n" in plain.stdout
    nothing = tmp_path / "expected-skips"
    nothing.write_text("# no skip is expected\n")
    strict = _pytest(nothing)
    assert strict.returncode == 1, strict.stdout[-3000:]
    assert f"1 skipped that {nothing} does not expect on this machine" in strict.stdout
    assert strict.stdout.count(f"   1 x {reason}\n") == 2
    ci = _pytest(CI_FILE)
    assert ci.returncode == 0, ci.stdout[-3000:]
