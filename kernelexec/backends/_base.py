"""The backend interface: where a kernel runs and the door every message goes through.

A :class:`KernelBackend` starts kernels; a :class:`KernelConnection` moves messages to and from
one kernel and controls it. Everything above this interface is written once in kernelexec and
never touches zmq, processes or HTTP: the readiness handshake, installing the kernel-side helper,
the execution policy (``stop_on_error``, ``allow_stdin``), the session's working directory, the
run loop, timeouts, output limits, the tool protocol, recording and the kernel budget.

Who calls what, and when (all on the executor's one event-loop thread). "The core" is the
executor's kernels (``_core/_executor.py``: configuration, pools, budget, lifecycle); sessions
are assembled above it (``_assembly``), and their features reach a kernel only through the
session's lease or through what the lease hands its watchers:

* :meth:`KernelBackend.check`, :meth:`KernelBackend.fingerprint` and
  :meth:`KernelBackend.isolation`: by the core, once per environment, before any kernel of that
  environment is started (``check`` also when the executor is made, for its default one).
* :meth:`KernelBackend.reserve` then :meth:`KernelBackend.hold`: by the core, once, when the
  executor is made (last, after everything that may refuse its configuration);
  :meth:`KernelBackend.release`: by the core after it has shut its kernels down at close.
* :meth:`KernelBackend.start`: by a warm pool (``_core/_pool.py``) when a session needs a kernel
  or a warm kernel is refilled. It returns once the channels are connected; the core's start-up
  (``_core/_startup.py``) then sends ``kernel_info`` requests until one is answered on shell
  and seen on iopub, and reads :meth:`KernelConnection.diagnostics` when a start fails.
* :meth:`KernelConnection.send`: by the run loop (``execute_request``), the readiness handshake
  (``kernel_info_request``), and any later caller that needs another message (comms,
  ``debug_request``, ``interrupt_request`` on control, the files link's requests).
* :meth:`KernelConnection.receive`: by whoever waits for a reply (one waiter at a time per
  connection). It also reports the kernel's death, as a :class:`KernelDied` value.
* :meth:`KernelConnection.ended`: by the session before it sends a request.
* :meth:`KernelConnection.limit_messages`: by code mode, before a run whose code may call the
  host.
* :meth:`KernelConnection.interrupt`: by the run loop at a timeout or cancellation, and by
  ``Session.interrupt``; it may be called while ``receive`` is awaited.
* :meth:`KernelConnection.restart` and :meth:`KernelConnection.shutdown`: by the pool when a
  session's kernel must be replaced, is evicted, or the executor closes.
* :meth:`KernelConnection.enter_workdir` and :meth:`KernelConnection.lend`: by the session's
  lease (``_core/_lease.py``) for each fresh kernel, and ``lend`` when a directory is lent.
* :meth:`KernelConnection.connection_info` and :meth:`KernelConnection.kernel_pid`: by the
  live-attach registration of ``attachable=True`` sessions, after each (re)start; ``kernel_pid``
  also for logs.
* :meth:`KernelConnection.family` (an optional capability: forking a live kernel): by
  kernelexec's branching (``kernelexec._branching``) when a session is forked or snapshotted;
  it then calls the :class:`KernelFamily` it got (see there).

Backends are found by name through the ``kernelexec.backends`` entry-point group (see
:func:`kernelexec.backends.get_backend`); the local backend is registered there too.
"""

from __future__ import annotations

import abc
import hashlib
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kernelexec._exceptions import ConfigError
from kernelexec._models import Isolation, IsolationLevel
from kernelexec._sandbox._lend import Loan

Channel = Literal["shell", "control", "iopub", "stdin"]


