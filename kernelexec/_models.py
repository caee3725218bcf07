"""Values that cross kernelexec's API: run results, their errors, and the record observers get.

Result models are shaped after nbformat (``outputs`` are nbformat v4 output dicts) so that
recording a run as a notebook cell is a mapping, not a translation.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernelexec._exceptions import (
    ConfigError,
    ExecutionError,
    ExecutionTimeout,
    describe_problems,
)
from kernelexec._public import public
from kernelexec._tools._tool import Tool

HostFunctions = Mapping[str, Iterable[Any]] | Iterable[Any]
"""``host_functions=``: functions (into module ``"tools"``), or module name -> functions."""

ErrorKind = Literal[
    "exception",
    "timeout",
    "kernel_died",
    "invalid_args",
    "invalid_tool",
    "result_too_large",
    "env_setup_failed",
    "cancelled",
    "limit_exceeded",
    "setup_failed",
]

IsolationLevel = Literal["none", "process", "bwrap"]
"""An isolation level: ``"none"`` (a plain process of the host user), ``"process"`` (limits, a
scrubbed environment, every descendant reaped, its own user on a root host) or ``"bwrap"``
(bubblewrap namespaces on top)."""

ISOLATION_LEVELS: tuple[IsolationLevel, ...] = get_args(IsolationLevel)


def check_isolation(
    level: IsolationLevel | None, limits: Iterable[str], network: bool | None
) -> None:
    """Refuse what no host can give at ``level``: limits at ``"none"``, and taking the network
    away anywhere but under ``"bwrap"``. The one check of these rules: the executor's
    configuration (where ``level`` None is the backend's default, not known yet) and every
    sandbox plan call it.

    Raises:
        ConfigError: naming the setting and the level it needs.
    """
    asked = sorted(limits)
    if level == "none" and asked:
        raise ConfigError(
            f"limits need isolation 'process' or 'bwrap', not 'none' (asked: {', '.join(asked)})"
        )
    if network is False and level not in ("bwrap", None):
        raise ConfigError(
            f"network=False needs isolation='bwrap' (a network namespace); "
            f"isolation={level!r} cannot take the network away"
        )


DEFAULT_ENV_ALLOWLIST: tuple[str, ...] = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TERM",
    "USER",
    "LOGNAME",
    "HOME",
    "TMPDIR",
    "SYSTEMROOT",
)
"""Host environment variables a kernel inherits (when set); everything else is dropped."""


class Limits(BaseModel):
    """Resource limits of each kernel; a field left at None gets kernelexec's default.

    A limit given here is enforced or refused: when the host has no mechanism for it, the
    executor raises :class:`~kernelexec.ConfigError` naming the limit and what is missing. The
    defaults (:data:`DEFAULT_LIMITS`) are applied with the best mechanism the host has and
    reported in ``Session.isolation``.

    Attributes:
        memory_mb: Memory of the kernel and its children, in MiB (cgroup memory; else
            ``RLIMIT_AS`` per process, which counts address space, not resident memory).
        cpus: CPU time share as a number of cores (cgroup CPU quota; no fallback).
        max_processes: Processes and threads of the kernel and its children (cgroup pids;
            else ``RLIMIT_NPROC`` when the kernel runs as its own user; no other fallback).
        max_open_files: Open file descriptors per process (``RLIMIT_NOFILE``; at least 128,
            which ipykernel needs).
        max_file_mb: Largest file a process may write, in MiB (``RLIMIT_FSIZE``: writing past
            it raises ``OSError`` "File too large"; it bounds one file, not the disk).
        max_disk_mb: What the kernel may write in all, in MiB, shared out among its writable
            places: half for the session directory it works in and a quarter for its own
            directory (``HOME``), on a root host (a tmpfs each, copied back to the disk when
            the kernel ends); a quarter for its private scratch space (``/tmp``, ``/var/tmp``
            and ``/dev/shm``: one size-capped tmpfs at ``"process"`` on a root host, halved
            between two at ``"bwrap"``). Writing past a place's share fails with
            ``ENOSPC``. Needs a mount namespace
            (``"bwrap"``, or ``"process"`` on a root host). See ``docs/security.md`` for what
            it does not cover.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int | None = Field(None, ge=64)
    cpus: float | None = Field(None, gt=0)
    max_processes: int | None = Field(None, ge=32)
    max_open_files: int | None = Field(None, ge=128)
    max_file_mb: int | None = Field(None, ge=1)
    max_disk_mb: int | None = Field(None, ge=16)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid limits: {describe_problems(exc.errors())}") from None

    def given(self) -> dict[str, float]:
        """The limits set explicitly, by name."""
        return {k: float(v) for k, v in self.model_dump().items() if v is not None}


class Isolation(BaseModel):
    """What is in force for a session's kernel (``Session.isolation``).

    Attributes:
        level: ``"none"``, ``"process"`` or ``"bwrap"``.
        limits: Per limit (``memory_mb``...), its value and the mechanism enforcing it, e.g.
            ``"256 (cgroup v1 memory.limit_in_bytes)"``; absent when the limit is not enforced.
        boundaries: Per boundary (``environment``, ``user``, ``filesystem``, ``network``,
            ``processes``, ``descendants``), the mechanism that draws it, or why there is none.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: IsolationLevel
    limits: dict[str, str] = Field(default_factory=dict)
    boundaries: dict[str, str] = Field(default_factory=dict)


def now_iso() -> str:
    """The current UTC time in ISO 8601 with milliseconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


class ExecError(BaseModel):
    """Why a run failed.

    Attributes:
        kind: ``exception`` (the code raised), ``timeout``, ``kernel_died``, ``invalid_args``
            (arguments did not match the tool's schema; the tool did not run), ``invalid_tool``
            (the tool's source did not compile or lacks the function), ``result_too_large``
            (the return value or agent state is over ``max_result_chars`` as JSON),
            ``env_setup_failed``
            (its virtual environment could not be built; ``evalue`` ends with the installer's
            output), ``cancelled`` (the caller cancelled the call: seen only in recordings,
            since the caller got ``CancelledError``), ``limit_exceeded`` (the kernel was
            killed for a resource limit; ``evalue`` names the limit and its value),
            ``setup_failed`` (the session's ``setup_code`` failed in a fresh kernel; the call
            did not run, ``ename``/``traceback`` are the setup's error). Only
            kernelexec's own checks set the kinds other than ``exception``;
            an exception's class name never does.
        ename: Exception class name (e.g. ``"ValueError"``).
        evalue: Exception message.
        traceback: Traceback lines as the kernel sent them (may contain ANSI colour codes).
    """

    model_config = ConfigDict(extra="forbid")

    kind: ErrorKind
    ename: str
    evalue: str
    traceback: list[str] = Field(default_factory=list)


HostCallOutcome = Literal["ok", "error", "timeout", "invalid_args", "refused", "cancelled"]


class HostCallContext(BaseModel):
    """What a host function learns about the call when it has a ``context`` parameter.

    Attributes:
        agent_id: The session's agent id.
        module: The module kernel code imported the function from (``"tools"``).
        function: The function's name.
        call_id: The call's id, unique within its run.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    module: str
    function: str
    call_id: str


class HostCall(BaseModel):
    """One call from kernel code to a host function, as the host saw it.

    Attributes:
        module: The module the function was exposed as.
        name: The function's name.
        arguments: The arguments kernel code passed (JSON).
        duration_s: Seconds from the call's arrival on the host to its answer.
        outcome: ``"ok"``, ``"error"`` (the function raised), ``"timeout"`` (its own timeout),
            ``"invalid_args"``, ``"refused"`` (not exposed, or over the run's call limit) or
            ``"cancelled"`` (the run was interrupted or ended first).
        result: The return value (JSON) when the outcome is ``"ok"``.
        error: The message kernel code got otherwise (the host exception's class and message).
    """

    model_config = ConfigDict(extra="ignore")

    module: str
    name: str
    arguments: Any = None
    duration_s: float = 0.0
    outcome: HostCallOutcome
    result: Any = None
    error: str | None = None


class Restored(BaseModel):
    """What a restore brought back into a fresh kernel (``Execution.restored``).

    Attributes:
        names: The user's names that came back, sorted.
        bytes: Size of the checkpoint that was read.
        seconds: Time the restore took (reading, loading, replaying).
        saved_at: When the checkpoint was written (ISO 8601, UTC).
        not_restored: Each name that did not come back, with why (also in
            ``lost_variables``).
        replayed: Names rebuilt by running the recorded cells that made them again.
        problems: What was wrong with the checkpoint (damaged, missing files): nothing of
            what it says was loaded as a wrong value.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    names: list[str] = Field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    saved_at: str | None = None
    not_restored: dict[str, str] = Field(default_factory=dict)
    replayed: list[str] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)


class Hibernation(BaseModel):
    """What :meth:`~kernelexec.AsyncSession.hibernate` saved.

    Attributes:
        saved: The user's names saved, sorted.
        not_saved: Each name that could not be saved, with why (it will be reported lost).
        bytes: Size of the checkpoint on disk.
        seconds: Time the save took.
        written_bytes: Bytes written by this save (unchanged records are not written again).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    saved: list[str] = Field(default_factory=list)
    not_saved: dict[str, str] = Field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    written_bytes: int = 0


class HibernatedAgent(BaseModel):
    """One agent's saved state in a ``state_dir`` (``kernelexec sessions --state-dir``).

    Attributes:
        agent_id: The agent.
        env: The environment fingerprint, when not the executor's default environment.
        names: The saved names.
        bytes: Size on disk.
        saved_at: When it was saved (ISO 8601, UTC).
        age_s: Seconds since then.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_id: str
    env: str = ""
    names: list[str] = Field(default_factory=list)
    bytes: int = 0
    saved_at: str | None = None
    age_s: float = 0.0


class Variable(BaseModel):
    """One of the user's variables in a session's kernel (``AsyncSession.variables``).

    Attributes:
        name: The name the user's code bound.
        type: The value's qualified type name, such as ``"builtins.int"``.
        summary: At most 200 characters: a bounded repr (``"'abc'"``), a shape
            (``"DataFrame 1000x5"``, ``"list of 3 items"``), or what stopped one (a repr that
            raised, or ran out of time).
        size_bytes: The object's own size (``sys.getsizeof`` for builtin values, ``nbytes``
            for arrays), not counting what it refers to; None where measuring it would run
            the value's own code.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    type: str
    summary: str
    size_bytes: int | None = None


class StateChanges(BaseModel):
    """What a run did to the session's names (``Execution.changes``), each list sorted; the
    same names as :meth:`AsyncSession.variables` lists.

    Attributes:
        added: Names bound by the run that were not bound before it.
        changed: Names bound to another object than before the run (a list changed in
            place keeps its object: it is not listed).
        removed: Names bound before the run and not after it.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    added: list[str] = Field(default_factory=list)
    changed: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)

    def describe(self) -> str:
        """One short line for a model: ``"added x, y; changed z"`` (``"no names changed"``)."""
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (
                ("added", self.added),
                ("changed", self.changed),
                ("removed", self.removed),
            )
            if names
        ]
        return "; ".join(parts) or "no names changed"


