"""Hostile probes whose outcome is documented rather than closed (``docs/security.md``): each
test pins the documented behaviour, so the document cannot drift from what holds.

* Kernels forked from one fork server share its stack canary and memory layout (a fork copies
  them; only a new process gets new ones); what Python can re-seed after a fork is re-seeded.
* At ``"none"`` the host's environment is readable through ``/proc/<JPY_PARENT_PID>/environ``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import uuid

import pytest

import kernelexec as kx
from kernelexec.backends import LocalBackend
from tests.hostile.conftest import needs_root

LAYOUT = r"""
import ctypes, random, uuid
fs = ctypes.c_ulong()
ctypes.CDLL(None).syscall(158, 0x1003, ctypes.byref(fs))  # arch_prctl(ARCH_GET_FS)
canary = ctypes.c_ulong.from_address(fs.value + 0x28).value
libc = next(line.split('-')[0] for line in open('/proc/self/maps') if 'libc' in line)
(canary, libc, random.random(), str(uuid.uuid4()))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads the x86-64 stack canary")
def test_forked_kernels_share_the_canary_and_layout_but_not_their_random_state() -> None:
    backend = LocalBackend()
    with kx.KernelExecutor(backend=backend) as ex:
        first = eval(ex.session("layout-a").run_code(LAYOUT).result or "")
        second = eval(ex.session("layout-b").run_code(LAYOUT).result or "")
    forked = backend.fork_server  # False with KERNELEXEC_NO_FORK_SERVER=1: plain launches
    canary_a, libc_a, random_a, uuid_a = first
    canary_b, libc_b, random_b, uuid_b = second
    # Re-seeded in every kernel: Python's random module (after fork), uuid4 / secrets (urandom).
    assert random_a != random_b and uuid_a != uuid_b
    # Fixed by the fork server: the canary and the address of the C library.
    assert (canary_a == canary_b) is forked
    assert (libc_a == libc_b) is forked


HOST = r"""
import os, sys
import kernelexec as kx
probe = (
    "import os\n"
    "try:\n"
    "    found = os.environ['KX_DOC_SECRET'] in open(\n"
    "        '/proc/%s/environ' % os.environ['JPY_PARENT_PID']).read()\n"
    "except KeyError:\n"
    "    found = 'no JPY_PARENT_PID'\n"
    "except OSError as exc:\n"
    "    found = type(exc).__name__\n"
    "found"
)
with kx.KernelExecutor(isolation=sys.argv[1], env_vars={"KX_DOC_SECRET": sys.argv[2]}) as ex:
    s = ex.session("env")
    print(s.run_code(probe).result)
"""


def _parent_environ_from(level: str) -> str:
    """Run a host process with a secret in its environment (where ``/proc/<pid>/environ``
    shows it); a kernel at ``level`` looks for it there (handed its value to compare)."""
    secret = uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-c", HOST, level, secret],
        env={**os.environ, "KX_DOC_SECRET": secret},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_at_none_the_hosts_environment_is_readable_through_the_parent() -> None:
    assert _parent_environ_from("none") == "True"


@needs_root
def test_at_process_the_parents_environment_is_not_readable() -> None:
    # Hidden altogether where the kernel's /proc hides other users' processes (a root host).
    assert _parent_environ_from("process") in (
        "'PermissionError'",
        "'FileNotFoundError'",
        "'no JPY_PARENT_PID'",
    )
