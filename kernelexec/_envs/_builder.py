"""Building virtual environments: once per fingerprint, atomically, and safe to race.

:class:`EnvBuilder` turns a :class:`~kernelexec.VenvEnv` into a directory in the cache: under a
file lock (so two executors or two processes build it once), in a temporary directory renamed
into place only when complete (so a failed or interrupted build leaves nothing half-made).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import filelock
from pydantic import BaseModel

from kernelexec._envs._envs import (
    ENV_INFO,
    KERNEL_REQUIREMENT,
    STATE_REQUIREMENT,
    VenvEnv,
    default_cache_dir,
    python_version,
)
from kernelexec._exceptions import ConfigError, EnvSetupError
from kernelexec._observability._otel import telemetry
from kernelexec._public import public
from kernelexec._sandbox import _uids, _users
from kernelexec._sandbox._build import BuildConfinement, take_back
from kernelexec._sandbox._plan import interpreter_paths


class EnvProgress(BaseModel):
    """One step of building an environment, for progress display.

    Attributes:
        fingerprint: The environment being built.
        phase: ``waiting`` (another build holds the lock), ``creating``, ``installing``,
            ``output`` (a line of installer output), ``done``, ``reused`` or ``failed``.
        message: What happened, for people.
        elapsed_s: Seconds since the build was asked for.
    """

    fingerprint: str
    phase: Literal["waiting", "creating", "installing", "output", "done", "reused", "failed"]
    message: str
    elapsed_s: float


ProgressCallback = Callable[[EnvProgress], None]


class BuiltEnv(BaseModel):
    """A ready virtual environment.

    Attributes:
        fingerprint: Its fingerprint.
        path: Its directory.
        python: Its interpreter.
        built: True when this call built it, False when it was already there.
        seconds: How long getting it took.
    """

    fingerprint: str
    path: Path
    python: Path
    built: bool
    seconds: float


def _venv_python(root: Path) -> Path:
    return root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _built_env(fingerprint: str, target: Path, built: bool, start: float) -> BuiltEnv:
    return BuiltEnv(
        fingerprint=fingerprint,
        path=target,
        python=_venv_python(target),
        built=built,
        seconds=time.monotonic() - start,
    )


def find_uv() -> str | None:
    """The ``uv`` executable of the ``uv`` package, if installed."""
    try:
        import uv

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


class EnvBuilder:
    """Builds and caches virtual environments (see the module docstring).

    Args:
        cache_dir: Where venvs live (``<cache_dir>/envs/<fingerprint>``).
        installer: ``"auto"`` (uv when available, else venv + pip), ``"uv"`` or ``"pip"``.
        on_progress: Called with each :class:`EnvProgress` (on kernelexec's event loop).
        confinement: How the installer runs the requirements' own code (their build
            backends): under the isolation of the kernels that will use the venv
            (:mod:`kernelexec._sandbox._build`). Default: as the host (``"none"``), for
            requirements the host itself names (``kernelexec env build``).
    """

    def __init__(
        self,
        cache_dir: Path | None = None,
        installer: Literal["auto", "uv", "pip"] = "auto",
        on_progress: ProgressCallback | None = None,
        confinement: BuildConfinement | None = None,
    ) -> None:
        self.confinement = confinement or BuildConfinement()
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.installer = installer
        self.on_progress = on_progress
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def envs_dir(self) -> Path:
        """The directory holding one venv per fingerprint."""
        return self.cache_dir / "envs"

    def target(self, env: VenvEnv, fingerprint: str) -> Path:
        """Where ``env`` lives once built."""
        return Path(env.path).resolve() if env.path is not None else self.envs_dir / fingerprint

    def is_built(self, env: VenvEnv) -> bool:
        """Whether ``env`` is in the cache already (nothing to build)."""
        return (self.target(env, env.fingerprint) / ENV_INFO).exists()

    async def ensure(self, env: VenvEnv) -> BuiltEnv:
        """The built venv for ``env``: reused when present, else built now.

        Raises:
            EnvSetupError: creating the venv or installing a requirement failed; the message
                ends with the tail of the installer's output. Nothing is left behind, and the
                next call tries again. Also when the confinement cannot be had on this host.
        """
        start = time.monotonic()
        fingerprint = env.fingerprint
        target = self.target(env, fingerprint)
        if (target / ENV_INFO).exists():
            return self._reused(fingerprint, target, start)
        lock = self._locks.setdefault(fingerprint, asyncio.Lock())
        async with lock:  # one build per fingerprint in this process ...
            if (target / ENV_INFO).exists():
                return self._reused(fingerprint, target, start)
            target.parent.mkdir(parents=True, exist_ok=True)
            # Across processes too. filelock's async lock is cancellation-safe (measured: a
            # cancelled acquire returns at once and leaves the lock free for the next owner).
            file_lock = filelock.AsyncFileLock(
                str(target.parent / f".{target.name}.lock"), poll_interval=0.1
            )
            try:
                await file_lock.acquire(timeout=0)
            except filelock.Timeout:
                self._emit(fingerprint, "waiting", "another build holds the lock", start)
                await file_lock.acquire()
            try:
                if (target / ENV_INFO).exists():
                    return self._reused(fingerprint, target, start)
                if env.requirements:
                    self.confinement.check()
                with telemetry().span("env.build", {"kernelexec.env.fingerprint": fingerprint}):
                    try:
                        await self._build(env, fingerprint, target, start)
                    except BaseException:
                        telemetry().count("env.builds", {"outcome": "failed"})
                        raise
                telemetry().count("env.builds", {"outcome": "built"})
            finally:
                await file_lock.release()
        built = _built_env(fingerprint, target, True, start)
        self._emit(fingerprint, "done", f"built {target} in {built.seconds:.1f} s", start)
        return built

    def _reused(self, fingerprint: str, target: Path, start: float) -> BuiltEnv:
        with contextlib.suppress(OSError):
            os.utime(target / ENV_INFO)  # last used, for `kernelexec env prune --older-than`
        self._emit(fingerprint, "reused", f"using {target}", start)
        return _built_env(fingerprint, target, False, start)

    def _emit(self, fingerprint: str, phase: str, message: str, start: float) -> None:
        if self.on_progress is not None:
            event = EnvProgress(
                fingerprint=fingerprint,
                phase=phase,  # type: ignore[arg-type]
                message=message,
                elapsed_s=time.monotonic() - start,
            )
            self.on_progress(event)

    def _choose_installer(self) -> tuple[str, str | None]:
        uv = find_uv() if self.installer in ("auto", "uv") else None
        if self.installer == "uv" and uv is None:
            raise ConfigError("installer='uv' but uv is not installed (pip install uv)")
        return ("uv", uv) if uv else ("pip", None)

    async def _build(self, env: VenvEnv, fingerprint: str, target: Path, start: float) -> None:
        # Leftovers of builds killed before they could clean up (we hold the lock).
        for stale in target.parent.glob(f".building-{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".building-{target.name}-", dir=target.parent))
        tmp = work / "venv"
        try:
            kind, uv = self._choose_installer()
            python = env.interpreter
            venv_python = str(_venv_python(tmp))
            confined = self.confinement.confined and bool(env.requirements)
            # Confined, kernelexec's own requirement is installed first as the host; the
            # tool-named ones (whose build backends run code) then as the build's own user.
            host_reqs = [KERNEL_REQUIREMENT, STATE_REQUIREMENT]
            host_reqs += [] if confined else list(env.requirements)
            reqs = work / "requirements.txt"
            reqs.write_text("\n".join(host_reqs) + "\n")
            tool_reqs = work / "tool-requirements.txt"
            tool_reqs.write_text("\n".join(env.requirements) + "\n")
            self._emit(fingerprint, "creating", f"creating a venv with {kind} ({python})", start)

            def install(listing: Path) -> list[str]:
                if uv is not None:
                    # No --compile-bytecode: it triples the build, and the first kernel writes
                    # the .pyc files it needs anyway (measured in benchmarks/envs.py).
                    return [uv, "pip", "install", "--python", venv_python, "-r", str(listing)]
                return [venv_python, "-m", "pip", "install", "--no-input", "-r", str(listing)]

            if uv is not None:
                create = [uv, "venv", "--quiet", "--relocatable", "--python", python, str(tmp)]
            else:
                create = [python, "-m", "venv", str(tmp)]
            await self._run(create, fingerprint, start, "creating the venv")
            count = len(env.requirements)
            self._emit(
                fingerprint, "installing", f"installing ipykernel and {count} requirement(s)", start
            )
            what = "installing the requirements"
            await self._run(install(reqs), fingerprint, start, what)
            if confined:
                needed = await asyncio.to_thread(_build_needs, python, env.requirements, uv)
                await self._run_confined(install(tool_reqs), work, needed, fingerprint, start, what)
            info = {
                "fingerprint": fingerprint,
                "requirements": list(env.requirements),
                "kernel_requirement": KERNEL_REQUIREMENT,
                "python": python,
                "python_version": python_version(python).split()[0],
                "installer": kind,
                "built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "build_s": round(time.monotonic() - start, 3),
            }
            (tmp / ENV_INFO).write_text(json.dumps(info, indent=2) + "\n")
            os.rename(tmp, target)  # atomic: the venv appears complete or not at all
        except BaseException as exc:
            if isinstance(exc, EnvSetupError):
                self._emit(fingerprint, "failed", str(exc).splitlines()[-1], start)
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _run_confined(
        self,
        argv: list[str],
        work: Path,
        needed: list[str],
        fingerprint: str,
        start: float,
        what: str,
    ) -> None:
        """Run ``argv`` as a uid of its own that owns ``work`` while it runs (see
        :mod:`kernelexec._sandbox._build`); everything it made is the host's afterwards."""
        uid = await asyncio.to_thread(_uids.allocate)
        try:
            home = work / "home"
            home.mkdir()
            await asyncio.to_thread(_users.hand_over, str(work), uid)
            confinement = self.confinement
            wrapped = confinement.wrap(argv, uid, needed, [str(work)])
            env = confinement.environment(str(home))
            await self._run(wrapped, fingerprint, start, what, env=env, cwd=str(home))
        finally:
            await asyncio.to_thread(take_back, work)
            await asyncio.to_thread(_uids.release, uid)

    async def _run(
        self,
        argv: list[str],
        fingerprint: str,
        start: float,
        what: str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        if env is None:
            env = dict(os.environ)
            env.pop("VIRTUAL_ENV", None)  # the installer must target the new venv, not ours
            env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=cwd,
            )
        except OSError as exc:
            raise EnvSetupError(f"{what} failed: cannot run {argv[0]}: {exc}") from None
        tail: collections.deque[str] = collections.deque(maxlen=30)
        assert proc.stdout is not None
        try:
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                if line:
                    tail.append(line)
                    self._emit(fingerprint, "output", line, start)
            code = await proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
            raise
        if code != 0:
            output = "\n".join(tail) or "(no output)"
            raise EnvSetupError(f"{what} failed (exit status {code}):\n{output}")


