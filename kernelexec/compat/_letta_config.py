"""Reading Letta's objects without importing Letta: sandbox config, requirements, agent env.

Everything here is duck-typed on the attributes Letta's classes have (``SandboxConfig.type`` /
``organization_id`` / ``config``, ``PipRequirement.name`` / ``version``, ``AgentState.id`` /
``secrets`` / ``get_agent_env_vars_as_dict()``), so a Letta server's own objects go in as they
are and plain stand-ins work as well.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelexec._exceptions import ConfigError

TIMEOUT_ENV_VAR = "TOOL_SANDBOX_TIMEOUT"
"""Letta's ``tool_sandbox_timeout`` setting, read from the environment at every run."""

DEFAULT_TIMEOUT = 180.0
"""Letta's default for ``tool_sandbox_timeout``, in seconds."""

REQUIREMENTS_TXT = "requirements.txt"


def letta_default_sandbox_dir() -> str:
    """Where Letta's default local config points (``~/.letta/tool_execution_dir``)."""
    return os.path.join(os.path.expanduser("~"), ".letta", "tool_execution_dir")


@dataclass(frozen=True)
class LocalConfig:
    """What a run needs from a Letta local sandbox config.

    Attributes:
        sandbox_dir: The session's working directory (None: the session's private one).
        use_venv: Whether the tool runs in a virtual environment.
        requirements: The config's ``pip_requirements`` as requirement lines.
        fingerprint: Letta's fingerprint of the config.
    """

    sandbox_dir: str | None
    use_venv: bool
    requirements: tuple[str, ...]
    fingerprint: str


def read_sandbox_config(sandbox_config: Any, user: Any) -> LocalConfig:
    """The local config of a Letta ``SandboxConfig`` (or ``None``: Letta's default config).

    Also accepted: a ``LocalSandboxConfig``-like object or a plain ``dict`` of its fields.
    """
    if sandbox_config is None:
        config: dict[str, Any] = {
            "sandbox_dir": letta_default_sandbox_dir(),
            "use_venv": False,
            "venv_name": "venv",
            "pip_requirements": [],
        }
        default_print = fingerprint("local", getattr(user, "organization_id", None), config)
        # Letta's default directory is in the user's home; a session's own directory is
        # private and removed at the end (see the README's table of differences).
        return LocalConfig(None, False, (), default_print)
    if isinstance(sandbox_config, dict):
        config, kind, org = dict(sandbox_config), "local", getattr(user, "organization_id", None)
    elif isinstance(getattr(sandbox_config, "config", None), dict):
        config = dict(sandbox_config.config)
        kind = _enum_value(getattr(sandbox_config, "type", None)) or "local"
        org = getattr(sandbox_config, "organization_id", None)
    elif hasattr(sandbox_config, "sandbox_dir"):
        dump = getattr(sandbox_config, "model_dump", None)
        config = dump(exclude_none=True) if callable(dump) else dict(vars(sandbox_config))
        kind, org = "local", getattr(user, "organization_id", None)
    else:
        raise ConfigError(
            "sandbox_config must be a Letta SandboxConfig (type, organization_id, config), "
            f"a LocalSandboxConfig or a dict, not {type(sandbox_config).__name__}"
        )
    if kind != "local":
        raise ConfigError(f"sandbox_config is of type {kind!r}; this sandbox runs local configs")
    sandbox_dir = config.get("sandbox_dir")
    if sandbox_dir is not None and not isinstance(sandbox_dir, str):
        raise ConfigError(f"sandbox_config sandbox_dir must be a str, not {sandbox_dir!r}")
    reqs = tuple(
        requirement_line(r, "sandbox_config pip_requirements") for r in _config_requirements(config)
    )
    return LocalConfig(
        sandbox_dir=os.path.abspath(os.path.expanduser(sandbox_dir)) if sandbox_dir else None,
        use_venv=bool(config.get("use_venv", False)),
        requirements=reqs,
        fingerprint=fingerprint(kind, org, config),
    )


def _config_requirements(config: dict[str, Any]) -> list[Any]:
    reqs = config.get("pip_requirements") or []
    if not isinstance(reqs, list | tuple):
        raise ConfigError(f"sandbox_config pip_requirements must be a list, not {reqs!r}")
    return list(reqs)


def _enum_value(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "value", value))


