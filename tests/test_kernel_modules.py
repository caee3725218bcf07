"""Kernel halves ship one way: each is a real module, declared once as a ``KernelModule``, named
in the one standard-library import contract, installed by the one loader; and the host-wide
helpers are real modules whose processes show a short title, not their source."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli there
    import tomli as tomllib

import kernelexec as kx
from kernelexec import _proctitle
from kernelexec._protocol._install import KernelModule

ROOT = Path(__file__).resolve().parent.parent
# The feature modules that declare kernel halves (a new one is found by the file check below).
DECLARING = (
    "kernelexec._protocol._host",
    "kernelexec._files._wire",
    "kernelexec._codemode._exposure",
    "kernelexec._durable._keeper",
    "kernelexec._durable._transfer",
    "kernelexec._branching._process",
)
# What a kernel has besides the standard library (IPython, ipykernel), or may have (tried).
IN_A_KERNEL = {"IPython", "ipykernel", "cloudpickle", "__future__"}


def _declared() -> dict[str, KernelModule]:
    found: dict[str, KernelModule] = {}
    for name in DECLARING:
        for value in vars(importlib.import_module(name)).values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, KernelModule):
                    found[item.origin] = item
    return found


def _stdlib_contract() -> dict[str, Any]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    [contract] = [c for c in contracts if c["name"].startswith("Every kernel half")]
    return dict(contract)


def _imports(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    return names


def test_every_kernel_half_is_declared_once_and_named_in_the_one_contract() -> None:
    declared = _declared()
    files = {
        "kernelexec." + ".".join(path.relative_to(ROOT / "kernelexec").with_suffix("").parts)
        for path in (ROOT / "kernelexec").rglob("_kernel_*.py")
    }
    loader = "kernelexec._protocol._kernel_loader"  # the install request's code, not a module
    assert set(declared) == files - {loader}
    assert len({m.name for m in declared.values()}) == len(declared)  # one name each
    helpers = {"kernelexec._sandbox._helper_ns", "kernelexec._sandbox._helper_disk"}
    assert set(_stdlib_contract()["source_modules"]) == files | helpers
    # Every top-level part of kernelexec is forbidden to them (the layering contract lists all).
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [layering] = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c.get("containers") == ["kernelexec"]
    ]
    parts = {n.strip() for layer in layering["layers"] for n in re.split(r"[|:]", layer)}
    assert {f"kernelexec.{part}" for part in parts} <= set(_stdlib_contract()["forbidden_modules"])


def test_kernel_halves_and_helpers_import_only_what_a_kernel_has() -> None:
    modules = [*_stdlib_contract()["source_modules"], "kernelexec._proctitle"]
    foreign = {
        module: sorted(name for name in _imports(module) if name not in sys.stdlib_module_names)
        for module in modules
    }
    assert {m: names for m, names in foreign.items() if set(names) - IN_A_KERNEL} == {}


def test_the_one_loader_leaves_nothing_of_kernelexec_in_the_kernel() -> None:
    """Every kernel half (the protocol's, files', code mode's) runs from its source text: the
    kernel never imports kernelexec, so a kernel whose venv lacks it works the same."""

    def answer() -> int:
        """The answer."""
        return 42

    with kx.KernelExecutor(default_timeout=60) as ex:
        s = ex.session("halves")
        s.expose(answer, module="tools")
        s.files.write("note.txt", "hi")
        got = s.run_code(
            "import sys\n"
            "from tools import answer\n"
            "assert answer() == 42\n"
            "' '.join(sorted(n for n in sys.modules if 'kernelexec' in n\n"
            "                and n != '__kernelexec_compiled__'))  # a fork server's"
        )
    assert got.error is None, got.error
    assert got.result == repr(
        "__kernelexec__ __kernelexec_budget__ __kernelexec_codemode__ __kernelexec_commands__ "
        "__kernelexec_files__ __kernelexec_namespace__ __kernelexec_output__ "
        "__kernelexec_tuning__"
    )


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="root only")
def test_the_namespace_helper_shows_its_title_not_its_source() -> None:
    from kernelexec._sandbox import _nshelper

    _nshelper.hold()
    try:
        with pytest.raises(_nshelper.HelperError, match="open_tree /nonexistent"):
            _nshelper.request("show", pid=os.getpid(), path="/nonexistent-kx-path")
        helper = _nshelper._helper
        assert helper is not None and helper.poll() is None
        assert _cmdline(helper.pid) == b"kernelexec ns helper\0"
        assert psutil.Process(helper.pid).name() == "kx-ns-helper"
    finally:
        _nshelper.let_go()
    assert helper.poll() is not None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="root only")
def test_the_disk_helper_shows_its_title_not_its_source(tmp_path: Path) -> None:
    from kernelexec._sandbox import _disk

    (tmp_path / "seen").write_text("on disk")
    with subprocess.Popen(
        _disk.probe_command(str(tmp_path)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as probe:
        assert probe.stdout is not None
        assert probe.stdout.readline() == "ready\n"  # titled before it runs the helper
        assert _cmdline(probe.pid) == b"kernelexec disk helper\0"
        assert psutil.Process(probe.pid).name() == "kx-disk-helper"
        out, _ = probe.communicate("go\n", timeout=30)
    assert out == "on disk\n"  # no mount of the host's there: the directory as it is
    assert probe.returncode == 0


def test_the_title_source_is_the_checked_function() -> None:
    """``-c`` processes carry the text of ``set_title`` itself, with no ``{`` for
    jupyter-client to substitute."""
    space: dict[str, object] = {}
    exec(compile(_proctitle.SOURCE, "<title>", "exec"), space)
    assert space["kx_set_title"] is space["set_title"]
    assert "{" not in _proctitle.SOURCE


def test_a_commands_supervisor_shows_its_title_not_its_source() -> None:
    """The supervisor (``_kernel_supervisor.py``) runs a command as its child: its own command
    line is its title (it was its source), the command's is the command's."""
    with kx.KernelExecutor(isolation="none", default_timeout=60) as ex:
        s = ex.session("supervised")
        proc = s.commands.start("echo $PPID; exec sleep 1000")
        while b"\n" not in proc.stdout:
            proc.poll(wait=0.2)
        supervisor = int(proc.stdout.split()[0])
        assert _cmdline(supervisor) == b"kernelexec command\0"
        assert psutil.Process(supervisor).name() == "kx-command"
        # The shell printed before its exec: until the exec is through it shows as itself.
        deadline = time.monotonic() + 30
        while True:
            kids = psutil.Process(supervisor).children()
            shown = kids[0].cmdline() if kids else []
            if shown == ["sleep", "1000"] or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert shown == ["sleep", "1000"]
        proc.kill()
        assert proc.wait(timeout=20) == -9


def test_the_loader_keeps_replaces_and_leaves_nothing_half_made() -> None:
    """The loader's own text, run in a real kernel on a spec made here: a kept module is not
    executed again (its entry is called), one not kept is replaced, and one whose source fails
    is not left in ``sys.modules``."""
    from kernelexec._protocol._install import LOADER

    definition = LOADER.rsplit("\n__kx_install(", 1)[0]  # the function, without its call
    code = (
        "import sys\n"
        "space = {}\n"
        f"exec({definition!r}, space)\n"
        "kernel = get_ipython().kernel\n"
        "real = kernel.get_parent\n"
        "def install(*modules):\n"
        "    kernel.get_parent = lambda *a: {'metadata': {'k': {'modules': list(modules)}}}\n"
        "    try:\n"
        "        space['__kx_install']('k', 'kx-test', '<kernelexec>', 'kx-no-server')\n"
        "    finally:\n"
        "        kernel.get_parent = real\n"
        "install(['kx_kept', 'n = 1\\ndef entry(x): return n + x', True, 'entry', [1]])\n"
        "install(['kx_kept', 'raise ValueError', True, 'entry', [2]])\n"
        "kept = sys.modules['kx_kept'].n\n"
        "install(['kx_kept', 'n = 5', False, None, []])\n"
        "try:\n"
        "    install(['kx_bad', 'x = 1\\nraise ValueError(\"boom\")', False, None, []])\n"
        "except ValueError as exc:\n"
        "    failed = str(exc)\n"
        "(kept, sys.modules['kx_kept'].n, 'kx_bad' in sys.modules, failed)"
    )
    with kx.KernelExecutor(isolation="none", default_timeout=60) as ex:
        got = ex.session("loader").run_code(code)
    assert got.error is None, got.error
    assert got.result == "(1, 5, False, 'boom')"


def test_every_kernel_half_works_in_a_venv_without_kernelexec(tmp_path: Path) -> None:
    """A venv's kernel has ipykernel but not kernelexec: the protocol's, code mode's, files'
    and commands' halves all arrive as text and serve."""

    def answer() -> int:
        """The answer."""
        return 42

    with kx.KernelExecutor(
        cache_dir=tmp_path / "cache", env=kx.VenvEnv(requirements=[]), default_timeout=60
    ) as ex:
        s = ex.session("venv")
        s.expose(answer, module="tools")
        s.files.write("note.txt", "from the host")
        done = s.commands.run(["cat", "note.txt"])
        got = s.run_code(
            "import importlib.util, sys\n"
            "from tools import answer\n"
            "(sys.prefix, importlib.util.find_spec('kernelexec') is None, answer())"
        )
    assert done.exit_code == 0 and done.stdout == "from the host"
    assert got.error is None, got.error
    prefix, missing, value = ast.literal_eval(got.result or "")
    assert prefix.startswith(str(tmp_path / "cache")) and missing is True and value == 42
