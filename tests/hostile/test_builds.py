"""Hostile: building a tool-named requirement runs the requirement's own code (its build
backend); that code gets the isolation of the kernel that will use the venv, not the host's.

Seen before the fix: a ``# requirements:`` package's build backend ran as root with the host's
secrets and reached the host's loopback, even for a kernel at ``isolation="bwrap",
network=False``.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from tests.hostile.conftest import needs_bwrap, needs_root

BACKEND = r"""
import base64, hashlib, json, os, socket, zipfile

def _evidence():
    reached = False
    try:
        socket.create_connection(("127.0.0.1", int(os.environ.get("KX_PORT", "PORT"))), 2).close()
        reached = True
    except OSError:
        pass
    return {"uid": os.getuid(), "secret": "SECRET" in json.dumps(dict(os.environ)),
            "reached": reached}

def get_requires_for_build_wheel(config_settings=None):
    return []

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = "NAME-1.0"
    seen = json.dumps(_evidence())
    files = {"NAME/__init__.py": "SEEN = " + repr(seen) + "\n",
             dist + ".dist-info/METADATA": "Metadata-Version: 2.1\nName: NAME\nVersion: 1.0\n",
             dist + ".dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: t\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    name = dist + "-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as whl:
        for member, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(member + ",sha256=" + digest + "," + str(len(data)))
            whl.writestr(member, data)
        record.append(dist + ".dist-info/RECORD,,")
        whl.writestr(dist + ".dist-info/RECORD", "\n".join(record))
    return name
"""


def make_package(where: Path, name: str, port: int, secret: str) -> Path:
    """A package whose in-tree build backend builds a one-module wheel holding what the
    backend could see and reach (``SEEN``, JSON)."""
    pkg = where / name
    pkg.mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "kxbackend"\nbackend-path = ["."]\n'
        f'[project]\nname = "{name}"\nversion = "1.0"\n'
    )
    source = BACKEND.replace("NAME", name).replace("PORT", str(port)).replace("SECRET", secret)
    (pkg / "kxbackend.py").write_text(source)
    return pkg


@pytest.fixture
def listener() -> Iterator[int]:
    """A port on the host's loopback that a build must not reach."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize(
    "level", [pytest.param("process"), pytest.param("bwrap", marks=needs_bwrap)]
)
def test_a_requirements_build_backend_runs_under_the_kernels_isolation(
    level: str,
    tmp_path: Path,
    listener: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("KX_HOST_SECRET", secret)
    name = f"kxbuilt{uuid.uuid4().hex[:8]}"
    pkg = make_package(tmp_path / "src", name, listener, secret)
    tool = kx.Tool.from_source(
        f"def use() -> str:\n    import {name}\n    return {name}.SEEN\n",
        pip_requirements=[str(pkg)],
    )
    with kx.KernelExecutor(isolation=level, cache_dir=tmp_path / "cache") as ex:
        result = ex.call_tool(tool, {})
    assert result.ok, result.error
    seen = json.loads(result.func_return)
    assert seen["uid"] >= 2_000_000_000
    assert seen["secret"] is False
    # "process" keeps the host's network (the level does); bwrap without network takes it.
    assert seen["reached"] is (level == "process")
    # What the build made belongs to the host afterwards.
    venvs = [p for p in (tmp_path / "cache" / "envs").iterdir() if not p.name.startswith(".")]
    assert venvs and all(os.lstat(p).st_uid == 0 for v in venvs for p in [v, *v.rglob("*")])
