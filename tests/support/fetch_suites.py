"""Fetch the agent frameworks' own test suites for ``make test`` (issue 27).

The frameworks ship their tests in their source distributions on PyPI, not in their wheels.
This script downloads the sdist of the installed version of each framework, once, and unpacks
the test files the adapter tests run into ``<dest>/<name>-<version>/``. Nothing of them is
committed here: the tests import them from there (and skip, saying why, when they are absent).

Usage: ``python tests/support/fetch_suites.py .cache/suites``
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

# distribution -> the members of its sdist (below its top folder) the adapter tests use
SUITES: dict[str, tuple[str, ...]] = {
    "smolagents": ("tests/test_remote_executors.py",),
}

# A file the suite imports but its sdist lacks: smolagents' `tests/utils/markers.py`, whose
# `require_run_all` marks tests that need real cloud services (skipped unless RUN_ALL is set).
SHIMS = {
    "smolagents": {
        "tests/__init__.py": "",
        "tests/utils/__init__.py": "",
        "tests/utils/markers.py": (
            "import os\nimport pytest\n\n"
            "require_run_all = pytest.mark.skipif(\n"
            "    not os.getenv('RUN_ALL'), reason='needs the real cloud service (RUN_ALL=1)'\n"
            ")\n"
        ),
    },
}


def fetch(dist: str, dest: Path) -> Path | None:
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        print(f"{dist} is not installed: its suite is not fetched", file=sys.stderr)
        return None
    target = dest / f"{dist}-{version}"
    if (target / ".complete").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-deps"),
                *("--no-binary", ":all:", "-d", tmp, f"{dist}=={version}"),
            ],
            check=True,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            top = archive.getnames()[0].split("/")[0]
            for member in SUITES[dist]:
                info = archive.getmember(f"{top}/{member}")
                data = archive.extractfile(info)
                if data is None:
                    raise RuntimeError(f"{member} is not a file in {sdist.name}")
                path = target / member
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data.read())
    for member, text in SHIMS.get(dist, {}).items():
        path = target / member
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (target / ".complete").write_text(f"{dist}=={version} from its sdist on the package index\n")
    return target


def main() -> int:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/suites")
    failed = 0
    for dist in SUITES:
        try:
            where = fetch(dist, dest)
        except (OSError, subprocess.CalledProcessError, RuntimeError, KeyError) as exc:
            print(f"could not fetch {dist}'s test suite: {exc}", file=sys.stderr)
            failed += 1
            continue
        if where is not None:
            print(f"{dist}: {where}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
