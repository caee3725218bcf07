"""Hostile: what a kernel writes to the shared scratch places (``/tmp``, ``/var/tmp``,
``/dev/shm``, SysV shared memory) stays its own, is bounded by ``max_disk_mb`` and is gone when
the kernel is.

Seen before the fix: a SysV segment and a ``/dev/shm`` file of the kernel's uid outlived the
executor; at ``"process"`` one tenant planted files and symlinks in the host's ``/tmp`` for the
next; 600 MB went to the temp dir with ``max_file_mb=20``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._sandbox._plan import disk_shares
from tests.hostile.conftest import needs_bwrap, needs_root

LEVELS = [
    pytest.param("process", marks=needs_root),
    pytest.param("bwrap", marks=needs_bwrap),
]

LEAVE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
segment = libc.shmget(0, 4 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600, never removed
placed = []
for place in ('/tmp', '/var/tmp', '/dev/shm'):
    path = os.path.join(place, NAME)
    try:
        with open(path, 'wb') as fh:
            fh.write(b'x' * (1 << 20))
        placed.append(path)
    except OSError:
        pass
try:
    os.symlink('/etc/passwd', '/tmp/' + NAME + '-link')
except OSError:
    pass
(os.getuid(), segment, placed)
"""


def _segments_of(uid: int) -> list[str]:
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()
    header = lines[0].split()
    at_uid = header.index("uid")
    return [line for line in lines[1:] if int(line.split()[at_uid]) == uid]


@pytest.mark.parametrize("level", LEVELS)
def test_scratch_places_are_private_and_gone_with_the_kernel(level: str) -> None:
    name = f"kx-left-{uuid.uuid4().hex}"
    with kx.KernelExecutor(isolation=level) as ex:
        a, b = ex.session("scratch-a"), ex.session("scratch-b")
        left = a.run_code(f"NAME = {name!r}\n" + LEAVE)
        assert left.ok, left.error
        uid, segment, placed = eval(left.result or "")
        assert segment >= 0 and len(placed) >= 2
        # The other tenant sees none of it: neither the files nor the planted link.
        seen = b.run_code(
            "import os; sorted(p for d in ('/tmp', '/var/tmp', '/dev/shm') if os.path.isdir(d) "
            f"for p in os.listdir(d) if p.startswith({name!r}))"
        )
        assert seen.result == "[]"
        # Nor does the host.
        for place in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not any(p.startswith(name) for p in os.listdir(place))
    if os.geteuid() == 0:
        assert _segments_of(uid) == []


@pytest.mark.parametrize("level", LEVELS)
def test_max_disk_mb_bounds_the_scratch_space(level: str) -> None:
    fill = r"""
import errno
written = 0
block = b'x' * (1 << 20)
try:
    with open(PLACE + '/fill', 'wb') as fh:
        for _ in range(200):
            fh.write(block)
            fh.flush()
            written += 1
except OSError as exc:
    assert exc.errno == errno.ENOSPC, exc
written
"""
    with kx.KernelExecutor(isolation=level, limits=kx.Limits(max_disk_mb=32)) as ex:
        s = ex.session("disk")
        assert s.isolation.limits["max_disk_mb"].startswith("32 (")
        # The scratch's share of the total (a quarter; halved between /tmp and /dev/shm at
        # "bwrap").
        share = disk_shares(32).scratch // (2 if level == "bwrap" else 1)
        tmp = s.run_code("PLACE = '/tmp'\n" + fill)
        assert tmp.ok, tmp.error
        assert share // 2 <= int(tmp.result or 0) <= share
        assert s.run_code("import os; os.unlink('/tmp/fill')").ok
        shm = s.run_code("PLACE = '/dev/shm'\n" + fill)
        assert shm.ok, shm.error
        assert share // 2 <= int(shm.result or 0) <= share


def test_max_disk_mb_is_refused_where_it_cannot_be_enforced() -> None:
    with pytest.raises(kx.ConfigError, match="isolation"):
        kx.KernelExecutor(isolation="none", limits=kx.Limits(max_disk_mb=64))
