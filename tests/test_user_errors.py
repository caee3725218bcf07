"""Messages a new user meets, made clear (issue 30): each names what was wrong and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kernelexec as kx


def kernelexec(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelexec", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        input=stdin,
    )


def test_a_temp_dir_too_long_for_ipc_sockets_says_so_and_what_to_do(tmp_path: Path) -> None:
    long_dir = tmp_path / ("t" * max(10, 110 - len(str(tmp_path))))
    long_dir.mkdir()
    proc = kernelexec("exec", "1 + 1", env={**os.environ, "TMPDIR": str(long_dir)})
    assert proc.returncode == 1
    assert "too long for a kernel's ipc sockets" in proc.stderr
    assert "TMPDIR" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(long_dir.iterdir()) == []  # nothing was made there


@pytest.mark.parametrize(
    ("requirements", "named"),
    [
        (["pandas>>2"], "'pandas>>2' is not a valid requirement"),
        (["-e ."], "'-e .' is a pip option"),
    ],
)
def test_an_invalid_requirement_names_it(requirements: list[str], named: str) -> None:
    with pytest.raises(kx.ConfigError) as caught:
        kx.VenvEnv(requirements=requirements)
    assert named in str(caught.value)
    assert "errors.pydantic.dev" not in str(caught.value)
    assert "Value error" not in str(caught.value)


def test_the_cli_names_its_flag_not_the_librarys_keyword(tmp_path: Path) -> None:
    source = tmp_path / "two.py"
    source.write_text("def a():\n    pass\n\n\ndef b():\n    pass\n")
    proc = kernelexec("run", str(source))
    assert proc.returncode == 2
    assert "pass --name NAME" in proc.stderr
    assert "name=" not in proc.stderr


def test_exec_shows_the_traceback_of_an_error() -> None:
    code = textwrap.dedent(
        """
        def inner():
            raise KeyError("missing-key")

        inner()
        """
    )
    proc = kernelexec("exec", "-", stdin=code)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert "inner()" in proc.stderr  # the frame that called it
    assert "error (exception): KeyError: 'missing-key'" in proc.stderr
    assert "\x1b[" not in proc.stderr  # not a terminal: no colour codes


@pytest.mark.parametrize(
    ("args", "hint"),
    [(["exec", "--agnet", "a", "1"], "did you mean --agent?"), (["rnu"], "did you mean run?")],
)
def test_a_mistyped_flag_or_command_gets_a_suggestion(args: list[str], hint: str) -> None:
    proc = kernelexec(*args)
    assert proc.returncode == 2
    assert hint in proc.stderr


def test_help_and_version_do_not_import_the_library() -> None:
    probe = textwrap.dedent(
        """
        import contextlib, io, sys
        from kernelexec._cli._main import main
        for argv in (["--help"], ["--version"], ["exec", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(argv)
                except SystemExit as exit:
                    assert exit.code == 0, (argv, exit.code)
            assert out.getvalue(), argv
        heavy = {"pydantic", "jupyter_client", "zmq", "jsonschema", "nbformat", "IPython"}
        print(sorted(heavy & set(sys.modules)))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "[]"


def test_version_flag_prints_the_installed_version() -> None:
    proc = kernelexec("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kernelexec {kx.__version__}"
