"""``SessionState``: one session's durable state: saving it from its kernel into the store,
restoring it into a fresh kernel, and the after-call checkpoints.

It is a watcher of the session's lease (see ``kernelexec._core._lease.KernelWatcher``), told
always while the session is held (no call runs meanwhile): ``attached`` when a fresh kernel is
attached (the state is restored into it), ``leaving`` before the kernel goes (saved when it is
evicted, stale when it was lost), ``after_run`` with what the kernel side reported after a call.
The session's ``hibernate`` delegates to :meth:`SessionState.hibernate`. It talks to the kernel
through the runner the lease hands it (one of kernelexec's own requests), never to a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kernelexec import _trees
from kernelexec._durable import _files
from kernelexec._durable import _kernel_state as ks
from kernelexec._durable._handoff import AgentClaim
from kernelexec._durable._store import Manifest, StateStore, now_iso
from kernelexec._exceptions import CheckpointTooLargeError, StateError
from kernelexec._models import Hibernation, Restored
from kernelexec._observability._logtext import untrusted
from kernelexec._observability._otel import telemetry
from kernelexec._protocol._install import ExecuteRequest, Installed, KernelModule, install_request

if TYPE_CHECKING:
    from kernelexec._core._lease import Arrival, LeasedKernel, Leaving

log = logging.getLogger("kernelexec")

Runner = Callable[[ExecuteRequest, float], Awaitable[dict[str, Any]]]
"""Runs one of kernelexec's own requests on the session's kernel; returns the reply."""

Replayer = Callable[[list[str], Runner], Awaitable[list[str]]]
"""Rebuilds names by replaying the recorded cells that made them; returns those rebuilt."""

_ENDED = "the host ended before the session's first checkpoint"
_KEY = "kx_state"
_META = "kernelexec_state"
_TIMEOUT = 600.0
KERNEL_MODULE = KernelModule(ks.MODULE_NAME, ks.__name__, entry=None, keep=True)
"""Durable state's kernel half: a kernel that has it keeps it (and what it remembers of the
last save), whatever the request carries."""


class Hibernating(Protocol):
    """What :meth:`SessionState.hibernate` and a hand-over need of the session's lease."""

    @property
    def kernel(self) -> LeasedKernel | None:
        """The attached kernel, if any."""

    @property
    def has_kernel(self) -> bool:
        """Whether a kernel is attached now."""

    @property
    def busy(self) -> bool:
        """Whether a call runs or waits to run."""

    def hold(self) -> AbstractAsyncContextManager[None]:
        """Exclusive use of the session, after the calls made before."""

    async def give_back(self, why: Literal["evict", "saved"]) -> None:
        """Give the kernel back now (the caller holds the lease)."""


class _Handing:
    """A session's lease as a hand-over to another executor sees it (``_handoff.Holdable``):
    hibernated through the session's state."""

    def __init__(self, lease: Hibernating, state: SessionState) -> None:
        self._lease = lease
        self._state = state

    def hold(self) -> AbstractAsyncContextManager[None]:
        return self._lease.hold()

    @property
    def has_kernel(self) -> bool:
        return self._lease.has_kernel

    @property
    def busy(self) -> bool:
        return self._lease.busy

    async def hibernate(self) -> Hibernation:
        return await self._state.hibernate(self._lease)

    async def drop(self) -> None:
        await self._state.forfeit(self._lease)