def fingerprint(kind: str, organization_id: str | None, config: dict[str, Any]) -> str:
    """Letta's ``SandboxConfig.fingerprint()``: the SHA-256 of the sorted-key, compact JSON of
    type, organization id and config, as a decimal integer string."""
    text = json.dumps(
        {"type": kind, "organization_id": organization_id, "config": config},
        sort_keys=True,
        separators=(",", ":"),
        default=_plain,
    )
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return str(int.from_bytes(digest, byteorder="big"))


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else str(value)


_MAX_REQUIREMENTS_BYTES = 1_000_000


def requirement_line(requirement: Any, where: str) -> str:
    """A requirement as pip takes it: a string as it is; a ``PipRequirement``-like object (or
    ``{"name", "version"}`` dict) as ``name==version``, or ``name`` without a version."""
    if isinstance(requirement, str):
        return requirement
    if isinstance(requirement, dict):
        name, version = requirement.get("name"), requirement.get("version")
    else:
        name, version = getattr(requirement, "name", None), getattr(requirement, "version", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: {requirement!r} has no package name")
    return f"{name}=={version}" if version else name


def requirements_txt(sandbox_dir: str) -> list[str]:
    """The requirement lines of ``sandbox_dir/requirements.txt`` (none when there is no file);
    relative paths are taken from ``sandbox_dir``.

    A tool may write this file (it runs with ``sandbox_dir`` as its working directory), and
    the host reads it with the host's rights: a symbolic link, a hard link or anything but a
    regular file is refused unread, so no file the tool could not read itself is shown back
    (in an error naming the requirements).

    Raises:
        ConfigError: the file is not a plain regular file, or holds a pip option.
    """
    path = Path(sandbox_dir) / REQUIREMENTS_TXT
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(f"{path} is a symbolic link; it is not read") from None
        raise ConfigError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ConfigError(f"{path} is not a regular file with one link; it is not read")
        text = fh.read(_MAX_REQUIREMENTS_BYTES + 1).decode("utf-8", errors="replace")
    if len(text) > _MAX_REQUIREMENTS_BYTES:
        raise ConfigError(f"{path} is larger than {_MAX_REQUIREMENTS_BYTES} bytes")
    lines = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise ConfigError(f"{path}: {line!r} is a pip option; only requirement lines are read")
        local = Path(sandbox_dir) / line
        lines.append(str(local.resolve()) if line.startswith(".") and local.exists() else line)
    return lines


def timeout_from_env() -> float:
    """``TOOL_SANDBOX_TIMEOUT`` in seconds (Letta's default, 180, when unset)."""
    text = os.environ.get(TIMEOUT_ENV_VAR)
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV_VAR}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_ENV_VAR}={text!r} must be positive")
    return value


def agent_env_vars(agent_state: Any) -> dict[str, str]:
    """An agent's own variables (Letta's per-agent secrets)."""
    if agent_state is None:
        return {}
    getter = getattr(agent_state, "get_agent_env_vars_as_dict", None)
    if callable(getter):
        return _strings(getter(), "agent_state.get_agent_env_vars_as_dict()")
    secrets = getattr(agent_state, "secrets", None)
    if secrets is None and isinstance(agent_state, dict):
        secrets = agent_state.get("secrets")
    if not secrets:
        return {}
    if isinstance(secrets, dict):
        return _strings(secrets, "agent_state.secrets")
    found: dict[str, Any] = {}
    for item in secrets:
        key = item.get("key") if isinstance(item, dict) else getattr(item, "key", None)
        value = item.get("value") if isinstance(item, dict) else getattr(item, "value", None)
        if isinstance(key, str):
            found[key] = value or ""
    return _strings(found, "agent_state.secrets")


def _strings(values: Any, where: str) -> dict[str, str]:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of names to values")
    return {str(k): str(v) for k, v in values.items() if v is not None}


def layered_env(
    sandbox_env_vars: dict[str, Any] | None,
    agent_state: Any,
    additional_env_vars: dict[str, Any] | None,
    ids: dict[str, str | None],
) -> dict[str, str]:
    """Letta's layering: sandbox variables < the agent's secrets < the call's additional
    variables, then ``LETTA_AGENT_ID`` / ``LETTA_PROJECT_ID`` / ``LETTA_TOOL_ID``."""
    env: dict[str, str] = {}
    env.update(_strings(sandbox_env_vars or {}, "sandbox_env_vars"))
    env.update(agent_env_vars(agent_state))
    env.update(_strings(additional_env_vars or {}, "additional_env_vars"))
    env.update({name: value for name, value in ids.items() if value})
    return env
