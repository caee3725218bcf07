"""Kernels in virtual environments: built from wheels the tests make, cached, safe to race."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

import kernelexec as kx
from kernelexec._envs._envs import normalise_requirement
from tests.support.wheels import make_wheel

USE_PACKAGE = textwrap.dedent(
    '''
    def use_package(name: str) -> dict:
        """Import a package and say where it came from.

        Args:
            name: The package to import.
        """
        import importlib, sys
        module = importlib.import_module(name)
        return {"version": module.VERSION, "file": module.__file__, "prefix": sys.prefix}
    '''
)


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wheels")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def kxdemo(wheel_dir: Path) -> Path:
    return make_wheel(wheel_dir, "kxdemo", "1.2.3", "VERSION = '1.2.3'\n")


def entries(cache: Path) -> list[str]:
    root = cache / "envs"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_fingerprint_is_stable_and_normalised(
    kxdemo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = kx.VenvEnv(requirements=["Foo_Bar[b,a]>=1.0", "six"])
    b = kx.VenvEnv(requirements=("six", "foo-bar[a,b]>=1.0", "six"))
    assert a.requirements == ("foo-bar[a,b]>=1.0", "six")
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16
    assert kx.VenvEnv(requirements=["six==1.16"]).fingerprint != a.fingerprint
    assert kx.VenvEnv().fingerprint != kx.LocalEnv().fingerprint
    # A local wheel counts by its content: rebuilt with other content, another venv.
    copy = tmp_path / kxdemo.name
    copy.write_bytes(kxdemo.read_bytes())
    first = kx.VenvEnv(requirements=[str(copy)]).fingerprint
    by_url = kx.VenvEnv(requirements=[f"kxdemo @ file://{copy}"]).fingerprint
    make_wheel(tmp_path, "kxdemo", "1.2.3", "VERSION = 'changed'\n")
    assert kx.VenvEnv(requirements=[str(copy)]).fingerprint != first
    assert kx.VenvEnv(requirements=[f"kxdemo @ file://{copy}"]).fingerprint != by_url
    monkeypatch.chdir(tmp_path)  # a relative path is made absolute
    assert normalise_requirement(copy.name) == str(copy)
    assert kx.VenvEnv(requirements=[copy.name]).requirements == (str(copy),)


@pytest.mark.parametrize(
    ("requirements", "message"),
    [
        (["   "], "one non-empty line"),
        (["six\nrequests"], "one non-empty line"),
        (["--index-url https://example.org"], "pip option"),
        (["-r other.txt"], "pip option"),
        ("six", "a list of requirement lines"),
        ([3], "not a string"),
    ],
)
def test_bad_requirements_are_rejected(requirements: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kx.VenvEnv(requirements=requirements)  # type: ignore[arg-type]
    with pytest.raises(kx.ConfigError, match=message):
        kx.KernelExecutor(env={"kind": "venv", "requirements": requirements})


def test_tool_imports_its_package_in_its_venv_while_the_host_cannot(
    kxdemo: Path, cache_dir: Path
) -> None:
    assert importlib.util.find_spec("kxdemo") is None  # not on the host
    tool = kx.Tool.from_source(USE_PACKAGE, pip_requirements=[str(kxdemo)])
    env = kx.VenvEnv(requirements=[str(kxdemo)])
    events: list[kx.EnvProgress] = []
    with kx.KernelExecutor(cache_dir=cache_dir, on_progress=events.append) as ex:
        result = ex.call_tool(tool, {"name": "kxdemo"}, agent_id="a")
        assert result.ok, result.error
        venv = cache_dir / "envs" / env.fingerprint
        assert result.func_return["version"] == "1.2.3"
        assert result.func_return["prefix"] == str(venv)
        assert result.func_return["file"].startswith(str(venv))
        assert result.sandbox_config_fingerprint == env.fingerprint
        host = ex.run_code("import kxdemo", agent_id="a")  # same agent, host environment
        assert host.error is not None and host.error.ename == "ModuleNotFoundError"
        assert ex.sessions.keys() == {"a"}
        assert ex.kernel_count == 2
    phases = [e.phase for e in events if e.phase != "output"]
    assert phases == ["creating", "installing", "done"]
    info = json.loads((venv / "kernelexec-env.json").read_text())
    assert info["requirements"] == [str(kxdemo)]
    assert info["installer"] == "uv"
    assert entries(cache_dir) == [f".{env.fingerprint}.lock", env.fingerprint]

    # Warm reuse: a new executor finds it built.
    events.clear()
    with kx.KernelExecutor(cache_dir=cache_dir, on_progress=events.append) as ex:
        assert ex.call_tool(tool, {"name": "kxdemo"}).func_return["version"] == "1.2.3"
    assert [e.phase for e in events] == ["reused"]


def test_session_call_tool_refuses_a_tool_whose_requirements_its_env_lacks(
    kxdemo: Path, cache_dir: Path
) -> None:
    tool = kx.Tool.from_source(USE_PACKAGE, pip_requirements=[str(kxdemo)])
    with kx.KernelExecutor(cache_dir=cache_dir) as ex:
        session = ex.session("a")
        with pytest.raises(kx.RequirementsMissingError) as info:
            session.call_tool(tool, {"name": "kxdemo"})
        message = str(info.value)
        assert "'a'" in message and "LocalEnv" in message and str(kxdemo) in message
        assert info.value.missing == (str(kxdemo),)
        assert isinstance(info.value, kx.ConfigError)
        assert ex.kernel_count == 0  # refused before anything started
        # The session the executor would use for this tool has them.
        own = ex.session("a", ex.env_for(tool))
        assert own.call_tool(tool, {"name": "kxdemo"}).func_return["version"] == "1.2.3"
        # A requirement the host's interpreter satisfies runs in the host's session.
        packaging_version = importlib.metadata.version("packaging")
        host_tool = kx.Tool.from_source(
            USE_PACKAGE.replace("module.VERSION", "module.__version__"),
            pip_requirements=[f"packaging=={packaging_version}"],
        )
        ran = session.call_tool(host_tool, {"name": "packaging"})
        assert ran.ok, ran.error
        assert ran.func_return["version"] == packaging_version
        wrong = host_tool.model_copy(update={"pip_requirements": ["packaging<1"]})
        with pytest.raises(kx.RequirementsMissingError, match="packaging<1"):
            session.call_tool(wrong, {"name": "packaging"})


def test_executor_default_env_and_sessions_per_env(
    kxdemo: Path, cache_dir: Path, tmp_path: Path
) -> None:
    env = kx.VenvEnv(requirements=[str(kxdemo)])
    with kx.KernelExecutor(env=env, cache_dir=cache_dir, record_dir=tmp_path) as ex:
        assert ex.fingerprint == env.fingerprint
        assert ex.run_code("import kxdemo; x = kxdemo.VERSION", agent_id="b").ok
        local = ex.session("b", kx.LocalEnv())
        assert local is not ex.session("b")
        assert local.run_code("x").error.ename == "NameError"  # type: ignore[union-attr]
        assert ex.run_code("x", agent_id="b").result == "'1.2.3'"
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["b.ipynb", f"b@{kx.LocalEnv().fingerprint[:8]}.ipynb"]
    nb = nbformat.read(tmp_path / "b.ipynb", as_version=4)
    assert nb.metadata["kernelexec"]["env"]["requirements"] == [str(kxdemo)]
    assert nb.metadata["kernelexec"]["env_fingerprint"] == env.fingerprint
    # Replay rebuilds (here: reuses) the recorded venv.
    report = kx.replay(tmp_path / "b.ipynb", cache_dir=cache_dir)
    assert report.ok and report.cells_run == 2, report.differences


@pytest.mark.anyio
async def test_concurrent_builds_in_one_process_build_once(wheel_dir: Path, tmp_path: Path) -> None:
    wheel = make_wheel(wheel_dir, "kxtwice", "1.0", "VERSION = '1.0'\n")
    env = kx.VenvEnv(requirements=[str(wheel)])
    builders = [kx.EnvBuilder(tmp_path) for _ in range(3)]
    results = await asyncio.gather(*(b.ensure(env) for b in builders))
    assert sorted(r.built for r in results) == [False, False, True]
    assert len({r.path for r in results}) == 1
    assert entries(tmp_path) == [f".{env.fingerprint}.lock", env.fingerprint]


def test_concurrent_builds_in_two_processes_build_once(wheel_dir: Path, tmp_path: Path) -> None:
    wheel = make_wheel(wheel_dir, "kxrace", "1.0", "VERSION = '1.0'\n")
    # Both processes import kernelexec first, then start building at the same moment.
    script = textwrap.dedent(
        f"""
        import sys
        from kernelexec._cli._main import main
        sys.stderr.write("ready\\n"); sys.stderr.flush()
        sys.stdin.readline()  # the go signal, sent to both at once
        sys.exit(main(["env", "build", "kxrace @ file://{wheel}", "--json"]))
        """
    )
    env = {**os.environ, "KERNELEXEC_CACHE_DIR": str(tmp_path)}  # the variable picks the cache
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stderr is not None and proc.stderr.readline() == "ready\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(out) for out, _ in outs]
    assert sorted(r["built"] for r in results) == [False, True]
    assert results[0]["path"] == results[1]["path"]
    fingerprint = results[0]["fingerprint"]
    assert fingerprint == kx.VenvEnv(requirements=[f"kxrace @ file://{wheel}"]).fingerprint
    assert results[0]["path"] == str(tmp_path / "envs" / fingerprint)
    assert entries(tmp_path) == [f".{fingerprint}.lock", fingerprint]
    waited = [err for _, err in outs if "another build holds the lock" in err]
    assert len(waited) == 1


def test_failing_requirement_gives_env_setup_failed_and_leaves_nothing(
    wheel_dir: Path, tmp_path: Path
) -> None:
    broken = wheel_dir / "kxbroken-1.0-py3-none-any.whl"
    broken.write_bytes(b"this is not a zip file")
    tool = kx.Tool.from_source(USE_PACKAGE, pip_requirements=[str(broken)])
    events: list[kx.EnvProgress] = []
    with kx.KernelExecutor(cache_dir=tmp_path, record=True, on_progress=events.append) as ex:
        for _ in range(2):  # the second call retries the build from scratch
            result = ex.call_tool(tool, {"name": "kxbroken"}, agent_id="c")
            assert result.status == "error"
            assert result.error is not None and result.error.kind == "env_setup_failed"
            assert result.error.ename == "EnvSetupError"
            assert "installing the requirements failed" in result.error.evalue
            assert "kxbroken" in result.error.evalue
        assert ex.kernel_count == 0
        notebook = ex.session("c", ex.env_for(tool)).notebook
        assert notebook is not None
        assert [c.metadata["kernelexec"]["status"] for c in notebook.cells] == ["not_run"] * 2
    assert [e.phase for e in events if e.phase in ("creating", "failed")] == [
        "creating",
        "failed",
        "creating",
        "failed",
    ]
    fingerprint = kx.VenvEnv(requirements=[str(broken)]).fingerprint
    assert entries(tmp_path) == [f".{fingerprint}.lock"]  # no directory, half-made or not
    cli = subprocess.run(
        [sys.executable, "-m", "kernelexec", "env", "build", str(broken), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KERNELEXEC_CACHE_DIR": str(tmp_path)},
    )
    assert cli.returncode == 1
    error = json.loads(cli.stdout)["error"]
    assert error["kind"] == "env_setup_failed" and "kxbroken" in error["message"]
    assert entries(tmp_path) == [f".{fingerprint}.lock"]
    with (
        pytest.raises(kx.EnvSetupError, match="kxbroken"),
        kx.KernelExecutor(cache_dir=tmp_path) as ex,
    ):
        ex.warm_up(kx.VenvEnv(requirements=[str(broken)]))


@pytest.mark.anyio
async def test_cancelled_build_leaves_nothing_and_stale_leftovers_are_swept(
    wheel_dir: Path, tmp_path: Path
) -> None:
    wheel = make_wheel(wheel_dir, "kxcancel", "1.0", "VERSION = '1.0'\n")
    env = kx.VenvEnv(requirements=[str(wheel)])
    # What a build killed with SIGKILL leaves behind:
    stale = tmp_path / "envs" / f".building-{env.fingerprint}-dead"
    (stale / "venv").mkdir(parents=True)
    started = asyncio.Event()

    def progress(event: kx.EnvProgress) -> None:
        if event.phase == "creating":
            started.set()

    builder = kx.EnvBuilder(tmp_path, on_progress=progress)
    task = asyncio.ensure_future(builder.ensure(env))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert entries(tmp_path) == [f".{env.fingerprint}.lock"]
    built = await builder.ensure(env)
    assert built.built and built.python.exists()


def test_env_cli_list_and_prune(kxdemo: Path, cache_dir: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kernelexec", "env", *args, "--cache-dir", str(cache_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    env = kx.VenvEnv(requirements=[str(kxdemo)])
    built = cli("build", str(kxdemo), "--json")
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["fingerprint"] == env.fingerprint
    listed = cli("list", "--json")
    assert env.fingerprint in [e["fingerprint"] for e in json.loads(listed.stdout)]
    assert cli("prune", "--json").stdout.strip() == '{"removed": []}'  # all recently used
    pruned = cli("prune", "--all", "--json")
    assert json.loads(pruned.stdout)["removed"] == [str(cache_dir / "envs" / env.fingerprint)]
    assert json.loads(cli("list", "--json").stdout) == []
    bad = cli("build", "six\nrequests")
    assert bad.returncode == 2 and "one non-empty line" in bad.stderr


@pytest.mark.slow
def test_pip_installer_without_uv(wheel_dir: Path, tmp_path: Path) -> None:
    wheel = make_wheel(wheel_dir, "kxpip", "2.0", "VERSION = '2.0'\n")
    tool = kx.Tool.from_source(USE_PACKAGE, pip_requirements=[str(wheel)])
    with kx.KernelExecutor(cache_dir=tmp_path, installer="pip") as ex:
        result = ex.call_tool(tool, {"name": "kxpip"})
    assert result.ok, result.error
    assert result.func_return["version"] == "2.0"
    env_dir = Path(result.func_return["prefix"])
    assert json.loads((env_dir / "kernelexec-env.json").read_text())["installer"] == "pip"


@pytest.mark.network
def test_real_package_from_the_index(tmp_path: Path) -> None:
    tool = kx.Tool.from_source(
        'def six_version() -> str:\n    """Six."""\n    import six\n    return six.__version__\n',
        pip_requirements=["six==1.16.0"],
    )
    with kx.KernelExecutor(cache_dir=tmp_path) as ex:
        result = ex.call_tool(tool)
    assert result.ok, result.error
    assert result.func_return == "1.16.0"


def test_cache_paths_expand_the_home_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    config = kx.ExecutorConfig(cache_dir="~/kx-cache", record_dir="~/runs")
    assert str(config.cache_dir) == "/home/someone/kx-cache"
    assert str(config.record_dir) == "/home/someone/runs"
    assert str(kx.EnvBuilder("~/c").cache_dir) == "/home/someone/c"