class SessionState:
    """See the module docstring.

    Args:
        store: The executor's state directory.
        agent_id: The session's agent.
        env: ``""`` for the executor's default environment, else its fingerprint.
        workdir: The session's working directory (the host's path; kernels see the same).
        checkpoint: ``"on_evict"`` or ``"after_call"``.
        limit: Most bytes of one checkpoint.
        same_user: The kernel runs as the host's user (isolation ``"none"``): a restore links
            the records where the kernel reads them instead of copying them.
        secret_names: The executor's ``env_vars`` names: their values are never written to
            the store, and on a restore the fresh kernel's values win over any saved.
        claim: The agent's lease in a ``state_dir`` other executors may share
            (:mod:`._handoff`): held before a kernel of the session runs.
    """

    def __init__(
        self,
        store: StateStore,
        agent_id: str,
        env: str,
        workdir: Path,
        *,
        checkpoint: Literal["on_evict", "after_call"],
        limit: int,
        same_user: bool = False,
        secret_names: frozenset[str] = frozenset(),
        claim: AgentClaim | None = None,
    ) -> None:
        self.store = store
        self.claim = claim
        self._lease: Hibernating | None = None
        self.secret_names = secret_names
        self.agent_id = agent_id
        self.env = env
        self.workdir = workdir
        self.checkpoint = checkpoint
        self.limit = limit
        self.same_user = same_user
        self.replayer: Replayer | None = None
        self._manifest: Manifest | None = None
        self._problems: list[str] = []
        self._loaded = False
        self._to_restore = False
        self._installed = Installed()
        self._hook_broken = False  # an after-call checkpoint failed: off until the next kernel
        self._files: tuple[_files.Signature, dict[str, Any] | None] | None = None
        self._marking = False  # no checkpoint yet: a marker on disk lists the names
        self._marked: tuple[str, ...] | None = None  # the names the marker on disk lists
        self._taken_after: int | None = None  # the checkpoint known when the agent was retaken
        self._since: tuple[int, tuple[str, ...]] | None = None  # noted on disk after a checkpoint

    @property
    def staging(self) -> Path:
        """Where the kernel stages record files (inside the session's working directory)."""
        return self.workdir / ks.STAGING

    # -- the agent's lease --------------------------------------------------------------------

    async def hold_agent(self) -> None:
        """Hold the agent in the store before a kernel of the session runs: taken again after
        it went (perhaps to another executor), what the disk holds is read again.

        Raises:
            AgentBusyError: another executor holds it and did not hand it over.
        """
        if self.claim is None or not await self.claim.take():
            return
        self._taken_after = self._manifest.gen if self._manifest is not None else -1
        self._loaded, self._files = False, None

    def serve_handovers(self, lease: Hibernating) -> None:
        """Let another executor that asks for the agent have it: ``lease`` (the session's) is
        hibernated for it."""
        self._lease = lease
        if self.claim is not None:
            self.claim.lease = _Handing(lease, self)

    async def before_use(self, kernel: LeasedKernel) -> None:
        """The kernel is about to be used: if another host's executor took the agent away
        (this one had stopped renewing its lease), the kernel goes unsaved first, and the use
        asks for the agent back.

        Raises:
            StateError: the lease cannot be checked now (the kernel is kept).
        """
        if self.claim is None or self._lease is None or await self.claim.current():
            return
        log.warning(
            "agent %r was taken over by another executor while this one was not renewing its "
            "lease: its kernel here is dropped unsaved, and the agent asked for back",
            self.agent_id,
        )
        await self.forfeit(self._lease)

    def let_agent_go(self) -> None:
        """The session's kernel is gone: another executor may take the agent."""
        if self.claim is not None:
            self.claim.release()

    def _ours(self) -> bool:
        """Whether the agent's state may be written: no other executor broke its lease."""
        return self.claim is None or self.claim.still_held()

    def _refuse_unless_ours(self) -> None:
        if not self._ours():
            raise StateError(
                f"agent {self.agent_id!r} was taken over by another executor (this one had "
                "stopped renewing its lease): nothing saved"
            )

    async def forfeit(self, lease: Hibernating) -> None:
        """The agent was taken away (its lease broken): the kernel goes unsaved, and the next
        call asks for the agent back, reading the disk again."""
        if self.claim is not None and self.claim.held:
            return  # taken back meanwhile: the kernel now is the one of that take
        self._loaded, self._files = False, None
        await lease.give_back("saved")

    # -- a fresh kernel -----------------------------------------------------------------------

    async def attaching(self) -> None:
        """The session is about to take a kernel: hold the agent first (:meth:`hold_agent`).

        Raises:
            AgentBusyError: another executor holds it and did not hand it over.
        """
        await self.hold_agent()

    async def attached(self, kernel: LeasedKernel, how: Arrival) -> Restored | None:
        """A kernel is attached: restore the saved state into a fresh one when there is one;
        return what came back (its ``not_restored`` names are reported lost). The working
        directory (restored files included) is handed to the kernel's user first. A
        ``"branched"`` kernel (a fork, a restored snapshot) has its state: the saved one is
        stale and deleted, and the kernel forgets what it remembers of its origin's saves. The
        ``"same"`` kernel on a new connection changes nothing."""
        if how == "same":
            return None
        run, generation = kernel.ask, kernel.generation
        self._installed.forget()
        self._hook_broken = False
        if how == "branched":
            await asyncio.to_thread(self._invalidate)
        if not self._loaded:
            self._loaded = True
            self._manifest, self._problems = await asyncio.to_thread(
                self.store.load, self.agent_id, self.env
            )
            self._to_restore = self._manifest is not None or bool(self._problems)
        if self._taken_after is not None:
            newer = self._manifest is not None and self._manifest.gen != self._taken_after
            self._taken_after = None
            if newer:  # another executor ran the agent: this directory's files are stale
                await asyncio.to_thread(_files.empty, self.workdir)
        restored = None
        if self._to_restore:
            self._to_restore = False
            with telemetry().span("state.restore", {"kernelexec.agent_id": self.agent_id}):
                restored = await self._restore(
                    run, generation, lambda: kernel.conn.enter_workdir(kernel.workdir)
                )
        else:
            # A new or branched kernel: no memory of earlier saves may be reused (a fork
            # remembers its parent's), and the after-call hook is set for this session.
            try:
                await self._ask(run, generation, "forget", {})
            except StateError as exc:
                log.warning("agent %r: durable state not set up: %s", self.agent_id, untrusted(exc))
        if self._manifest is None or self._manifest.unfinished:
            self._marking, self._marked = True, None
            await self.names_seen(())
        return restored

    async def leaving(self, kernel: LeasedKernel, why: Leaving) -> bool:
        """The kernel is about to go: saved when evicted (True: the state is kept; a failed
        save is logged and the state lost), stale when it was lost; given back (evicted,
        hibernated), the agent is let go for other executors."""
        kept = False
        if why == "evict":
            try:
                await self.save(kernel.ask, kernel.generation)
                self.kernel_gone()
                kept = True
            except StateError as exc:
                log.warning(
                    "agent %r: hibernating failed, state lost: %s", self.agent_id, untrusted(exc)
                )
                await self.invalidate()
        elif why == "saved":
            self.kernel_gone()
        if why == "lost":
            await self.invalidate()  # the agent stays held: a fresh kernel follows
        else:
            self.let_agent_go()  # saved (or lost), and no call reaches that kernel any more
        return kept

    async def after_run(
        self, kernel: LeasedKernel | None, extras: Mapping[str, Any] | None
    ) -> None:
        """Commit the checkpoint the kernel side made after a call (``after_call``), or (before
        the session's first checkpoint) mark on disk the names a killed host loses."""
        if kernel is None or extras is None:
            return
        if self.checkpoint == "after_call":
            await self.after_call(extras.get(ks.HOOK_KEY), kernel.ask, kernel.generation)
        await self.names_seen(kernel.names)

    def gone(self) -> None:
        """The session is gone (nothing to let go of: the store is the executor's)."""

    async def hibernate(self, lease: Hibernating) -> Hibernation:
        """Save the state and give the kernel back (the caller holds ``lease``); what is on
        disk when the session has no kernel.

        Raises:
            StateError: the state could not be saved (the kernel is kept, the older
                checkpoint deleted).
        """
        kernel = lease.kernel
        if kernel is None:
            return await self.on_disk()
        try:
            saved = await self.save(kernel.ask, kernel.generation)
        except StateError:
            await self.invalidate()  # the kernel keeps the state; the disk never lags it
            raise
        await lease.give_back("saved")
        return saved

    async def names_seen(self, names: tuple[str, ...]) -> None:
        """The session's kernel holds ``names`` now. Until its first checkpoint, a marker on
        disk lists them: a host killed before it saves has its next host report them lost
        (rewritten only when the names differ)."""
        if not self._marking or not (self._manifest is None or self._manifest.unfinished):
            await self._note_since(names)
            return
        if self._marked is not None and self._marked == names:
            return
        marker = Manifest(
            agent_id=self.agent_id,
            env=self.env,
            gen=0,
            saved_at=now_iso(),
            unsaved=dict.fromkeys(names, f"lost: {_ENDED}"),
            unfinished=True,
        )
        if not self._ours():
            return
        try:
            await asyncio.to_thread(self.store.mark, marker)
        except OSError as exc:
            log.warning("agent %r: could not mark the session begun: %s", self.agent_id, exc)
            return
        self._manifest, self._marked = marker, names

    async def _note_since(self, names: tuple[str, ...]) -> None:
        """With ``"on_evict"``, calls ran after the last checkpoint: note it on disk (once per
        checkpoint, again when the names change), so that a host killed before its next save
        has the agent's next owner told what those calls did is lost."""
        found = self._manifest
        if self.checkpoint != "on_evict" or found is None or found.unfinished:
            return
        if self._since == (found.gen, names) or not self._ours():
            return
        try:
            await asyncio.to_thread(
                self.store.mark_since, self.agent_id, self.env, found.gen, list(names)
            )
        except OSError as exc:
            log.warning(
                "agent %r: could not note the calls since its checkpoint: %s", self.agent_id, exc
            )
            return
        self._since = (found.gen, names)

    async def _restore(
        self, run: Runner, generation: int, hand_over: Callable[[], Awaitable[None]]
    ) -> Restored:
        start = time.monotonic()
        manifest, problems = self._manifest, list(self._problems)
        self._problems = []
        if manifest is None:
            for p in problems:
                log.warning("agent %r: checkpoint not used: %s", self.agent_id, untrusted(p))
            return Restored(seconds=time.monotonic() - start, problems=problems)
        if manifest.unfinished:
            problems.append(f"{_ENDED}: its state is lost")
            not_restored = dict(manifest.unsaved)
        else:
            not_restored = {n: f"not saved: {why}" for n, why in manifest.unsaved.items()}
            since = await asyncio.to_thread(self.store.since, self.agent_id, self.env, manifest.gen)
            if since is not None:
                problems.append(
                    f"its host ended after calls this checkpoint (saved {manifest.saved_at}) "
                    f"does not hold (the last at {since[1]}): what they changed is lost"
                )
                for name in set(since[0]) - set(manifest.names) - set(not_restored):
                    not_restored[name] = "lost: made after the last checkpoint, not saved"
        try:
            problem = await asyncio.to_thread(self._stage_for_restore, manifest)
            if problem:
                problems.append(problem)
            await hand_over()  # the restored files are the kernel's before any code runs
            answer = await self._ask(
                run,
                generation,
                "restore",
                {
                    "staging": str(self.staging),
                    "cwd": str(self.workdir),
                    "records": manifest.records,
                    "gen": manifest.gen,
                    "environ": manifest.environ,
                    "keep": sorted(self.secret_names),
                },
            )
            names = sorted(answer.get("restored", []))
            not_restored.update({str(k): str(v) for k, v in answer.get("lost", {}).items()})
        except StateError as exc:
            names = []
            for name in manifest.names:
                not_restored[name] = f"not restored: {exc}"
        finally:
            await asyncio.to_thread(_clear_staging, self.staging)
        replayed: list[str] = []
        if not_restored and self.replayer is not None:
            replayed = await self.replayer(sorted(not_restored), run)
            for name in replayed:
                not_restored.pop(name, None)
        for p in problems:
            log.warning("agent %r: %s", self.agent_id, untrusted(p))
        return Restored(
            names=names,
            bytes=manifest.size,
            seconds=time.monotonic() - start,
            saved_at=manifest.saved_at,
            not_restored=not_restored,
            replayed=replayed,
            problems=problems,
        )

    def _stage_for_restore(self, manifest: Manifest) -> str | None:
        """Copy the records where the kernel reads them (a kernel at ``process`` runs as its
        own user and cannot read the private directory); unpack the files if the working
        directory is new. Record checksums are checked by the kernel before it loads."""
        where = self.store.agent_dir(self.agent_id, self.env)
        problem = None
        if manifest.files:
            problem = _files.extract(
                where / str(manifest.files["file"]),
                self.workdir,
                int(manifest.files["size"]),
                int(manifest.files["crc"]),
            )
        _clear_staging(self.staging)
        os.mkdir(self.staging, 0o755)
        dir_fd = os.open(self.staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for rec in manifest.records:
                if not rec.get("file"):
                    continue
                source, name = where / str(rec["file"]), str(rec["file"])
                if self.same_user:
                    try:
                        os.link(source, name, dst_dir_fd=dir_fd)
                        continue
                    except OSError:  # another filesystem: copy
                        pass
                _copy_out(source, name, dir_fd)
        finally:
            os.close(dir_fd)
        return problem

    # -- saving -------------------------------------------------------------------------------

    async def save(self, run: Runner, generation: int) -> Hibernation:
        """Save the kernel's state now (the kernel stays).

        Raises:
            CheckpointTooLargeError: the checkpoint would pass the limit (nothing is saved).
            StateError: the kernel could not save, or the store could not keep it.
        """
        with telemetry().span("state.save", {"kernelexec.agent_id": self.agent_id}):
            return await self._save(run, generation)

    async def _save(self, run: Runner, generation: int) -> Hibernation:
        start = time.monotonic()
        await self._load_quietly()
        found = self._manifest
        base = found.gen if found is not None and not found.unfinished else None
        args = {
            "staging": str(self.staging),
            "base": base,
            "gen": (base or 0) + 1,
            "limit": self.limit,
            "full": True,
        }
        try:
            answer = await self._ask(run, generation, "save", args)
            if "too_large" in answer:
                raise _too_large(answer)
            manifest, written = await asyncio.to_thread(self._commit, answer)
        finally:
            await asyncio.to_thread(_clear_staging, self.staging)
        return Hibernation(
            saved=manifest.names,
            not_saved=manifest.unsaved,
            bytes=manifest.size,
            seconds=time.monotonic() - start,
            written_bytes=written,
        )

    async def after_call(self, answer: Any, run: Runner, generation: int) -> None:
        """Commit what the kernel side checkpointed after a call (None: the namespace did not
        change; the working directory may have)."""
        if not isinstance(answer, dict):
            if self._files is None or self._manifest is None or self._manifest.unfinished:
                return
            try:
                same = await asyncio.to_thread(_files.signature, self.workdir) == self._files[0]
            except OSError as exc:  # a tree past the walk's bounds, an unreadable directory
                log.warning(
                    "agent %r: after-call checkpoint failed (checkpoints stop until the "
                    "session's next kernel): %s",
                    self.agent_id,
                    untrusted(exc),
                )
                await asyncio.to_thread(self._invalidate)
                self._hook_broken = True
                return
            if same:
                return
            answer = {
                "records": self._manifest.records,
                "unsaved": self._manifest.unsaved,
                "environ": self._manifest.environ,
                "gen": self._manifest.gen + 1,
            }
        try:
            if "error" in answer:
                raise StateError(f"the kernel could not save: {answer['error']}")
            if "too_large" in answer:
                raise _too_large(answer)
            await asyncio.to_thread(self._commit, answer)
        except (StateError, OSError) as exc:
            log.warning(
                "agent %r: after-call checkpoint failed (checkpoints stop until the session's "
                "next kernel; its saved state is deleted): %s",
                self.agent_id,
                untrusted(exc),
            )
            await asyncio.to_thread(self._invalidate)
            self._hook_broken = True
            with contextlib.suppress(StateError):
                await self._ask(run, generation, "forget", {})
        finally:
            await asyncio.to_thread(_clear_staging, self.staging)

    def _commit(self, answer: dict[str, Any]) -> tuple[Manifest, int]:
        try:
            sig = _files.signature(self.workdir)
        except OSError as exc:  # past the walk's entry bound, or unreadable
            raise StateError(f"the working directory could not be saved: {exc}") from exc
        self._refuse_unless_ours()
        files = self._files[1] if self._files is not None and self._files[0] == sig else None
        unsaved = {str(k): str(v) for k, v in answer.get("unsaved", {}).items()}
        if files is None and sig:
            dest = self.store.new_files_path(self.agent_id, self.env)
            try:
                crc, size, skipped = _files.archive(self.workdir, dest, self.limit)
            except BaseException as exc:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(dest)
                if isinstance(exc, OSError) and not isinstance(exc, CheckpointTooLargeError):
                    raise StateError(f"the working directory could not be saved: {exc}") from exc
                raise
            files = {"file": dest.name, "size": size, "crc": crc, "skipped": skipped}
        manifest = Manifest(
            agent_id=self.agent_id,
            env=self.env,
            gen=int(answer.get("gen") or (self._manifest.gen + 1 if self._manifest else 1)),
            saved_at=now_iso(),
            records=_checked_records(answer.get("records", [])),
            unsaved=unsaved,
            environ=self._environ(answer.get("environ")),
            files=files,
        )
        if manifest.size > self.limit:
            raise CheckpointTooLargeError(
                f"the checkpoint of agent {self.agent_id!r} ({manifest.size} bytes, the "
                f"working directory's files included) passes max_checkpoint_bytes={self.limit}"
            )
        self._refuse_unless_ours()  # again: the archive may have taken a while
        try:
            written = self.store.commit(manifest, self.staging)
        except OSError as exc:
            raise StateError(f"saving the checkpoint failed: {exc}") from exc
        self._manifest, self._files = manifest, (sig, files)
        self._marking = False  # a checkpoint now says what a host that ends loses
        return manifest, written + (int(files["size"]) if files else 0)

    def _environ(self, environ: Any) -> dict[str, str]:
        """The kernel's environment as it may be stored: without the executor's ``env_vars``
        (their values are secrets the next executor gives again, perhaps rotated)."""
        if not isinstance(environ, dict):
            return {}
        return {str(k): str(v) for k, v in environ.items() if k not in self.secret_names}

    async def _load_quietly(self) -> None:
        if not self._loaded:
            self._loaded = True
            self._manifest, _ = await asyncio.to_thread(self.store.load, self.agent_id, self.env)

    async def on_disk(self) -> Hibernation:
        """What is saved now (the session has no kernel)."""
        await self._load_quietly()
        found = self._manifest
        if found is None:
            return Hibernation()
        return Hibernation(saved=found.names, not_saved=found.unsaved, bytes=found.size)

    # -- losing -------------------------------------------------------------------------------

    def kernel_gone(self) -> None:
        """The kernel went after a successful save: the next fresh kernel gets the state, read
        from disk again then (what is restored is what the disk holds, checked)."""
        self._loaded = False

    async def invalidate(self) -> None:
        """The kernel's state was lost another way (a crash, a failed save): the checkpoint
        is stale and must never come back."""
        await asyncio.to_thread(self._invalidate)

    async def tombstone(self, names: list[str], why: str) -> None:
        """Replace the checkpoint by one that reports ``names`` lost (with ``why``) on resume."""
        manifest = Manifest(
            agent_id=self.agent_id,
            env=self.env,
            gen=(self._manifest.gen + 1) if self._manifest else 1,
            saved_at=now_iso(),
            unsaved=dict.fromkeys(names, why),
        )

        def write() -> None:
            self._refuse_unless_ours()
            self.store.invalidate(self.agent_id, self.env)
            self.store.commit(manifest, None)

        await asyncio.to_thread(write)
        self._manifest, self._files, self._marking = manifest, None, False

    def deleted(self) -> None:
        """The agent's state was deleted: nothing to restore (nor marked)."""
        self._marking = False
        self._manifest, self._files, self._to_restore, self._loaded = None, None, False, True

    def _invalidate(self) -> None:
        if self._ours():  # else the checkpoint is the new holder's
            self.store.invalidate(self.agent_id, self.env)
        self._manifest, self._files, self._to_restore, self._loaded = None, None, False, True
        self._installed.forget()  # the kernel's memory of the last save is stale too

    # -- talking to the kernel ----------------------------------------------------------------

    async def _ask(self, run: Runner, generation: int, op: str, args: dict[str, Any]) -> Any:
        meta: dict[str, Any] = {"op": op, "args": args}
        fresh = not self._installed.on(generation)
        if fresh:
            meta["hook"] = {
                "staging": str(self.staging),
                "limit": self.limit,
                "on": self.checkpoint == "after_call" and not self._hook_broken,
            }
        request = install_request(
            [KERNEL_MODULE] if fresh else [],
            metadata={_META: meta},
            user_expressions={_KEY: f"__import__({ks.MODULE_NAME!r}).handle()"},
        )
        try:
            reply = await run(request, _TIMEOUT)
        except Exception as exc:
            raise StateError(f"the kernel did not answer: {exc}") from exc
        entry = (reply.get("user_expressions") or {}).get(_KEY) or {}
        if entry.get("status") != "ok":
            why = entry.get("evalue") or reply.get("evalue") or "no answer"
            raise StateError(f"the kernel side failed: {entry.get('ename', '')}: {why}")
        self._installed.mark(generation)
        text = (entry.get("data") or {}).get(ks.RESULT_MIME)
        if not isinstance(text, str):
            raise StateError("the kernel side gave no answer")
        answer = json.loads(text)
        if isinstance(answer, dict) and "error" in answer:
            raise StateError(f"the kernel could not {op}: {answer['error']}")
        return answer


def _too_large(answer: dict[str, Any]) -> CheckpointTooLargeError:
    biggest = ", ".join(f"{name} ({size} bytes)" for name, size in answer.get("biggest", []))
    return CheckpointTooLargeError(
        f"the checkpoint ({answer['too_large']} bytes) passes max_checkpoint_bytes="
        f"{answer['limit']}; the biggest names: {biggest}"
    )


def _checked_records(records: Any) -> list[dict[str, Any]]:
    """The records the kernel announced, each size a whole number of bytes (the kernel's
    answer is checked, never trusted: a negative size would hide bytes from the limit).

    Raises:
        StateError: a record is not of that shape.
    """
    if not isinstance(records, list):
        raise StateError("the kernel's checkpoint answer has no list of records")
    for rec in records:
        size = rec.get("size", 0) if isinstance(rec, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise StateError(f"the kernel announced a record of {size!r} bytes")
    return list(records)


def _copy_out(source: Path, name: str, dir_fd: int) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with open(source, "rb") as src:
            os.fchmod(fd, 0o644)
            size = os.fstat(src.fileno()).st_size
            offset = 0
            while offset < size:
                sent = os.sendfile(fd, src.fileno(), offset, size - offset)
                if sent == 0:
                    break
                offset += sent
    finally:
        os.close(fd)


def _clear_staging(staging: Path) -> None:
    """Remove the staging directory, whatever the kernel left there (links are not followed)."""
    try:
        st = os.lstat(staging)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            _trees.remove(staging)
    else:
        os.unlink(staging)