def _build_needs(python: str, requirements: tuple[str, ...], uv: str | None) -> list[str]:
    """What a confined install must reach: the interpreter, the local requirements, uv."""
    needed = [*interpreter_paths(python), *_local_paths(requirements)]
    if uv is not None:
        needed.append(os.path.dirname(os.path.realpath(uv)))
    return needed


def _local_paths(requirements: tuple[str, ...]) -> list[str]:
    """The local files and directories among ``requirements`` (``/w/pkg``,
    ``name @ file:///w/pkg.whl``), which a confined build must reach."""
    found = []
    for line in requirements:
        text = line.split("@", 1)[1].strip() if "@" in line else line
        text = text.removeprefix("file://")
        if os.path.isabs(text) and os.path.exists(text):
            real = os.path.realpath(text)
            found.append(real)
    return found


def list_envs(cache_dir: Path) -> list[dict[str, Any]]:
    """The venvs built under ``cache_dir``, with what each holds and when it was last used."""
    found = []
    root = Path(cache_dir) / "envs"
    if not root.is_dir():
        return []
    for info_file in sorted(root.glob(f"*/{ENV_INFO}")):
        try:
            info = json.loads(info_file.read_text())
        except (OSError, ValueError):
            continue
        info["path"] = str(info_file.parent)
        info["last_used"] = dt.datetime.fromtimestamp(
            info_file.stat().st_mtime, dt.timezone.utc
        ).isoformat(timespec="seconds")
        found.append(info)
    return found


def prune_envs(cache_dir: Path, older_than_s: float | None = None) -> list[str]:
    """Remove cached venvs (those unused for ``older_than_s`` seconds, or all) and leftovers.

    A venv being built is skipped (its lock is held). Returns the removed paths.
    """
    root = Path(cache_dir) / "envs"
    removed: list[str] = []
    if not root.is_dir():
        return removed
    now = time.time()
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        info = entry / ENV_INFO
        if older_than_s is not None and info.exists() and now - info.stat().st_mtime < older_than_s:
            continue
        name = entry.name.split("-")[1] if entry.name.startswith(".building-") else entry.name
        lock = filelock.FileLock(str(root / f".{name}.lock"), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
        finally:
            lock.release()
    return removed


public(__name__)
