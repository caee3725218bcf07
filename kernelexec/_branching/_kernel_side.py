"""The kernel half of branching: forking a live kernel into a frozen template, and turning a
fork of that template into a kernel of its own.

Standard-library Python, installed in the kernel as text (a kernel module), run there as
:data:`MODULE_NAME` (ipykernel, pyzmq and tornado are looked up at run time, never imported by
name: another kernel may lack them). Three processes take part:

* the **live kernel** (K) answers :data:`REQUEST` on its main thread, between two shell
  messages, so no cell is half run. It binds a listening socket at the path the host named,
  forks once and answers at once: K is paused for that one ``fork()``.
* the **template** (T), the fork, holds the state frozen (it runs nothing: it blocks reading
  its socket, so its memory stays shared with K page by page until K writes). It closes the
  descriptors it inherited from K's machinery (zmq's sockets and event fds, the event loops'
  pollers, the output pipes: never through zmq, whose threads do not exist here), wipes K's
  connection key, accepts the host's one connection and forks a kernel on each request.
* each **branch** (C), a fork of T, gets a new event loop, zmq context, sockets, threads,
  session key and output streams around the same IPython shell, and runs as a kernel.

Lifetimes: C dies with T (``PR_SET_PDEATHSIG``), T with K until the host has connected to it,
then with the host's connection (closed when the host frees the snapshot or dies): T outlives
a K that dies. The host keeps a parent alive while it has branches. Every process is made
non-dumpable, so a branch (same uid as its parent at ``"process"``) cannot read another's
memory through ``/proc`` or ``ptrace``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

MODULE_NAME = "__kernelexec_branch__"
"""The module this text becomes in the kernel (``sys.modules``)."""

REQUEST = "kernelexec_branch_request"
"""The shell message that asks a live kernel to fork a template."""

REPLY = "kernelexec_branch_reply"

READY = b"ready"
"""A template's first message to the host: it no longer dies with its kernel."""

HELPER_MODULE = "__kernelexec__"
"""kernelexec's main kernel-side helper: its hooks are removed in a branch before the host
installs it again (else they would run twice)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NAME = 15  # the name ps shows (comm): kx-template, kx-branch
_libc = ctypes.CDLL(None, use_errno=True)
_state: dict[str, Any] = {"kernel_threads": set(), "templates": [], "kept": [], "branch": None}


def install() -> None:
    """Make this kernel forkable: register :data:`REQUEST` on its shell channel."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if not _state["kernel_threads"]:
        _state["kernel_threads"] = _kernel_thread_ids()
    _register(kernel)


def _kernel_thread_ids() -> set[int | None]:
    """Threads that belong to the kernel's machinery (ipykernel, zmq, tornado, IPython,
    kernelexec's kernel side)."""
    ids: set[int | None] = set()
    for thread in threading.enumerate():
        module = type(thread).__module__ or ""
        target = getattr(getattr(thread, "_target", None), "__module__", "") or ""
        name = thread.name or ""
        if (
            thread is threading.main_thread()
            or module.split(".")[0] in ("ipykernel", "zmq", "tornado", "IPython", "jupyter_client")
            or target.split(".")[0] in ("ipykernel", "zmq", "tornado", "IPython")
            or target.startswith("__kernelexec")  # the kernel side's own (fd readers)
            or name in ("Control", "Shell channel", "IOPub")
        ):
            ids.add(thread.ident)
    return ids


def _user_threads() -> list[str]:
    """Names of the live threads the user started (they will not exist in a fork)."""
    known = _state["kernel_threads"] | _kernel_thread_ids()
    return sorted(t.name for t in threading.enumerate() if t.ident not in known and t.is_alive())


def _register(kernel: Any) -> None:
    async def handler(stream: Any, ident: Any, parent: Any) -> None:
        try:
            reply = _fork_template(dict(parent.get("content") or {}))
        except Exception as exc:
            reply = {"status": "error", "evalue": f"{type(exc).__name__}: {exc}"}
        kernel.session.send(stream, REPLY, reply, parent, ident=ident)

    kernel.shell_handlers[REQUEST] = handler


