"""The package as users get it: a wheel that installs into a fresh venv and runs the demo, with its
licence, type marker and version (issue 30).

The wheel is built without build isolation from this venv's hatchling, and the fresh venv finds
kernelexec's dependencies through a ``.pth`` file naming this venv's site-packages: so the test
needs no package index (tests reach 127.0.0.1 only), while kernelexec itself comes from the wheel
alone, not from the source tree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"),
            *("--no-index", "-w", str(out), str(ROOT)),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("kernelexec-*.whl")
    return found


def test_the_wheel_carries_its_licence_type_marker_and_kernel_side(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "kernelexec/py.typed" in names
    assert "kernelexec/_protocol/_kernel_side.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)


def test_the_wheel_installs_in_a_fresh_venv_and_runs_the_demo(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # The dependencies (not kernelexec: this venv has it as an editable install of the tree).
    Path(site, "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    where = subprocess.run(
        [str(python), "-c", "import kernelexec; print(kernelexec.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert where.startswith(site), where  # the installed wheel, not the source tree
    version = subprocess.run(
        [str(env_dir / "bin" / "kernelexec"), "--version"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert version.stdout.strip() == f"kernelexec {metadata.version('kernelexec')}"
    demo = subprocess.run(
        [str(env_dir / "bin" / "kernelexec"), "demo", "--calls", "5", "--record", "rec"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert list((tmp_path / "rec").glob("*.ipynb")), demo.stdout


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_install_commands_install_what_exists(page: str) -> None:
    """kernelexec is on no package index: ``pip install kernelexec`` failed with 'No matching
    distribution' (issue 36). Every ``pip install`` of the Install section names a checkout
    (``.``) or a wheel that ``make dist`` builds, and every extra it names exists."""
    tomllib = pytest.importorskip("tomllib")
    text = (ROOT / page).read_text()
    section = text[text.index("## Install") :]
    section = section[: section.index("\n## ", 1)]
    targets = [
        line.split("#")[0].split()[2].strip("'\"")
        for line in section.splitlines()
        if line.startswith("pip install ")
    ]
    assert targets
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    for target in targets:
        found = re.fullmatch(
            r"(\.|dist/kernelexec-<version>-py3-none-any\.whl)(\[(\w[\w-]*)\])?", target
        )
        assert found, target
        assert found.group(3) is None or found.group(3) in extras, target
    assert "make dist" in section
