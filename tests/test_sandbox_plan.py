"""The isolation level in one place: its rules checked once (the configuration and the plan say
the same thing), the backend's report a typed ``Isolation``, and the plan's ``prepare`` step
giving the local backend every piece of a launch. No kernel is started here: the launches these
pieces make are the hostile suite's (``tests/hostile/test_isolation.py`` and the rest)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._config import make_config
from kernelexec._models import ISOLATION_LEVELS, IsolationLevel
from kernelexec._sandbox._plan import NO_SANDBOX, make_plan
from kernelexec.backends import KernelLaunch, LocalBackend

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is missing")
UID = 2_000_000_007  # a kernel's own user (none is made: nothing is launched)


@pytest.mark.parametrize(
    ("level", "limits", "network"),
    [("none", {"memory_mb": 512.0}, None), ("process", {}, False), ("none", {}, False)],
    ids=["limits-at-none", "network-off-at-process", "network-off-at-none"],
)
def test_the_configuration_and_the_plan_refuse_with_one_message(
    level: IsolationLevel, limits: dict[str, float], network: bool | None
) -> None:
    config: dict[str, object] = {"isolation": level, "network": network}
    if limits:
        config["limits"] = kx.Limits(**{k: int(v) for k, v in limits.items()})
    with pytest.raises(kx.ConfigError) as from_config:
        make_config(**config)
    with pytest.raises(kx.ConfigError) as from_plan:
        make_plan(level, limits, network, sys.executable, None)
    assert str(from_plan.value) in str(from_config.value)
    assert "isolation" in str(from_plan.value)


def test_the_levels_are_the_type_s_values() -> None:
    assert ISOLATION_LEVELS == ("none", "process", "bwrap")


def test_the_backend_reports_a_typed_isolation() -> None:
    backend = LocalBackend(fork_server=False)
    found = backend.isolation(KernelLaunch(isolation="process"))
    assert isinstance(found, kx.Isolation)
    assert found.level == "process"
    assert found.boundaries["launch"] == "a new interpreter per kernel (plain launch)"
    assert found.limits["max_open_files"].startswith("4096 (RLIMIT_NOFILE")
    with kx.KernelExecutor(isolation="none") as ex:
        assert ex._async.isolation_of(ex._async.env) == ex._async.backend.isolation(
            ex._async._core.launch(ex._async.env, None)
        )


def test_prepare_at_none_is_the_plain_command(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin", "HOME": "/home/someone"}
    setup = NO_SANDBOX.prepare(sys.executable, env, str(tmp_path), None)
    assert setup.argv(["kernel", "-f", "x"], os.getpid()) == ["kernel", "-f", "x"]
    assert setup.launcher(os.getpid()) is None
    assert setup.interrupt_mode == "signal"
    assert setup.env["HOME"] == "/home/someone"  # the host user's, untouched
    assert setup.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert setup.env["IPYTHONDIR"] == str(tmp_path / "ipython")
    assert setup.title.endswith("[none]")
    assert env == {"PATH": "/usr/bin", "HOME": "/home/someone"}  # the caller's dict is kept


def test_prepare_at_process_runs_the_kernel_under_the_launcher(tmp_path: Path) -> None:
    plan = make_plan("process", {}, None, sys.executable, None)
    uid = UID if plan.own_user else None
    setup = plan.prepare(sys.executable, {}, str(tmp_path), None, uid=uid, procs=["/x/procs"])
    argv = setup.argv(["kernel"], 4242)
    assert argv[:4] == [sys.executable, "-I", "-S", "-c"] and argv[-1] == "kernel"
    cfg = json.loads(argv[5])
    assert cfg == json.loads(json.dumps(setup.launcher(4242)))
    assert (cfg["host"], cfg["uid"], cfg["procs"]) == (4242, uid, ["/x/procs"])
    assert cfg["rlimits"] == [list(r) for r in plan.rlimits]
    assert setup.launcher(99) is not None and setup.launcher(99)["host"] == 99  # a fork server
    assert setup.env["HOME"] == str(tmp_path)
    assert setup.interrupt_mode == "signal"
    assert setup.title.endswith("[process]")


@needs_bwrap
def test_prepare_at_bwrap_puts_bubblewrap_between_launcher_and_kernel(tmp_path: Path) -> None:
    plan = make_plan("bwrap", {}, None, sys.executable, str(tmp_path / "sessions"))
    uid = UID if plan.own_user else None
    setup = plan.prepare(sys.executable, {"LANG": "C"}, str(tmp_path), None, uid=uid)
    argv = setup.argv(["kernel"], 4242)
    cfg = json.loads(argv[5])
    assert cfg["uid"] is None  # bubblewrap's setpriv drops the user, not the launcher
    wrapped = argv[6:]
    assert os.path.basename(wrapped[0]) == "bwrap" and wrapped[-1] == "kernel"
    assert wrapped[wrapped.index("--chdir") + 1] == str(tmp_path)
    assert ["--setenv", "HOME", str(tmp_path)] == wrapped[
        wrapped.index("HOME") - 1 : wrapped.index("HOME") + 2
    ]
    assert "--unshare-net" in wrapped  # network=None is off under bwrap
    assert setup.interrupt_mode == "message"
    assert json.loads(json.dumps(setup.launcher(4242))) == cfg
