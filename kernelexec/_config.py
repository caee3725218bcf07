"""Executor configuration, validated once at construction, and its fields as typed keyword
arguments of the executors' constructors."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kernelexec._envs._envs import Env, LocalEnv, VenvEnv
from kernelexec._exceptions import ConfigError, describe_problems
from kernelexec._models import DEFAULT_ENV_ALLOWLIST, IsolationLevel, Limits, check_isolation
from kernelexec._public import public


def valid_timeout(value: Any, what: str = "timeout", *, zero: bool = False) -> float:
    """``value`` as seconds, if it is a finite positive number (``zero``: or 0).

    Refused: ``bool`` (``True`` is not one second), strings, NaN (every comparison with it is
    false, so it would mean no timeout at all), infinities and negative numbers.

    Raises:
        ConfigError: naming ``what`` and the value.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 or (zero and value == 0)):
        return float(value)
    need = "a finite number >= 0" if zero else "a finite positive number"
    raise ConfigError(f"{what} must be {need} of seconds, got {value!r}")


class ExecutorConfig(BaseModel):
    """Settings of an :class:`~kernelexec.AsyncKernelExecutor`; unknown fields are rejected.

    Attributes:
        env_vars: Variables every kernel gets, on top of the allowlisted host variables.
        env_allowlist: Host environment variables passed through to kernels (when set).
        default_timeout: Seconds a run may take when the call gives no ``timeout``.
        interrupt_grace: Seconds to wait after interrupting a timed-out run before the kernel
            is killed and restarted (state lost).
        output_grace: Seconds to wait for the end of a run's output after its reply arrived.
        start_timeout: Seconds a kernel may take to start and answer.
        max_kernels: Most kernels alive at once (sessions plus prewarmed).
        prewarm: Kernels kept started but unassigned, so a new session starts without delay.
        idle_timeout: Seconds after which an idle session's kernel is shut down (None: never).
        max_output_chars: Characters of stdout+stderr kept per run; the rest is dropped with a
            marker.
        max_result_chars: Largest tool return value, in characters of JSON (also the largest
            answer of a host function to kernel code).
        max_host_calls: Calls one run's code may make to host functions (code mode); later
            calls get ``HostCallLimitExceeded``.
        max_host_call_bytes: Largest arguments of one host call, and largest answer of a host
            function, in bytes of UTF-8 JSON (code mode); past it the call fails in the kernel
            with ``HostCallLimitExceeded`` and the host function does not run (or its answer is
            dropped). Bounds the host memory one call can hold.
        max_host_calls_in_flight: Host calls of one session accepted and not yet answered;
            the kernel half waits for a free slot before sending more, and a call forged past
            it fails with ``HostCallLimitExceeded`` without running. With
            ``max_host_call_bytes`` it bounds the argument bytes a session pins on the host.
            At most 512: well below the 1,000 messages ZeroMQ queues before dropping.
        workdir: Directory under which each session gets its working directory (default: a
            private temporary directory removed on close).
        record: Record every run of every session as a notebook cell (``Session.notebook``).
        env: The default environment: ``LocalEnv()`` (this interpreter) or a ``VenvEnv``.
        cache_dir: Where virtual environments are built (default: ``$KERNELEXEC_CACHE_DIR``,
            else the platform's user cache directory).
        installer: How venvs are built: ``"auto"`` (uv when available, else venv + pip),
            ``"uv"`` or ``"pip"``.
        record_dir: Also save each session's recording to ``<record_dir>/<agent id>.ipynb``
            after every run (implies ``record``; created if missing).
        isolation: ``"process"`` (limits, a scrubbed environment, every descendant reaped, its
            own user on a root host), ``"bwrap"`` (bubblewrap namespaces on top) or ``"none"``
            (a plain process of the host user); None: the backend's default (``"process"`` for
            the local backend). See the README's Security model.
        limits: Resource limits per kernel (None: the defaults; not allowed with ``"none"``).
        memory_budget_mb: Memory of all of this executor's kernels together, in MiB (a parent
            cgroup holding their groups). None: three quarters of the host's memory where a
            cgroup memory controller is writable, else no budget. When the kernels together
            reach it, the kernel using the most memory is killed and its run fails with
            ``kind="limit_exceeded"`` naming ``memory_budget_mb``; its next run gets a fresh
            kernel. Needs ``"process"`` or ``"bwrap"``.
        network: Whether kernels may use the network; None: off under ``"bwrap"`` (loopback
            only), on otherwise. ``False`` needs ``"bwrap"``.
        attachable: Register each session's kernel (its connection file, mode 0600, in a
            private per-user directory) so that ``kernelexec attach`` can open a console on it.
            A security choice, off by default: whoever can read that file (this user) can run
            code in the agent's kernel.
        fast_calls: Send tool calls as kernelexec's own shell message, served by its helper in
            the kernel without IPython's execute machinery (about twice as fast); False, or
            ``KERNELEXEC_FAST_CALLS=0`` in the environment, sends them as execute requests.
            Kernels that cannot serve them (another ipykernel) get execute requests anyway.
        state_dir: Make sessions durable: a session whose kernel is taken away (``max_kernels``,
            ``idle_timeout``, close) is hibernated here first and restored into a fresh kernel
            on its next call; a new executor on the same directory resumes each agent by its
            id. Private to this user (0700); several executors (processes, hosts on a shared
            filesystem) may use one: an agent lives in one of them at a time and moves on
            request (``handoff_timeout``). Loading a checkpoint runs code (as unpickling
            does): never share it with untrusted writers. See ``docs/durable.md``.
        checkpoint: When a durable session saves: ``"on_evict"`` (when its kernel goes) or
            ``"after_call"`` (also after every call that changed something, so a killed host
            keeps every completed call's state).
        max_checkpoint_bytes: Largest checkpoint of one session (its working directory's files
            included).
        handoff_timeout: Seconds ``session(agent_id)`` waits for another executor on the
            ``state_dir`` to hand over an agent it holds (hibernated when its current call
            ends) before raising :class:`~kernelexec.AgentBusyError`. A dead holder on this
            host is taken over at once; one on another host whose heartbeat stopped, after
            10 s (keep this above that).
        setup_code: Code run in every session's fresh kernel (at its start and after every
            restart, crash or eviction) before the session's next call, so helpers and tools
            it defines are always there; a failure is the call's result
            (``error.kind == "setup_failed"``) and the setup is tried again before the next.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    env_vars: dict[str, str] = Field(default_factory=dict)
    env_allowlist: tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    default_timeout: float = Field(60.0, gt=0)
    interrupt_grace: float = Field(2.0, ge=0)
    output_grace: float = Field(5.0, ge=0)
    start_timeout: float = Field(30.0, gt=0)
    max_kernels: int = Field(16, ge=1)
    prewarm: int = Field(0, ge=0)
    idle_timeout: float | None = Field(None, gt=0)
    max_output_chars: int = Field(1_000_000, ge=100)
    max_result_chars: int = Field(10_000_000, ge=100)
    max_host_calls: int = Field(1000, ge=1)
    max_host_call_bytes: int = Field(1 << 20, ge=1024)
    max_host_calls_in_flight: int = Field(64, ge=1, le=512)
    workdir: Path | None = None
    record: bool = False
    env: Env = Field(default_factory=LocalEnv)
    cache_dir: Path | None = None
    installer: Literal["auto", "uv", "pip"] = "auto"
    record_dir: Path | None = None
    isolation: IsolationLevel | None = None
    limits: Limits | None = None
    memory_budget_mb: int | None = Field(None, ge=128)
    network: bool | None = None
    attachable: bool = False
    fast_calls: bool = True
    state_dir: Path | None = None
    checkpoint: Literal["on_evict", "after_call"] = "on_evict"
    max_checkpoint_bytes: int = Field(8 << 30, ge=1)
    handoff_timeout: float = Field(30.0, gt=0)
    setup_code: str | None = None

    @field_validator(
        "default_timeout",
        "interrupt_grace",
        "output_grace",
        "start_timeout",
        "idle_timeout",
        "handoff_timeout",
        mode="before",
    )
    @classmethod
    def _seconds(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.field_name == "idle_timeout":
            return None
        try:
            return valid_timeout(
                value, "seconds", zero=info.field_name in ("interrupt_grace", "output_grace")
            )
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("workdir", "record_dir", "cache_dir", "state_dir")
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @model_validator(mode="after")
    def _check(self) -> ExecutorConfig:
        if self.prewarm > self.max_kernels:
            raise ValueError(f"prewarm ({self.prewarm}) exceeds max_kernels ({self.max_kernels})")
        if self.record_dir is not None:
            object.__setattr__(self, "record", True)
        limits = self.limits.given() if self.limits is not None else {}
        budget = ["memory_budget_mb"] if self.memory_budget_mb is not None else []
        try:
            check_isolation(self.isolation, [*limits, *budget], self.network)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


def make_config(**kwargs: object) -> ExecutorConfig:
    """Build a config, turning pydantic's error into a :class:`ConfigError` naming the field."""
    try:
        return ExecutorConfig(**kwargs)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = describe_problems(exc.errors(), default="config")
        raise ConfigError(f"invalid executor configuration: {problems}") from None


