"""Durable state for kernels whose files the host cannot see (a Kernel or Enterprise Gateway's):
the checkpoint's records and the working directory's archive travel through the kernel protocol.

:class:`KernelChannel` moves a staged file between the kernel's staging directory and the host,
in chunks carried by kernelexec's own execute requests (the kernel's half is
``_kernel_transfer.py``); every size and CRC-32 is checked on the host, the whole bounded by
``max_checkpoint_bytes``. :class:`RemoteSessionState` is :class:`SessionState` with its file
steps done through that channel: a save fetches the kernel's new records into a private staging
directory of the store and commits them from there, exactly as a local save commits from the
session's; a restore puts the records and the archive into the kernel's staging directory
first. Only ``checkpoint="on_evict"`` (the after-call hook would stage files the host cannot
fetch between calls).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any

from kernelexec._durable import _kernel_transfer as kt
from kernelexec._durable._keeper import Runner, SessionState, _checked_records
from kernelexec._durable._store import Manifest, now_iso
from kernelexec._exceptions import CheckpointTooLargeError, StateError
from kernelexec._observability._logtext import untrusted
from kernelexec._protocol._install import Installed, KernelModule, install_request

CHUNK = 2 << 20
"""Bytes per request: base64 makes 2.7 MiB of it, under a gateway's 10 MiB message limit."""
log = logging.getLogger("kernelexec")

_KEY = "kx_transfer"
_META = "kernelexec_transfer"
_TIMEOUT = 120.0
_RECORD = re.compile(r"^r[0-9a-f]{24}\.rec$")
KERNEL_MODULE = KernelModule(kt.MODULE_NAME, kt.__name__, entry=None, keep=True)
"""The transfer's kernel half: a kernel that has it keeps it."""


