"""Hostile: a kernel that lies to the durable-session machinery (a staging directory that is a
link, a forged checkpoint naming a host file, a FIFO, a record name with a path in it). The
host takes only plain files from inside the staging directory and never follows a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._durable._store import agent_key

pytestmark = pytest.mark.slow

_FORGE = (
    "import os, sys\n"
    "st = sys.modules['__kernelexec_state__']\n"
    "staging = os.path.join(os.getcwd(), st.STAGING)\n"
    "real = st.save\n"
    "def forged(*a, **k):\n"
    "    os.makedirs(staging, exist_ok=True)\n"
    "    {plant}\n"
    "    return st._Answer({{'gen': 1, 'records': [{{'kind': 'raw', 'names': ['stolen'],\n"
    "        'file': {name!r}, 'size': {size}, 'crc': 0}}], 'unsaved': {{}}, 'environ': {{}}}})\n"
    "st.save = forged\n"
)


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    os.chmod(secret, 0o600)
    return secret


@pytest.mark.parametrize(
    ("plant", "name"),
    [
        ("os.symlink(SECRET, os.path.join(staging, NAME))", "r" + "a" * 24 + ".rec"),
        ("os.mkfifo(os.path.join(staging, NAME))", "r" + "b" * 24 + ".rec"),
        ("pass", "../../host-secret"),
    ],
    ids=["symlink-to-host-file", "fifo", "path-in-name"],
)
def test_a_forged_checkpoint_never_takes_a_host_file(tmp_path: Path, plant: str, name: str) -> None:
    secret = _secret(tmp_path)
    state = tmp_path / "state"
    with kx.KernelExecutor(state_dir=state, isolation="none") as ex:
        s = ex.session("liar")
        s.run_code("x = 1").raise_for_error()
        s.hibernate()  # installs the kernel side of durable state
        s.run_code("y = 2").raise_for_error()
        code = _FORGE.format(plant=plant, name=name, size=secret.stat().st_size)
        code = code.replace("SECRET", repr(str(secret))).replace("NAME", repr(name))
        s.run_code(code).raise_for_error()
        with pytest.raises(kx.StateError):
            s.hibernate()
        assert secret.read_text() == "host only"
        where = state / "agents" / agent_key("liar", "")
        for entry in where.iterdir():
            assert entry.is_file() and not entry.is_symlink()
            assert entry.read_bytes() != b"host only"
        kept = s.run_code("print(x, y)")  # a failed save keeps the kernel and its state
        assert kept.stdout == "1 2\n"


def test_a_staging_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    with kx.KernelExecutor(state_dir=state) as ex:
        s = ex.session("linker")
        s.run_code(
            f"import os\nos.symlink({str(elsewhere)!r}, '.kernelexec-state')\nz = 3"
        ).raise_for_error()
        with pytest.raises(kx.StateError):
            s.hibernate()
        assert s.run_code("print(z)").stdout == "3\n"
    assert list(elsewhere.iterdir()) == []