class Execution(BaseModel):
    """The outcome of running code in a kernel.

    Attributes:
        status: ``"success"`` or ``"error"``.
        stdout: Everything written to stdout, possibly truncated with a marker.
        stderr: Everything written to stderr, possibly truncated with a marker.
        outputs: nbformat v4 output dicts (streams, display data, results, errors) in order.
        result: ``text/plain`` of the execute_result, if the code produced one.
        error: Why the run failed, when ``status == "error"``.
        execution_count: The kernel's execution counter for this run.
        duration_s: Wall-clock seconds from sending the request to having the whole result.
        kernel_restarted: True when this run cost the session its kernel state.
        lost_variables: When state was lost, the user variable names that existed before.
        lost_outputs: Output messages the kernel sent that never arrived (refused by the
            host, or lost by a broken transport; a slow host slows the kernel instead of
            losing output); ``stdout`` then ends with a
            ``[kernelexec: N output messages ... lost ...]`` marker. 0 when all arrived.
        recording_error: Why this run could not be saved to the session's recording file
            (``None`` when it was saved, or nothing is recorded to a file). The notebook stays
            complete in memory and the next save writes it whole.
        widgets_dropped: How many ipywidgets the code displayed. No frontend renders them
            here, so ``outputs`` holds only their text fallback.
        host_calls: The calls kernel code made to host functions during the run (code mode,
            see ``AsyncSession.expose``), in the order they finished.
        restored: Set on the first result after the session's state was restored from its
            ``state_dir`` into a fresh kernel: what came back (names that did not are in
            ``lost_variables``).
        changes: The names the run added, rebound and removed (all empty when it changed
            none, or when it was rolled back).
        rolled_back: True when the run was atomic (``atomic=True``) and failed: the
            session's variables and working-directory files are as they were before it.
    """

    model_config = ConfigDict(extra="forbid")

    status: Literal["success", "error"]
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = Field(default_factory=list)
    result: str | None = None
    error: ExecError | None = None
    execution_count: int | None = None
    duration_s: float = 0.0
    kernel_restarted: bool = False
    lost_variables: list[str] = Field(default_factory=list)
    lost_outputs: int = 0
    recording_error: str | None = None
    widgets_dropped: int = 0
    host_calls: list[HostCall] = Field(default_factory=list)
    restored: Restored | None = None
    changes: StateChanges = Field(default_factory=StateChanges)
    rolled_back: bool = False

    @property
    def ok(self) -> bool:
        """True when the run succeeded."""
        return self.status == "success"

    def raise_for_error(self) -> None:
        """Raise :class:`~kernelexec.ExecutionError` (or ``ExecutionTimeout``) if the run failed."""
        if self.status == "success":
            return
        if self.error is not None and self.error.kind == "timeout":
            raise ExecutionTimeout(self)
        raise ExecutionError(self)

    def _repr_markdown_(self) -> str:
        if self.error is not None:
            return f"**{self.error.kind}** `{self.error.ename}: {self.error.evalue}`"
        return f"`{self.result}`" if self.result is not None else f"```\n{self.stdout}\n```"


