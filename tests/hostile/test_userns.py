"""Hostile: a tenant must not make itself "root" in a user namespace of its own.

Seen before the fix: under bubblewrap (and at ``"process"``) ``unshare -U -r id`` printed
``uid=0(root)``, opening the kernel's namespace-only code paths to the tenant.
"""

from __future__ import annotations

import shutil

import pytest

import kernelexec as kx
from tests.hostile.conftest import needs_bwrap, needs_root

TRY = r"""
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
direct = libc.unshare(0x10000000)  # CLONE_NEWUSER
direct = (direct, ctypes.get_errno())
tool = subprocess.run(['unshare', '-U', '-r', 'id', '-u'], capture_output=True, text=True)
worker = threading.Thread(target=lambda: None)
worker.start()
worker.join()
(direct, tool.returncode, tool.stdout.strip(), subprocess.run(['true']).returncode)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) here")
@pytest.mark.parametrize(
    "level", [pytest.param("process", marks=needs_root), pytest.param("bwrap", marks=needs_bwrap)]
)
def test_kernels_cannot_create_user_namespaces(level: str) -> None:
    with kx.KernelExecutor(isolation=level) as ex:
        s = ex.session("userns")
        assert "no user namespaces" in s.isolation.boundaries["processes"]
        result = s.run_code(TRY)
    assert result.ok, result.error
    direct, code, printed, spawned = eval(result.result or "")
    assert direct == (-1, 1)  # EPERM
    assert code != 0 and printed != "0"
    assert spawned == 0  # threads and subprocesses still work (clone3 falls back to clone)
