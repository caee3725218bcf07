"""The documentation site as a reader gets it (issue 36): the API reference without raw Sphinx
roles, exceptions under their public names, the framework adapters; a home page that names every
capability; nothing loaded from the internet; and ``make demo`` with the base package only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # builds the whole site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    return out


def test_the_api_reference_renders_roles_and_public_names(site: Path) -> None:
    api = (site / "api" / "index.html").read_text()
    assert re.findall(r":(?:class|meth|func|attr|mod|data|exc):", api) == []
    assert 'href="#kernelexec.AsyncKernelExecutor"><code>AsyncKernelExecutor</code></a>' in api
    for name in ("KernelExecError", "ConfigError", "StateError", "ExecutionTimeout"):
        assert f'id="kernelexec.{name}"' in api
    assert 'id="kernelexec._exceptions' not in api  # (a link's tooltip may name it)
    for adapter in (
        "compat.smolagents.KernelPythonExecutor",
        "compat.pydantic_ai.KernelWorkspace",
        "compat.deepagents.KernelSandbox",
        "compat.openai_agents.KernelSandboxClient",
    ):
        assert f'id="kernelexec.{adapter}"' in api


def test_the_home_page_names_every_capability(site: Path) -> None:
    page = (site / "index.html").read_text()
    home = page[page.index("<article") : page.index("</article>")]  # the page, not the nav
    for page in ("durable", "branching", "files", "codemode", "observability", "frameworks"):
        assert f'href="{page}/"' in home
    assert 'href="scale/"' in home


def test_nothing_is_loaded_from_the_internet(site: Path) -> None:
    pages = [p.read_text() for p in site.rglob("*.html")]
    assert pages
    for text in pages:
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text


def test_the_opentelemetry_example_says_it_needs_the_sdk() -> None:
    text = (ROOT / "docs" / "observability.md").read_text()
    install = text.index("opentelemetry-sdk")
    assert install < text.index("from opentelemetry.sdk")
    assert text.rfind("```sh", 0, install) > text.rfind("```\n", 0, install)  # in a sh block


def test_make_demo_installs_the_base_package_only() -> None:
    plan = subprocess.run(
        ["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert plan.returncode == 0, plan.stderr
    installs = [line for line in plan.stdout.splitlines() if "pip install" in line]
    assert installs and installs[-1].endswith("pip install -q -e ."), plan.stdout
    assert "[dev]" not in plan.stdout
