"""Environments a kernel runs in, as values: the host interpreter, or a virtual environment.

:class:`LocalEnv` and :class:`VenvEnv` have a stable ``fingerprint``; building a ``VenvEnv`` is
the job of :mod:`kernelexec._envs._builder`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated, Any, Literal

import platformdirs
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)

from kernelexec._exceptions import ConfigError, describe_problems
from kernelexec._public import public

KERNEL_REQUIREMENT = f"ipykernel=={importlib.metadata.version('ipykernel')}"
"""What kernelexec needs inside every venv: the ipykernel release the host is tested with."""

STATE_REQUIREMENT = "cloudpickle"
"""Installed in every venv too: durable sessions save functions and classes defined in the
kernel by value with it (``docs/durable.md``)."""

CACHE_ENV_VAR = "KERNELEXEC_CACHE_DIR"
ENV_INFO = "kernelexec-env.json"
_LAYOUT = "1"  # bump when the on-disk layout of a built venv changes
_python_versions: dict[str, str] = {}


def default_cache_dir() -> Path:
    """``$KERNELEXEC_CACHE_DIR``, else the platform's user cache dir (``~/.cache/kernelexec``)."""
    from_env = os.environ.get(CACHE_ENV_VAR)
    return (
        Path(from_env).expanduser() if from_env else Path(platformdirs.user_cache_dir("kernelexec"))
    )


def base_python() -> str:
    """The interpreter behind the running one (outside any venv it runs in)."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def python_version(python: str) -> str:
    """``sys.version`` of an interpreter (asked once per path)."""
    if python in (sys.executable, base_python()):
        return sys.version
    if python not in _python_versions:
        try:
            out = subprocess.run(
                [python, "-c", "import sys; print(sys.version)"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise ConfigError(f"python {python!r} cannot be run: {exc}") from None
        _python_versions[python] = out.stdout.strip()
    return _python_versions[python]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_LOOKS_LIKE_LOCATION = re.compile(r"[/\\]|^\.|^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def normalise_requirement(line: str) -> str:
    """One requirement line in a canonical spelling (so equal requirements fingerprint equally).

    Named requirements get their canonical name and sorted extras (``Foo_Bar[B,a]>=1`` becomes
    ``foo-bar[a,b]>=1``); an existing local path becomes absolute.

    Raises:
        ConfigError: the line is empty, spans lines, or is a pip option (``-r``, ``--index-url``).
    """
    text = line.strip()
    if not text or "\n" in text or "\r" in text:
        raise ConfigError(f"requirement {line!r} must be one non-empty line")
    if text.startswith("-"):
        raise ConfigError(
            f"requirement {line!r} is a pip option; only requirement lines are accepted"
        )
    if os.path.exists(text):
        return str(Path(text).resolve())
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        if _LOOKS_LIKE_LOCATION.search(text):
            return text  # a VCS URL or a path pip reads (git+https://..., ./pkg): pip judges it
        raise ConfigError(f"requirement {line!r} is not a valid requirement: {exc}") from None
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    spec = f" @ {req.url}" if req.url else str(req.specifier)
    marker = f"; {req.marker}" if req.marker else ""
    return f"{canonicalize_name(req.name)}{extras}{spec}{marker}"


def _local_file(requirement: str) -> Path | None:
    """The local file a normalised requirement names (a path, or ``name @ file://...``)."""
    if requirement.startswith("/"):
        return Path(requirement) if os.path.isfile(requirement) else None
    try:
        url = Requirement(requirement).url
    except InvalidRequirement:
        return None
    if not url:
        return None
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "file":
        return None
    candidate = urllib.request.url2pathname(parsed.path)
    return Path(candidate) if os.path.isfile(candidate) else None


class LocalEnv(BaseModel):
    """The interpreter running kernelexec (the default environment).

    Attributes:
        kind: Always ``"local"``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local"] = "local"

    @property
    def fingerprint(self) -> str:
        """Interpreter, Python version and ipykernel version, hashed."""
        text = f"local|{sys.executable}|{sys.version}|{KERNEL_REQUIREMENT}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class VenvEnv(BaseModel):
    """A virtual environment with ``requirements`` installed, built on first use and cached.

    Attributes:
        kind: Always ``"venv"``.
        requirements: Requirement lines as pip accepts them: ``pandas>=2``,
            ``name @ file:///path/to.whl``, a local path to a wheel, sdist or project.
        python: The interpreter to build it from (default: the one running kernelexec).
        path: Where to build it (default: ``<cache_dir>/envs/<fingerprint>``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["venv"] = "venv"
    requirements: tuple[str, ...] = ()
    python: str | None = None
    path: Path | None = None

    _fingerprint: str | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid VenvEnv: {describe_problems(exc.errors())}") from None

    @field_validator("requirements", mode="before")
    @classmethod
    def _normalise(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError("requirements must be a list of requirement lines, not one string")
        if not isinstance(value, list | tuple):
            return value
        lines = []
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f"requirement {item!r} is not a string")
            lines.append(normalise_requirement(item))
        return tuple(sorted(set(lines)))

    @property
    def interpreter(self) -> str:
        """The interpreter the venv is built from."""
        return self.python or base_python()

    @property
    def fingerprint(self) -> str:
        """Interpreter version, normalised requirements (local files by content) and
        kernelexec's own kernel requirement, hashed (once per value: a local file changed
        afterwards needs a new ``VenvEnv``)."""
        if self._fingerprint is not None:
            return self._fingerprint
        parts = [
            f"venv|{_LAYOUT}|{python_version(self.interpreter)}|{KERNEL_REQUIREMENT}",
            STATE_REQUIREMENT,
        ]
        for req in self.requirements:
            local = _local_file(req)
            parts.append(f"{req}|sha256={_file_digest(local)}" if local else req)
        self._fingerprint = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        return self._fingerprint


Env = Annotated[LocalEnv | VenvEnv, Field(discriminator="kind")]


def missing_requirements(env: LocalEnv | VenvEnv, requirements: list[str]) -> list[str]:
    """The lines of ``requirements`` that ``env`` does not provide.

    A venv provides exactly the requirements it was built with (in their normalised spelling);
    the host interpreter (``LocalEnv``) provides a named requirement whose distribution is
    installed in a version the specifier allows (or whose marker does not apply here). A line
    that names no distribution (a bare path or url) counts as missing from ``LocalEnv``.
    """
    if isinstance(env, VenvEnv):
        provided = set(env.requirements)
        return [line for line in requirements if _normalised(line) not in provided]
    return [line for line in requirements if not _installed_here(line)]


def _normalised(line: str) -> str:
    try:
        return normalise_requirement(line)
    except ConfigError:
        return line


def _installed_here(line: str) -> bool:
    try:
        req = Requirement(line.strip())
    except InvalidRequirement:
        return False
    if req.marker is not None and not req.marker.evaluate():
        return True
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return req.url is not None or req.specifier.contains(version, prereleases=True)


public(__name__)
