"""Hostile configurations: asking for what the host cannot enforce is a ConfigError naming it,
never a silent downgrade; the fingerprint tells levels, limits and network settings apart."""

from __future__ import annotations

import pytest

import kernelexec as kx
from kernelexec._sandbox import _cgroups


def test_bwrap_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(kx.ConfigError, match=r"apt-get install -y bubblewrap"):
        kx.KernelExecutor(isolation="bwrap")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"isolation": "process", "network": False}, "network=False needs isolation='bwrap'"),
        ({"isolation": "none", "limits": kx.Limits(memory_mb=512)}, "limits need isolation"),
        ({"limits": {"max_open_files": 16}}, "max_open_files"),
        ({"limits": {"memory_mb": -1}}, "memory_mb"),
        ({"isolation": "vm"}, "isolation"),
    ],
    ids=["network-off-outside-bwrap", "limits-at-none", "nofile-too-low", "negative", "level"],
)
def test_bad_settings_are_config_errors(config: dict[str, object], message: str) -> None:
    with pytest.raises(kx.ConfigError, match=message):
        kx.KernelExecutor(**config)


def test_limits_reject_bad_values_with_a_config_error() -> None:
    with pytest.raises(kx.ConfigError, match=r"invalid limits: max_open_files: .*128"):
        kx.Limits(max_open_files=16)
    with pytest.raises(kx.ConfigError, match=r"invalid limits: swap_mb: Extra inputs"):
        kx.Limits(swap_mb=5)


def test_a_limit_without_a_mechanism_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A host without usable cgroups: cpus and max_processes have no other mechanism (the
    # interpreter under /root keeps kernels at the host's user here, so no RLIMIT_NPROC).
    monkeypatch.setattr(_cgroups, "support", lambda: _cgroups.CgroupSupport())
    with pytest.raises(kx.ConfigError, match=r"cpus=1 cannot be enforced here.*cgroup cpu"):
        kx.KernelExecutor(limits=kx.Limits(cpus=1))
    with pytest.raises(kx.ConfigError, match=r"memory_mb=256: .*RLIMIT_AS.*384"):
        kx.KernelExecutor(limits=kx.Limits(memory_mb=256))
    ex = kx.KernelExecutor(limits=kx.Limits(memory_mb=512))
    assert ex.session("x").isolation.limits["memory_mb"].startswith("512 (RLIMIT_AS")
    ex.close()


def test_the_fingerprint_covers_level_limits_and_network() -> None:
    prints = set()
    for config in (
        {},
        {"isolation": "none"},
        {"limits": kx.Limits(memory_mb=512)},
        {"limits": kx.Limits(memory_mb=1024)},
    ):
        with kx.KernelExecutor(**config) as ex:  # type: ignore[arg-type]
            prints.add(ex.fingerprint)
    assert len(prints) == 4
    with kx.KernelExecutor() as ex:
        assert ex.fingerprint == kx.LocalEnv().fingerprint  # the default keeps the env's own


def test_session_isolation_on_this_host() -> None:
    with kx.KernelExecutor(limits=kx.Limits(max_file_mb=5)) as ex:
        iso = ex.session("iso").isolation
    assert iso.level == "process"
    assert iso.limits["max_file_mb"] == "5 (RLIMIT_FSIZE per process)"
    sup = _cgroups.support()
    if sup.mechanism("memory_mb"):
        assert iso.limits["memory_mb"].endswith(f"({sup.mechanism('memory_mb')})")
    assert "launcher" in iso.boundaries["descendants"]
    with kx.KernelExecutor(isolation="none") as ex:
        assert ex.session("plain").isolation.limits == {}