class KernelChannel:
    """Files in and out of the kernel's staging directory through its runner."""

    def __init__(self) -> None:
        self._installed = Installed()

    async def ask(self, run: Runner, generation: int, op: str, **args: Any) -> dict[str, Any]:
        """One operation of the kernel half; its answer.

        Raises:
            StateError: the kernel did not answer, or answered with an error.
        """
        meta: dict[str, Any] = {"op": op, "args": args}
        request = install_request(
            [] if self._installed.on(generation) else [KERNEL_MODULE],
            metadata={_META: meta},
            user_expressions={_KEY: f"__import__({kt.MODULE_NAME!r}).handle()"},
        )
        try:
            reply = await run(request, _TIMEOUT)
        except StateError:
            raise
        except Exception as exc:
            raise StateError(f"the kernel did not answer: {exc}") from exc
        entry = (reply.get("user_expressions") or {}).get(_KEY) or {}
        text = (entry.get("data") or {}).get(kt.RESULT_MIME)
        if entry.get("status") != "ok" or not isinstance(text, str):
            why = entry.get("evalue") or reply.get("evalue") or "no answer"
            raise StateError(f"moving the checkpoint failed in the kernel: {why}")
        self._installed.mark(generation)
        answer = json.loads(text)
        if not isinstance(answer, dict):
            raise StateError("the kernel's transfer answer is not an object")
        if "error" in answer:
            raise StateError(f"moving the checkpoint failed in the kernel: {answer['error']}")
        return answer

    async def fetch(
        self, run: Runner, generation: int, staging: str, name: str, size: int, crc: int | None,
        dest: Path,
    ) -> None:  # fmt: skip
        """Copy the kernel's staged file ``name`` to the new host file ``dest``: exactly
        ``size`` bytes, with CRC-32 ``crc`` (when given); ``dest`` is removed on any failure.

        Raises:
            StateError: the kernel sent other bytes than announced.
        """
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            got, offset = 0, 0
            while True:
                left = size - offset
                # The last read asks for one byte more: a file longer than announced shows
                # without a request of its own.
                last = left < CHUNK
                want = left + 1 if last else CHUNK
                answer = await self.ask(
                    run, generation, "read", staging=staging, name=name, offset=offset, size=want
                )
                data = base64.b64decode(str(answer.get("data", "")))
                if len(data) > left or (not last and len(data) != CHUNK):
                    raise StateError(f"staged file {name} is not the {size} bytes announced")
                os.pwrite(fd, data, offset)
                got = zlib.crc32(data, got)
                offset += len(data)
                if last:
                    if offset != size:
                        raise StateError(f"staged file {name} is not the {size} bytes announced")
                    break
            if crc is not None and got != crc:
                raise StateError(f"staged file {name} is not the file announced (its CRC)")
            await asyncio.to_thread(os.fsync, fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
            raise
        os.close(fd)

    async def put(
        self, run: Runner, generation: int, source: Path, staging: str, name: str
    ) -> None:
        """Copy the host file ``source`` into the kernel's staging directory as ``name``."""
        fd = await asyncio.to_thread(os.open, source, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            offset = 0
            while True:
                data = await asyncio.to_thread(os.pread, fd, CHUNK, offset)
                if not data and offset:
                    break
                await self.ask(
                    run, generation, "write", staging=staging, name=name, offset=offset,
                    data=base64.b64encode(data).decode(),
                )  # fmt: skip
                offset += len(data)
                if not data:
                    break
        finally:
            os.close(fd)


class RemoteSessionState(SessionState):
    """:class:`SessionState` for a kernel whose files the host cannot see (see the module
    docstring); the same arguments, ``workdir`` being the path as the kernel's backend gives it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channel = KernelChannel()
        self._host_staging = self.store.root / "staging" / os.urandom(12).hex()
        self._fetched_files: dict[str, Any] | None = None

    @property
    def staging(self) -> Path:
        """The host's private directory the kernel's records are fetched into."""
        return self._host_staging

    async def attached(self, *args: Any, **kwargs: Any) -> Any:
        # The working directory is the kernel's, on the gateway's host: a restore replaces it
        # with the archive's content (below), never through a host path.
        self._taken_after = None
        return await super().attached(*args, **kwargs)

    async def _where(self, run: Runner, generation: int) -> dict[str, Any]:
        return await self.channel.ask(run, generation, "where", rel=str(self.workdir))

    async def _ask(self, run: Runner, generation: int, op: str, args: dict[str, Any]) -> Any:
        if op == "save":
            return await self._save_remote(run, generation, args)
        if op == "restore":
            return await self._restore_remote(run, generation, args)
        return await super()._ask(run, generation, op, args)

    async def _save_remote(self, run: Runner, generation: int, args: dict[str, Any]) -> Any:
        where = await self._where(run, generation)
        kstaging = str(where["staging"])
        self._fetched_files = None
        try:
            answer = await super()._ask(run, generation, "save", {**args, "staging": kstaging})
            if isinstance(answer, dict) and "too_large" not in answer:
                await self._fetch_all(run, generation, answer, where)
            return answer
        finally:
            await self.channel.ask(run, generation, "clear", staging=kstaging)

    async def _fetch_all(
        self, run: Runner, generation: int, answer: dict[str, Any], where: dict[str, Any]
    ) -> None:
        records = _checked_records(answer.get("records", []))
        total = sum(int(r.get("size", 0)) for r in records)
        if total > self.limit:
            raise CheckpointTooLargeError(
                f"the checkpoint of agent {self.agent_id!r} ({total} bytes) passes "
                f"max_checkpoint_bytes={self.limit}"
            )
        kstaging = str(where["staging"])
        have = self.store.agent_dir(self.agent_id, self.env)
        self._host_staging.parent.mkdir(exist_ok=True, mode=0o700)
        self._host_staging.mkdir(exist_ok=True, mode=0o700)
        for rec in records:
            name = rec.get("file")
            if not name or (have / str(name)).exists():
                continue
            if not _RECORD.match(str(name)):
                raise StateError(f"the kernel announced a bad record name {name!r}")
            crc = rec.get("crc")
            await self.channel.fetch(
                run, generation, kstaging, str(name), int(rec["size"]),
                crc if isinstance(crc, int) else None, self._host_staging / str(name),
            )  # fmt: skip
        dest = self.store.new_files_path(self.agent_id, self.env)
        packed = await self.channel.ask(
            run, generation, "pack", workdir=str(where["workdir"]), staging=kstaging,
            name=dest.name, limit=self.limit - total,
        )  # fmt: skip
        if "too_large" in packed:
            raise CheckpointTooLargeError(
                f"the checkpoint of agent {self.agent_id!r} (more than {self.limit} bytes, the "
                f"working directory's files included: {packed.get('path')!r} passes it) "
                f"passes max_checkpoint_bytes={self.limit}"
            )
        if packed.get("empty"):
            return
        size, crc = packed.get("size"), packed.get("crc")
        if not isinstance(size, int) or not isinstance(crc, int) or size > self.limit - total:
            raise StateError(f"the kernel announced an archive of {size!r} bytes")
        await self.channel.fetch(run, generation, kstaging, dest.name, size, crc, dest)
        skipped = packed.get("skipped")
        self._fetched_files = {
            "file": dest.name,
            "size": size,
            "crc": crc,
            "skipped": {str(k): str(v) for k, v in skipped.items()}
            if isinstance(skipped, dict)
            else {},
        }

    def _commit(self, answer: dict[str, Any]) -> tuple[Manifest, int]:
        files, self._fetched_files = self._fetched_files, None
        try:
            manifest = Manifest(
                agent_id=self.agent_id,
                env=self.env,
                gen=int(answer.get("gen") or (self._manifest.gen + 1 if self._manifest else 1)),
                saved_at=now_iso(),
                records=_checked_records(answer.get("records", [])),
                unsaved={str(k): str(v) for k, v in answer.get("unsaved", {}).items()},
                environ=self._environ(answer.get("environ")),
                files=files,
            )
            if manifest.size > self.limit:
                raise CheckpointTooLargeError(
                    f"the checkpoint of agent {self.agent_id!r} ({manifest.size} bytes, the "
                    f"working directory's files included) passes "
                    f"max_checkpoint_bytes={self.limit}"
                )
            written = self.store.commit(manifest, self.staging)
        except BaseException as exc:
            if files is not None:
                where = self.store.agent_dir(self.agent_id, self.env)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where / str(files["file"]))
            if isinstance(exc, OSError):
                raise StateError(f"saving the checkpoint failed: {exc}") from exc
            raise
        self._manifest, self._files = manifest, None
        self._marking = False
        return manifest, written + (int(files["size"]) if files else 0)

    def _stage_for_restore(self, manifest: Manifest) -> str | None:
        return None  # the records go to the kernel in _restore_remote

    async def _restore_remote(self, run: Runner, generation: int, args: dict[str, Any]) -> Any:
        where = await self._where(run, generation)
        kstaging, kworkdir = str(where["staging"]), str(where["workdir"])
        manifest = self._manifest
        assert manifest is not None
        source = self.store.agent_dir(self.agent_id, self.env)
        try:
            await self.channel.ask(run, generation, "clear", staging=kstaging)
            for rec in manifest.records:
                if rec.get("file"):
                    name = str(rec["file"])
                    await self.channel.put(run, generation, source / name, kstaging, name)
            if manifest.files:
                name = str(manifest.files["file"])
                await self.channel.put(run, generation, source / name, kstaging, name)
                unpacked = await self.channel.ask(
                    run, generation, "unpack", workdir=kworkdir, staging=kstaging, name=name,
                    size=int(manifest.files["size"]), crc=int(manifest.files["crc"]),
                )  # fmt: skip
                if unpacked.get("problem"):  # the variables may still come back, as locally
                    log.warning("agent %r: %s", self.agent_id, untrusted(unpacked["problem"]))
            args = {**args, "staging": kstaging, "cwd": kworkdir}
            return await super()._ask(run, generation, "restore", args)
        finally:
            with contextlib.suppress(StateError):
                await self.channel.ask(run, generation, "clear", staging=kstaging)
                # The kernel's first run enters the session's directory by its relative path.
                await self.channel.ask(run, generation, "chdir", path=str(where["here"]))
