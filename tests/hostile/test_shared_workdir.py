"""Hostile: two executors given one ``workdir`` must not share session directories.

Seen before the fix: the second executor's kernel for the same agent id got the first's
directory (handed over to its own user), read the first tenant's secret and took the directory.
"""

from __future__ import annotations

from pathlib import Path

import kernelexec as kx


def test_two_executors_sharing_a_workdir_get_separate_session_directories(
    tmp_path: Path,
) -> None:
    work = tmp_path / "shared"
    with kx.KernelExecutor(workdir=work) as one, kx.KernelExecutor(workdir=work) as two:
        first, second = one.session("agent"), two.session("agent")
        assert first.run_code("open('secret.txt', 'w').write('first only')").ok
        assert first.workdir != second.workdir
        cwd = second.run_code("import os; os.getcwd()").result
        assert cwd == repr(str(second.workdir))
        stolen = second.run_code(f"open({str(first.workdir / 'secret.txt')!r}).read()")
        assert stolen.result != "'first only'"
        # The first tenant still owns its directory and its file.
        assert first.run_code("open('secret.txt').read()").result == "'first only'"
    assert (work / "agent" / "secret.txt").read_text() == "first only"