def _fork_template(cfg: dict[str, Any]) -> dict[str, Any]:
    """In the live kernel: fork a template listening at ``cfg["control"]``; its pid."""
    began = time.perf_counter()
    for pid in list(_state["templates"]):  # reap ended templates (K's own children)
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                _state["templates"].remove(pid)
        except ChildProcessError:
            _state["templates"].remove(pid)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    threads = _user_threads()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(cfg["control"])
        listener.listen(1)
        parent = os.getpid()
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            _template(listener, cfg, parent)  # never returns
        paused = time.perf_counter() - started
    finally:
        listener.close()
    _state["templates"].append(pid)
    return {
        "status": "ok",
        "pid": pid,
        "kernel": parent,
        "threads": threads,
        "fork_s": paused,
        "paused_s": time.perf_counter() - began,
    }


# -- the template ---------------------------------------------------------------------------


def _template(listener: socket.socket, cfg: dict[str, Any], parent: int) -> None:
    code = 70
    try:
        _die_with(parent)
        _libc.prctl(_PR_SET_NAME, b"kx-template", 0, 0, 0)
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        while True:  # only the host may take the template (another user's process may try)
            chan, _ = listener.accept()
            cred = chan.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            if int.from_bytes(cred[:4], sys.byteorder, signed=True) == cfg["host"]:
                break
            chan.close()
        listener.close()
        # From here the host's connection is the template's lifeline (_serve ends when the
        # host closes it or dies), not its kernel: the way back of an atomic run whose kernel
        # dies. The host waits for READY before it lets the kernel run anything.
        _libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        chan.send(READY)
        _forget_kernel(cfg)
        _close_inherited(keep={chan.fileno()})
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        gc.freeze()  # a collection would touch every object's header: pages stay shared
        _serve(chan, cfg)
        code = 0
    except BaseException:
        pass
    os._exit(code)


def _die_with(parent: int) -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _forget_kernel(cfg: dict[str, Any]) -> None:
    """Neutralise what belongs to the live kernel: its output streams (a finalised one would
    put its pipe back over fd 1 or 2) and its connection key (wiped, not just dropped)."""
    streams: list[Any] = [sys.stdout, sys.stderr]
    for stream in streams:
        if hasattr(stream, "_should_watch"):
            stream._should_watch = False
            for name in ("_fid", "_original_stdstream_copy"):
                fd = getattr(stream, name, None)
                if isinstance(fd, int):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    setattr(stream, name, None)
            stream.pub_thread = None
            _state["kept"].append(stream)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    seen: set[int] = set()
    for session in _sessions():
        if id(session) in seen:
            continue
        seen.add(id(session))
        key = getattr(session, "key", b"")
        if isinstance(key, bytes) and key:
            _wipe(key)
        try:
            session.auth = None
            session.key = b""
        except Exception:
            pass


def _sessions() -> list[Any]:
    app = _kernel_app()
    found = [getattr(app, "session", None)]
    kernel = getattr(app, "kernel", None)
    found.append(getattr(kernel, "session", None))
    for owner in (kernel, getattr(app, "displayhook", None)):
        found.append(getattr(owner, "session", None))
    return [s for s in found if s is not None]


def _wipe(data: bytes) -> None:
    """Overwrite the bytes of an immutable ``bytes`` object in place (CPython layout)."""
    offset = sys.getsizeof(data) - len(data) - 1
    ctypes.memset(id(data) + offset, 0, len(data))


