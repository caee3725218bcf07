"""The namespace helper: one small root process per host that puts host mounts into a running
kernel's mount namespace, at ``"process"`` (and ``"bwrap"``) on a root host.

A kernel's mount namespace exists from its launch (kernels are started ahead of need), and a
mount made on the host later does not reach it; the old ``mount(2)`` bind refuses to cross
namespaces. The helper builds the mount on the host side as a detached tree (``open_tree``,
``mount_setattr``, ``fsopen``), enters the kernel's namespace (``setns``), attaches the tree
there (``move_mount``) and comes back. ``setns`` into a mount namespace needs a
single-threaded caller, hence a process of its own rather than a thread of the host.

Two requests, one per line as JSON, answered ``ok`` or ``error <why>``:

- ``show``: the host's mount at ``path`` (a capped working directory, :mod:`._disk`), at the
  same path in the kernel's namespace;
- ``lend``: the host directory ``path`` (:mod:`._lend`; refused when it is no longer the one
  the host checked, ``dev`` and ``ino``), read-only and as it is (a read-only overlay over it
  and an empty layer, so that no host socket or FIFO in it is reached), or, with ``workdir`` and
  ``name``, as an overlay whose lower layer is ``path`` read-only (idmapped with ``idmap``, so
  that what the host's user owns appears as the kernel's user's), and whose changes go to
  ``workdir/.kx-lent/name/upper`` (copy on write: the host's directory never changes). Those
  layers are opened without following a link, in folders that must be the host's alone, and
  handed to overlayfs as descriptors: the session's directory is the kernel's, and a link or a
  folder planted there must not steer root's writes.

For ``lend`` the mount point is found in the kernel's view without following a link, one
directory descriptor at a time, and missing directories are made only on a tmpfs (the kernel's
private ``/tmp``, a read-only bridge over a blocked directory, which is made writable for the
moment it takes): never on a host filesystem. A directory on the way that the kernel's user
cannot pass through (the host's ``/root``, a 0700 parent) gets such a bridge then, as
:mod:`._mounts` gives one at launch: the kernel reached nothing under it, and still reaches
only the way to what is lent. The helper ends when the host does (its stdin
closes), or when the last executor of the host process closes (:func:`hold`, :func:`let_go`).
Root only. The helper's code is the module :mod:`._helper_ns`, run as a script; this module
starts it and asks it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import select
import subprocess
import threading
from typing import Any

from kernelexec import _proctitle

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_helper_ns.py")
"""The helper's own process (:mod:`._helper_ns`), run as a script titled ``kernelexec ns
helper``."""

_helper: subprocess.Popen[str] | None = None
_lock = threading.Lock()
_holders = 0  # the backends of open executors: the helper is theirs while there are any


class HelperError(OSError):
    """The helper could not do what was asked (the message has its reason)."""


_DEADLINE = 30.0  # seconds a request may take before the helper is replaced


def request(op: str, **fields: Any) -> None:
    """Ask the helper (started on first use, again if it died) to do ``op`` with ``fields``.
    One request at a time; one that takes longer than 30 s ends the helper (the next starts
    another), so no kernel's request holds the others up for longer. Asked while no executor
    holds it (:func:`hold`), the helper ends after answering.

    Raises:
        HelperError: it answered with an error, died twice, or took too long.
    """
    global _helper
    line = json.dumps({"op": op, **fields}) + "\n"
    with _lock:
        for _attempt in (1, 2):
            helper = _helper
            if helper is None or helper.poll() is not None:
                helper = _helper = subprocess.Popen(
                    _proctitle.helper_command(_proctitle.NS_HELPER, _SCRIPT),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    cwd="/",
                )
            assert helper.stdin is not None and helper.stdout is not None
            try:
                helper.stdin.write(line)
                helper.stdin.flush()
                # poll, not select: a host with many kernels has descriptors above 1023.
                waiting = select.poll()
                waiting.register(helper.stdout, select.POLLIN)
                if not waiting.poll(_DEADLINE * 1000):
                    _stop(helper, kill=True)
                    _helper = None
                    raise HelperError(errno.ETIMEDOUT, f"{op} took more than {_DEADLINE:g} s")
                answer = helper.stdout.readline().strip()
            except OSError as exc:
                if isinstance(exc, HelperError):
                    raise
                answer = ""
            if answer and not _holders:  # asked outside any executor (a probe): not kept
                _stop(helper)
                _helper = None
            if answer == "ok":
                return
            if answer:
                raise HelperError(errno.EIO, answer.removeprefix("error "))
            _stop(helper)  # it died: once more with a new one
            _helper = None
    raise HelperError(errno.EIO, "the namespace helper died")


def hold() -> None:
    """An executor that may ask for the helper opens (a backend's ``hold``)."""
    global _holders
    with _lock:
        _holders += 1


def let_go() -> None:
    """An executor that called :func:`hold` has closed: the last one ends the helper, so a
    process that closed its executors has nothing of kernelexec's left running (a later
    executor's request starts a new helper)."""
    global _helper, _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if _holders == 0 and _helper is not None:
            _stop(_helper)
            _helper = None


def _stop(helper: subprocess.Popen[str], *, kill: bool = False) -> None:
    """End the helper: its stdin closed, it returns (killed if it does not, or at once)."""
    if kill:
        helper.kill()
    for pipe in (helper.stdin, helper.stdout):
        with contextlib.suppress(OSError):
            if pipe is not None:
                pipe.close()
    try:
        helper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()


@atexit.register
def _stop_helper() -> None:
    global _helper
    with _lock:
        if _helper is not None:
            _stop(_helper)
            _helper = None
