"""Hostile: a Letta tool writes ``requirements.txt`` (and a package to build) into its
``sandbox_dir``; the adapter reads that file and builds what it names on the next run.

Seen before the fix: the build ran as root with the host's environment (a host secret in it);
a ``requirements.txt`` replaced by a symbolic link to a root-only file showed that file's
content in the ``EnvSetupError`` message. Since issue 21 item 7 a kernel with a user of its own
gets ``sandbox_dir`` copy on write: what a tool writes there stays in its agent's session and
never reaches the host's directory, so the host never reads it. What someone else puts in the
directory (another local user, where it is writable by all) is still built as a kernel user
without the host's secrets, and a link there is still refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelexec import ConfigError
from kernelexec.compat import letta
from kernelexec.compat.letta import AsyncToolSandboxKernel
from tests.hostile.conftest import needs_root
from tests.hostile.test_builds import make_package
from tests.support.letta_models import (
    LocalSandboxConfig,
    SandboxConfig,
    User,
    create_tool_from_func,
)

ROOT = str(Path(__file__).resolve().parent.parent.parent)
pytestmark = [pytest.mark.anyio, needs_root, pytest.mark.slow]


def plant(files: dict, link: str = "") -> str:  # type: ignore[type-arg]
    """Write files into the working directory (the sandbox dir); or make requirements.txt a
    symbolic link to ``link``."""

    os.umask(0o022)  # readable by whoever builds it
    if link:
        os.symlink(link, "requirements.txt")
        return "linked"
    for rel, text in files.items():
        os.makedirs(os.path.dirname(rel) or ".", exist_ok=True)
        with open(rel, "w") as fh:
            fh.write(text)
    return os.getcwd()


def report(name: str) -> str:
    """What the planted package's build backend saw."""
    import importlib

    return importlib.import_module(name).SEEN


@pytest.fixture
def sandbox_dir() -> Iterator[Path]:
    """A shared tool directory every user can write (as Letta's tool_execution_dir is to the
    tools it runs), outside /tmp (kernels have their own)."""
    path = Path(tempfile.mkdtemp(prefix="kxletta-", dir="/run"))
    path.chmod(0o1777)
    letta.configure(env_vars={"PYTHONPATH": ROOT})
    try:
        yield path
    finally:
        letta.shutdown()
        letta.configure()
        for entry in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
            if entry.is_dir() and not entry.is_symlink():
                entry.rmdir()
            else:
                entry.unlink()
        path.rmdir()


async def _run(fn: Any, args: dict[str, Any], where: Path) -> Any:
    config = SandboxConfig(
        config=LocalSandboxConfig(sandbox_dir=str(where), use_venv=True).model_dump(
            exclude_none=True
        )
    )
    tool = create_tool_from_func(fn)
    sandbox = AsyncToolSandboxKernel(
        tool.name, args, User(), tool_id=tool.id, tool_object=tool, sandbox_config=config
    )
    return await sandbox.run()


def listing() -> list[str]:
    """What the tool sees in its sandbox_dir."""
    return sorted(os.listdir("."))


async def test_a_tool_written_requirement_never_reaches_the_host(
    sandbox_dir: Path, tmp_path: Path
) -> None:
    name = f"kxletta{uuid.uuid4().hex[:8]}"
    pkg = make_package(tmp_path, name, 9, "unused")
    files = {f"{name}/{p.name}": p.read_text() for p in pkg.iterdir()}
    files["requirements.txt"] = f"./{name}\n"
    planted = await _run(plant, {"files": files}, sandbox_dir)
    assert planted.status == "success", planted.stderr
    assert await asyncio.to_thread(os.listdir, sandbox_dir) == []  # the host's is untouched
    seen = await _run(listing, {}, sandbox_dir)
    # The agent's own copy (its venv has no pydantic: Letta's str() of the list).
    assert seen.func_return == str(sorted([name, "requirements.txt"]))
    built = await _run(report, {"name": name}, sandbox_dir)
    # Not built: the source folder imports as a bare package, without the build's SEEN.
    assert built.status == "error"
    assert "has no attribute 'SEEN'" in built.func_return


async def test_a_requirement_someone_else_put_there_is_not_built_as_root_with_the_hosts_secrets(
    sandbox_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("KX_HOST_SECRET", secret)
    name = f"kxletta{uuid.uuid4().hex[:8]}"
    pkg = make_package(tmp_path, name, 9, secret)
    cwd = os.getcwd()
    os.chdir(sandbox_dir)
    try:  # as another local user would, in a directory every user may write
        plant({f"{name}/{p.name}": p.read_text() for p in pkg.iterdir()})
        plant({"requirements.txt": f"./{name}\n"})
    finally:
        os.chdir(cwd)
    built = await _run(report, {"name": name}, sandbox_dir)
    assert built.status == "success", built.stderr
    seen = json.loads(built.func_return)
    assert seen["uid"] >= 2_000_000_000
    assert seen["secret"] is False


async def test_a_symlinked_requirements_txt_does_not_show_a_root_only_file(
    sandbox_dir: Path, tmp_path: Path
) -> None:
    secret = f"kxsecret{uuid.uuid4().hex}"
    hidden = tmp_path / "root-only.txt"
    hidden.write_text(f"{secret}\n")
    hidden.chmod(0o600)
    os.symlink(hidden, sandbox_dir / "requirements.txt")  # planted by another local user
    with pytest.raises(ConfigError) as caught:
        await _run(report, {"name": "anything"}, sandbox_dir)
    assert secret not in str(caught.value)
    assert "symbolic link" in str(caught.value)
    assert (sandbox_dir / "requirements.txt").is_symlink()