def _close_inherited(keep: set[int]) -> None:
    """Close every inherited socket and event descriptor (zmq's, the event loops', the output
    pipes' watchers); plain files and pipes of the user's stay open (shared, as after any
    fork). The user's sockets go too: a connection cannot be shared by two processes."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3 or fd in keep:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:") or target.startswith("anon_inode:"):
            with contextlib.suppress(OSError):
                os.close(fd)


def _serve(chan: socket.socket, cfg: dict[str, Any]) -> None:
    """The template's loop: fork a branch per request, report a branch's exit status."""
    me = os.getpid()
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(chan, 1 << 20, 4)
        except InterruptedError:
            continue
        if not data:
            return
        req = json.loads(data)
        if req.get("op") == "fork":
            started = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                chan.close()
                _branch(req, fds, me)  # never returns
            took = time.perf_counter() - started
            for fd in fds:
                os.close(fd)
            chan.send(json.dumps({"pid": pid, "fork_s": took}).encode())
        elif req.get("op") == "status":
            try:
                _, status = os.waitpid(int(req["pid"]), 0)
                answer: Any = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                answer = None
            chan.send(json.dumps({"status": answer}).encode())


# -- a branch -------------------------------------------------------------------------------


def _branch(req: dict[str, Any], fds: list[int], template: int) -> None:
    code = 1
    try:
        _die_with(template)
        _libc.prctl(_PR_SET_NAME, b"kx-branch", 0, 0, 0)
        os.setsid()
        if fds:
            os.dup2(fds[0], 2)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
        os.chdir(req["cwd"])
        os.environ.update(req.get("env") or {})
        _state["branch"] = {"origin": req.get("origin", ""), "threads": req.get("threads", [])}
        app = _become_kernel(req)
        code = 0
        app.io_loop.start()
    except BaseException:
        import traceback

        traceback.print_exc()
    os._exit(code)


def _kernel_app() -> Any:
    kernelapp = sys.modules.get("ipykernel.kernelapp")
    if kernelapp is None:
        return None
    return kernelapp.IPKernelApp.instance() if kernelapp.IPKernelApp.initialized() else None


def _become_kernel(req: dict[str, Any]) -> Any:
    """Build this process's own kernel around the inherited IPython shell (the parts of
    ``IPKernelApp.initialize`` that touch sockets, threads and streams; its configuration,
    shell, extensions and imports are inherited)."""
    zmq = importlib.import_module("zmq")
    session_mod = importlib.import_module("jupyter_client.session")
    ioloop = importlib.import_module("tornado.ioloop")
    ipkernel = importlib.import_module("ipykernel.ipkernel")
    app = _kernel_app()
    old = app.kernel
    shell = old.shell
    _state["kept"].extend([old, app.displayhook])
    _drop_helper_hooks(shell)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.events._set_running_loop(None)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    ioloop.IOLoop.current()
    info = req["info"]
    app.session = session_mod.Session(
        key=info["key"].encode(),
        signature_scheme=info.get("signature_scheme", "hmac-sha256"),
        username=getattr(old.session, "username", "kernel"),
    )
    app.transport = info["transport"]
    app.ip = info["ip"]
    for name in ("shell", "iopub", "stdin", "control", "hb"):
        setattr(app, f"{name}_port", int(info[f"{name}_port"]))
    app.context = None
    app.heartbeat = None
    app.poller = None
    app.init_sockets()
    app.init_heartbeat()
    app._ports = {
        n: getattr(app, f"{n}_port") for n in ("shell", "iopub", "stdin", "hb", "control")
    }
    app.init_io()
    # Comms are the parent's: a branch starts with none.
    setattr(ipkernel, "_comm_manager", None)  # noqa: B010
    type(old).clear_instance()
    app.init_kernel()
    kernel = app.kernel
    shell.kernel = kernel
    kernel.shell = shell
    shell.display_trap.nested_level = 0  # a fork is never inside a cell
    _register(kernel)
    shell.events.register("pre_execute", _tell_about_threads)
    gc.freeze()
    kernel.start()
    app.io_loop = ioloop.IOLoop.current()
    del zmq
    return app


def _drop_helper_hooks(shell: Any) -> None:
    """Remove what kernelexec's helpers hooked into the shell (the host installs them again
    in this kernel): their event callbacks and the patched ``user_expressions``."""
    ours = (HELPER_MODULE, MODULE_NAME)
    for callbacks in shell.events.callbacks.values():
        callbacks[:] = [cb for cb in callbacks if getattr(cb, "__module__", None) not in ours]
    shell.__dict__.pop("user_expressions", None)


def _tell_about_threads() -> None:
    """On the branch's first run that is not silent (kernelexec's own requests are), warn about
    the parent's threads that do not exist here."""
    info = _state.get("branch")
    if not info:
        return
    from IPython import get_ipython

    parent = get_ipython().kernel.get_parent()
    if (parent.get("content") or {}).get("silent"):
        return
    _state["branch"] = None
    threads = info.get("threads") or []
    if threads:
        names = ", ".join(repr(t) for t in threads)
        print(
            f"RuntimeWarning: kernelexec: this session was forked from {info['origin']!r}; "
            f"threads started there do not run here: {names}",
            file=sys.stderr,
        )