class ExecutorOptions(TypedDict, total=False):
    """The :class:`ExecutorConfig` fields as keyword arguments of an executor's constructor,
    typed as callers may pass them (paths as ``str`` too), so that a type checker or an editor
    flags a misspelt or mistyped setting before it runs. Their meaning and defaults are
    documented on :class:`ExecutorConfig`, which validates them (and raises
    :class:`~kernelexec.ConfigError` for a bad one at run time)."""

    env_vars: Mapping[str, str]
    env_allowlist: Sequence[str]
    default_timeout: float
    interrupt_grace: float
    output_grace: float
    start_timeout: float
    max_kernels: int
    prewarm: int
    idle_timeout: float | None
    max_output_chars: int
    max_result_chars: int
    max_host_calls: int
    max_host_call_bytes: int
    max_host_calls_in_flight: int
    workdir: str | os.PathLike[str] | None
    record: bool
    env: LocalEnv | VenvEnv
    cache_dir: str | os.PathLike[str] | None
    installer: Literal["auto", "uv", "pip"]
    record_dir: str | os.PathLike[str] | None
    isolation: IsolationLevel | None
    limits: Limits | None
    memory_budget_mb: int | None
    network: bool | None
    attachable: bool
    fast_calls: bool
    state_dir: str | os.PathLike[str] | None
    checkpoint: Literal["on_evict", "after_call"]
    max_checkpoint_bytes: int
    handoff_timeout: float
    setup_code: str | None


public(__name__)
