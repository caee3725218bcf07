"""Hostile: a tenant that tries to take or forge another agent's lease through the shared
``state_dir`` (told every path and token it would need). At the default isolation its kernel
runs as a user of its own: the store is the host user's, 0700, and the lease locks are opened
close-on-exec, so the kernel can neither reach the store nor hold one of its descriptors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec._durable._leases import LeaseBook
from kernelexec._durable._store import agent_key
from tests.hostile.conftest import needs_root

pytestmark = [pytest.mark.slow, needs_root]

_ATTACK = """
import fcntl, json, os
state, key, token = STATE, KEY, TOKEN
tried = {}
def attempt(name, fn):
    try:
        fn()
        tried[name] = "done"
    except OSError as exc:
        tried[name] = type(exc).__name__
def forge_record():
    with open(os.path.join(state, "leases", key + ".json"), "w") as f:
        json.dump({"agent_id": "victim", "env": "", "token": "0" * 24, "host": "evil",
                   "pid": os.getpid(), "since": 0}, f)
def take_lock():
    fd = os.open(os.path.join(state, "leases", key + ".lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
def ask_holder():
    path = os.path.join(state, "holders", token, key + ".aaaaaaaaaaaa.req")
    with open(path, "w") as f:
        json.dump({"asker": "evil", "deadline": 9e9}, f)
def list_store():
    os.listdir(state)
def host_fds():
    os.listdir("/proc/%d/fd" % HOST)
attempt("forge_record", forge_record)
attempt("take_lock", take_lock)
attempt("ask_holder", ask_holder)
attempt("list_store", list_store)
attempt("host_fds", host_fds)
inherited = []
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink("/proc/self/fd/" + fd)
    except OSError:
        continue
    if target.startswith(state):
        inherited.append(target)
tried["inherited"] = inherited
print(json.dumps(tried))
"""


@pytest.fixture(params=["tmp", "srv"])
def open_parent(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory every user may pass through (pytest's own are 0700), so that what keeps the
    tenant out is the store itself: under the temp dir (which the kernel's mount namespace
    replaces) and under ``/srv`` (which the kernel sees: the store's mode must refuse it)."""
    where = tempfile.gettempdir() if request.param == "tmp" else "/srv"
    if not os.access(where, os.W_OK):
        pytest.skip(f"{where} is not writable here")
    base = Path(tempfile.mkdtemp(prefix="kx-lease-", dir=where))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base)


def _who(holder: object) -> object:
    return dataclasses.replace(holder, renewed_at=None)  # type: ignore[type-var]


def test_a_tenant_cannot_take_or_forge_another_agents_lease(open_parent: Path) -> None:
    state = open_parent / "state"
    with kx.KernelExecutor(state_dir=state, default_timeout=60) as ex:
        ex.run_code("secret = 'of the victim'", agent_id="victim").raise_for_error()
        key = agent_key("victim", "")
        book = LeaseBook(state)
        holder = book.holder(key)
        assert holder is not None and holder.pid == os.getpid()  # the executor holds it
        code = (
            _ATTACK.replace("STATE", repr(str(state)))
            .replace("KEY", repr(key))
            .replace("TOKEN", repr(holder.token))
            .replace("HOST", str(os.getpid()))
        )
        attack = ex.run_code(code, agent_id="mallory")
        assert attack.error is None, attack.error
        tried = json.loads(attack.stdout)
        # Not reachable at all (the kernel's mount namespace replaces the host's /tmp, its /proc
        # hides the host's processes: FileNotFoundError), or refused (PermissionError).
        refused = {"PermissionError", "FileNotFoundError"}
        if "srv" in str(state):
            refused = {"PermissionError"}  # seen, and refused by the store's mode
        assert tried.pop("inherited") == []
        assert set(tried) == {"forge_record", "take_lock", "ask_holder", "list_store", "host_fds"}
        assert tried.pop("host_fds") in ("PermissionError", "FileNotFoundError")
        assert set(tried.values()) <= refused, tried
        # Nothing changed: the same holder, no request in its inbox, the victim's state there.
        assert _who(book.holder(key)) == _who(holder)
        assert [p.name for p in (state / "holders" / holder.token).iterdir()] == ["alive.json"]
        assert book.locked(key)
        got = ex.run_code("print(secret)", agent_id="victim")
        assert got.stdout == "of the victim\n" and got.restored is None