class KernelLaunch(BaseModel):
    """Everything that describes a kernel to start; one value per environment.

    Attributes:
        env: The kernel's environment variables, exactly (kernelexec has already applied the
            allowlist and the executor's ``env_vars``). A backend must not add the host's
            environment; it may add what the kernel needs to run (its own paths).
        interpreter: The Python interpreter to run the kernel with (a venv's), or None for the
            backend's default. Only backends that run interpreters on the host support it.
        kernel_name: The kernelspec to start, for backends that start kernels by name.
        isolation: The isolation level asked for (``"none"``: a plain process).
        limits: Resource limits asked for, by name (empty: none).
        network: Whether the kernel may use the network (None: the level's default).
        workdir: The host directory under which sessions' working directories are made, for
            backends that see the host filesystem (an isolating backend makes it, and no other
            session data, reachable). Like ``env`` it is per executor, not in fingerprints.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: dict[str, str] = Field(default_factory=dict)
    interpreter: str | None = None
    kernel_name: str | None = None
    isolation: IsolationLevel = "none"
    limits: dict[str, float] = Field(default_factory=dict)
    network: bool | None = None
    workdir: str | None = None


@dataclass(frozen=True, slots=True)
class KernelMessage:
    """One Jupyter message as kernelexec needs it.

    A plain dataclass rather than a pydantic model: thousands of these are made per second on
    the hot path and they never leave the library.
    """

    channel: Channel
    msg_type: str
    parent_id: str | None
    content: dict[str, Any]
    buffers: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class KernelDied:
    """The kernel is gone; :meth:`KernelConnection.receive` returns this instead of a message.

    Attributes:
        reason: What happened, in words (``"killed by SIGKILL"``, ``"exit code 1"``,
            ``"the gateway reports the kernel dead"``).
        detail: More for a person to read (the tail of the kernel's stderr), or ``""``.
        limit: The resource limit the kernel was killed for, with its value
            (``"memory_mb=256"``), or ``""`` when it was not killed for a limit.
    """

    reason: str
    detail: str = ""
    limit: str = ""


class KernelConnection(abc.ABC):
    """A live kernel: a door for messages both ways, and control over its lifecycle."""

    custom_messages: ClassVar[bool] = True
    """Whether :meth:`send` carries message types Jupyter does not define (kernelexec's own
    tool-call request) to the kernel and their replies back. A backend whose transport
    refuses or drops them sets this False; tool calls then go as execute requests."""

    serves_calls: bool = False
    """Set by kernelexec's core (not the backend) each time it has installed its helper in
    the kernel: whether the helper serves tool calls as their own message."""

    fenced: bool = False
    """Set like :attr:`serves_calls`: whether the helper answers kernelexec's fence request
    (sent after each run's request; the run ends on its answer)."""

    def limit_messages(self, msg_type: str, max_bytes: int) -> None:
        """From now on, hand on a message of ``msg_type`` from the kernel whose content and
        buffers pass ``max_bytes`` as a stub, never checked or parsed whole: its content is
        ``{"oversized": <bytes>}`` and the ``id``, ``module`` and ``name`` strings found in
        its first kilobyte. Called by code mode before a run whose kernel code may call the
        host, so that a tenant's oversized calls cost the host no parsing. The default does
        nothing (a transport that decodes whole messages first gains nothing from it).
        """
        return None

    @abc.abstractmethod
    async def send(
        self,
        channel: Literal["shell", "control"],
        msg_type: str,
        content: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        buffers: tuple[bytes, ...] = (),
    ) -> str:
        """Send one request on ``channel``; return its ``msg_id`` (replies carry it as parent).

        Must not block on the kernel: a request to a busy or dead kernel is queued or lost, and
        the caller learns which from :meth:`receive`.
        """

    @abc.abstractmethod
    async def receive(self, timeout: float) -> KernelMessage | KernelDied | None:
        """The next message from shell, control or iopub; :class:`KernelDied` once the kernel
        is gone (and on every later call, until :meth:`restart`); None after ``timeout``
        seconds without either.

        Messages already received are returned before the death is reported. Messages that
        fail to decode or carry a bad signature are dropped here: the kernel is an untrusted
        peer and must not be able to crash the host's receive loop.
        """

    def ended(self) -> bool | None:
        """Whether the kernel has ended, by a check that reads no message (a process status),
        or None when this backend cannot tell. Called by the session before it sends a
        request: code goes to a fresh kernel rather than to one that died between calls, and
        a request sent is never sent again (a kernel may run code and die before any of its
        output leaves it). Where it cannot tell (None, the default), a request to which
        nothing at all came back before the kernel's death is sent once more to a fresh
        kernel, as the only sign that it died first."""
        return None

    @abc.abstractmethod
    async def interrupt(self) -> None:
        """Ask the kernel to interrupt the running code; return without waiting for it."""

    @abc.abstractmethod
    async def restart(self) -> None:
        """Replace the kernel with a fresh one (state lost); return once its channels are
        connected. The caller repeats the readiness handshake."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the kernel now and release everything it held (files, sockets, directories).

        Safe to call more than once and on a dead kernel.
        """

    def diagnostics(self) -> str:
        """Text that helps explain a failed start (the tail of the kernel's stderr), or ``""``."""
        return ""

    async def enter_workdir(self, path: str) -> None:
        """Make the session's working directory ``path`` usable by this kernel.

        Called by the session's lease when it takes a fresh kernel, before its first request
        (which creates ``path`` if missing and changes into it). The default does nothing; a
        backend that runs each kernel as its own user hands the directory to that user.
        """
        return None

    async def lend(self, loan: Loan, workdir: str) -> None:
        """Show the host directory of ``loan`` (checked by the caller) to this kernel at the
        same path, in its mode; copy on write, the kernel's changes go to the session's working
        directory ``workdir``.

        Called by the session's lease for each directory lent to the session: once when it is
        lent, and again for each fresh kernel, after :meth:`enter_workdir`. The default does
        nothing: a kernel that runs as the host's user sees the host's directories already
        (and works in the lent directory itself). A backend that runs kernels as users of
        their own, in namespaces of their own, mounts the directory into the kernel's; a
        kernel that has ended is left alone (its replacement gets the loan).

        Raises:
            KernelStartError: it could not be shown to the kernel (the message says why).
        """
        return None

    def connection_info(self) -> dict[str, Any] | None:
        """A Jupyter connection file's content (transport, addresses, key) with which another
        client on this machine can reach the kernel, or None when it cannot (the default).

        Called by the live-attach registration of ``attachable=True`` sessions only, after
        each (re)start.
        """
        return None

    def kernel_pid(self) -> int | None:
        """The kernel's process id on this machine, or None when unknown (the default)."""
        return None

    def family(self) -> KernelFamily | None:
        """How this kernel can be forked (:class:`KernelFamily`), or None when it cannot be
        (the default: sessions of this backend cannot be forked or snapshotted)."""
        return None


class KernelTemplate(Protocol):
    """A frozen copy of a live kernel that forks branch kernels on request; made by
    kernelexec's branching, handed to :meth:`KernelFamily.branch`."""

    threads: list[str]
    """The user's threads of the kernel it was forked from (a branch warns of them)."""

    def fork(self, req: dict[str, Any], stderr: int) -> tuple[int, float]:
        """Fork a branch kernel (blocking) told ``req`` (its connection, directory,
        environment), its stderr the descriptor ``stderr``; its pid and how long the ``fork()``
        took."""
        ...

    def status(self, pid: int) -> int | None:
        """Reap the ended branch ``pid``; its exit status (None: unknown)."""
        ...


class KernelFamily(abc.ABC):
    """An optional capability of a connection (:meth:`KernelConnection.family`): its kernel
    can be forked, and this says how the processes forked from it run. Taken from the
    connection when it is snapshotted; a template keeps it for its branches.

    Who calls what (kernelexec's branching, on the executor's loop): :attr:`directory` and
    :meth:`hand_over` when it makes a template's directory, :meth:`seal` when the kernel has
    the branching kernel side installed and when a branch is ready, :meth:`branch` for each
    branch forked from a template of this family.

    Attributes:
        directory: A private directory of the family's first kernel, in its mount namespace,
            where templates' directories are made (removed with that kernel).
        forks_outlive: Whether processes forked from this kernel outlive it (not where its
            end ends every descendant, as a launcher's kernel's does).
    """

    directory: str
    forks_outlive: bool

    @abc.abstractmethod
    def hand_over(self, path: str) -> None:
        """Give the directory ``path`` (a template's) to the user the family runs as."""

    @abc.abstractmethod
    def seal(self) -> None:
        """Close this kernel's channels to the others of its family: they run as the same
        user, and must neither read its key nor connect to it."""

    @abc.abstractmethod
    async def branch(self, template: KernelTemplate, origin: str) -> KernelConnection:
        """Fork a branch kernel from ``template`` (of this family); return it once its channels
        are connected. ``origin`` names the session it branches from. Nothing is left running
        when it fails or is cancelled.

        Raises:
            BranchError: the branch exited at once or the template is gone.
        """


class KernelBackend(abc.ABC):
    """Starts kernels. One backend instance may serve many executors.

    Attributes:
        name: The name the backend is registered under in the ``kernelexec.backends``
            entry-point group.
        host_filesystem: True when kernels see the host's filesystem, so session working
            directories are host paths that kernelexec creates and removes; False when they are
            paths on the kernel's side (made by the kernel when a session starts).
        default_isolation: The isolation level of kernels when the executor names none.
        filters_env: True when the service that starts kernels may drop variables of
            :attr:`KernelLaunch.env` (a gateway passes on only those on its whitelist):
            kernelexec then also sets the executor's ``env_vars`` in each fresh kernel, with
            the first request a session sends it (too late for what the interpreter reads at
            start, such as ``PYTHONPATH``).
    """

    name: ClassVar[str] = "custom"
    host_filesystem: ClassVar[bool] = False
    default_isolation: ClassVar[IsolationLevel] = "none"
    filters_env: ClassVar[bool] = False

    @abc.abstractmethod
    async def start(self, launch: KernelLaunch, *, timeout: float) -> KernelConnection:
        """Start a kernel as ``launch`` describes; return once its channels are connected.

        Raises:
            KernelStartError: the kernel could not be started within ``timeout`` seconds, with
                the tail of its stderr when there is one. Nothing is left running.
        """

    def check(self, launch: KernelLaunch) -> None:
        """Refuse what this backend cannot do, before anything is started.

        The default accepts only the environment: no interpreter, kernel name, isolation,
        limits or network setting.

        Raises:
            ConfigError: naming the field and the backend.
        """
        unsupported = []
        if launch.interpreter is not None:
            unsupported.append("interpreter (virtual environments)")
        if launch.kernel_name is not None:
            unsupported.append("kernel_name")
        if launch.isolation != "none":
            unsupported.append(f"isolation={launch.isolation!r}")
        if launch.limits:
            unsupported.append(f"limits ({', '.join(sorted(launch.limits))})")
        if launch.network is not None:
            unsupported.append("network")
        if unsupported:
            raise ConfigError(
                f"the {self.name!r} backend does not support {', '.join(unsupported)}"
            )

    def fingerprint(self, launch: KernelLaunch, base: str) -> str:
        """The fingerprint of kernels started from ``launch``.

        ``base`` is the environment's own fingerprint (``LocalEnv``/``VenvEnv``). The default
        mixes in :meth:`describe` and the launch's kernel name, isolation, limits and network
        setting (never ``env``: variables are per executor, not per environment).
        """
        parts = [
            base,
            self.describe(),
            str(launch.kernel_name),
            launch.isolation,
            repr(sorted(launch.limits.items())),
            str(launch.network),
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def hold(self) -> None:
        """An executor starts using this backend (called once, when it is made).

        With :meth:`release`, lets a backend keep helpers (a fork server) for as long as some
        executor uses it. The default does nothing.
        """
        return None

    def reserve(self, kernels: int) -> None:
        """An executor made with ``max_kernels=kernels`` holds this backend (called once, when
        it is made, before :meth:`hold`).

        A backend whose kernels cost this process resources (descriptors, sockets) makes room
        for that many here, or raises when the host cannot. The default does nothing.

        Raises:
            HostLimitError: the host cannot hold ``kernels`` kernels.
        """
        return None

    async def release(self) -> None:
        """An executor that called :meth:`hold` has closed (its kernels are shut down).

        The default does nothing.
        """
        return None

    def describe(self) -> str:
        """A short text identifying where this backend runs kernels (for logs and fingerprints)."""
        return type(self).__name__

    def isolation(self, launch: KernelLaunch) -> Isolation:
        """What kernels started from ``launch`` get: the level, and the mechanism of each limit
        and boundary (``Session.isolation``).

        Called by the executor once per environment. The default describes a backend that
        enforces nothing (:meth:`check` refuses the rest).
        """
        return Isolation(level="none")


# Asking a kernel half: the kernel halves that serve kernelexec's own shell messages (files,
# commands, branching) are asked through ask(); a reply that does not come in time, or a kernel
# that dies meanwhile, is a Stalled value the caller turns into its own error (it knows what
# was lost).


@dataclass(frozen=True, slots=True)
class Stalled:
    """No reply within the time allowed (``died``: the kernel died meanwhile)."""

    died: KernelDied | None = None


async def ask(
    conn: KernelConnection,
    msg_type: str,
    content: dict[str, Any],
    *,
    reply_type: str,
    timeout: float,
    metadata: dict[str, Any] | None = None,
    buffers: tuple[bytes, ...] = (),
) -> KernelMessage | Stalled:
    """Send one shell request and wait for its reply (other messages are passed over: the
    caller holds the session, so they can only be late ones of a finished run)."""
    msg_id = await conn.send("shell", msg_type, content, metadata=metadata, buffers=buffers)
    return await wait_reply(conn, msg_id, reply_type, timeout)


async def wait_reply(
    conn: KernelConnection, msg_ids: str | Collection[str], reply_type: str, timeout: float
) -> KernelMessage | Stalled:
    """The reply of type ``reply_type`` to ``msg_ids`` (the first to come when several are
    awaited: the kernel answers its shell requests in order), or :class:`Stalled` after
    ``timeout``."""
    ids = {msg_ids} if isinstance(msg_ids, str) else msg_ids
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Stalled()
        msg = await conn.receive(left)
        if msg is None:
            continue
        if isinstance(msg, KernelDied):
            return Stalled(died=msg)
        if msg.parent_id in ids and msg.channel == "shell" and msg.msg_type == reply_type:
            return msg