class ToolResult(Execution):
    """The outcome of a tool call (field names follow Letta's sandbox result).

    Attributes:
        func_return: The tool's return value as JSON data (see the conversion rules in the
            README); ``None`` when the call failed.
        agent_state: The agent state after the call, when the tool takes ``agent_state``; a
            pydantic model passed in comes back as the same class.
        sandbox_config_fingerprint: Identifies the environment the tool ran in.
    """

    func_return: Any = None
    agent_state: Any = None
    sandbox_config_fingerprint: str | None = None

    def _repr_markdown_(self) -> str:
        head = f"**{self.status}** in {self.duration_s * 1000:.1f} ms"
        parts = [head]
        if self.error is not None:
            parts.append(f"{self.error.kind}: `{self.error.ename}: {self.error.evalue}`")
        else:
            value = json.dumps(self.func_return, ensure_ascii=False, indent=2, default=str)
            parts.append(f"func_return:\n```json\n{value}\n```")
        if self.stdout:
            parts.append(f"stdout:\n```\n{self.stdout}\n```")
        if self.stderr:
            parts.append(f"stderr:\n```\n{self.stderr}\n```")
        return "\n\n".join(parts)


class RunRecord(BaseModel):
    """One finished run as the session hands it to its observers (the notebook recorder).

    Frozen and complete: an observer needs nothing else from the session.

    Attributes:
        kind: ``"code"`` (``run_code``) or ``"tool_call"``.
        agent_id: The session's agent id.
        result: The run's result. For a tool call in a recorded session it still holds the
            return value as IPython displayed it (``execute_result``), which the caller's
            ``ToolResult`` does not.
        code: The code run (``kind == "code"``).
        tool: The tool called (``kind == "tool_call"``).
        args: The call's JSON arguments.
        agent_state: The agent state passed in.
        ran: False when the run never reached a kernel (rejected arguments, no environment).
        started: When the run was submitted (UTC, ISO 8601).
        finished: When its result was complete.
        timeout_s: The timeout it ran under.
        kernel_generation: Which of the session's kernels ran it (1 for the first; 0: none).
        language_info: The kernel's ``language_info`` when this run learned it.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    kind: Literal["code", "tool_call"]
    agent_id: str
    result: Execution
    code: str | None = None
    tool: Tool | None = None
    args: dict[str, Any] | None = None
    agent_state: Any = None
    ran: bool = True
    started: str
    finished: str
    timeout_s: float
    kernel_generation: int = 0
    language_info: dict[str, Any] | None = None


public(__name__)
