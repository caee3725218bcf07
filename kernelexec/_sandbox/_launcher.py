"""The launcher that sits between the host and a kernel: it puts the kernel in its cgroups,
sets its rlimits, bridges the paths its user cannot reach and gives it a private scratch space
(``_mounts``), takes user namespaces away (``_seccomp``), drops it to its own user, and reaps
every descendant when the kernel ends, the host asks it to stop, or the host dies. Confined
builds of tool-named requirements run under it too (``_build``), with an empty network
namespace where their kernels get no network.

It is standard-library Python run as text (``python -c``) by the host's interpreter, so it
works for any kernel interpreter. It makes itself a child subreaper, so processes the kernel
orphans (double forks, ``setsid`` daemons) become its children and cannot escape, and asks for
SIGTERM when the host's thread that started it goes (``PR_SET_PDEATHSIG``); the kernel gets
SIGKILL when the launcher goes, so killing the launcher cannot leave the kernel running. Whatever
ends
the kernel, the launcher kills the remaining descendants and exits with the kernel's status
(re-raising the signal that killed it), so the host sees the kernel's own exit.

A fork server (``backends._forkserver``) runs the same text in a forked child of its own, with
``sys.argv`` set as here and a ``run_kernel`` function in the globals: the kernel process then
calls it after :func:`setup` instead of executing ``argv``, so both launches get one ``setup``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kernelexec import _proctitle
from kernelexec._sandbox import _mounts, _seccomp

# jupyter-client substitutes "{name}" in every argument: this text must contain none.
SOURCE = (
    "# kernelexec launcher\n"
    + _proctitle.SOURCE
    + f"kx_set_title({_proctitle.LAUNCHER!r}, {_proctitle.COMMS[_proctitle.LAUNCHER]!r})\n"
    + r"""
import ctypes, json, os, resource, signal, sys, time
cfg = json.loads(sys.argv[1])
argv = sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGTERM, 0, 0, 0)
if os.getppid() != cfg["host"]:
    sys.exit(1)
libc.prctl(36, 1, 0, 0, 0)
stopping = []
kernel = [0]

def on_term(signum, frame):
    stopping.append(signum)
    if kernel[0]:
        try:
            os.kill(kernel[0], signal.SIGKILL)
        except OSError:
            pass

signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, lambda signum, frame: None)

def children():
    found = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open("/proc/self/task/" + tid + "/children") as fh:
                found.update(int(p) for p in fh.read().split())
        except OSError:
            pass
    return found

def reap_all():
    while True:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue

def setup():
    for path in cfg["procs"]:
        with open(path, "w") as fh:
            fh.write(str(os.getpid()))
    for res, value in cfg["rlimits"]:
        resource.setrlimit(res, (value, value))
    bridge(cfg["bridges"], cfg["scratch"])
    if cfg["netns"] and libc.unshare(0x40000000) != 0:  # CLONE_NEWNET: no network at all
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    if cfg["no_userns"]:
        drop_userns()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.umask(0o077)
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:
        os._exit(1)
"""
    + _mounts.SOURCE
    + _seccomp.SOURCE
    + r"""
launcher = os.getpid()
run_kernel = globals().get("run_kernel")
pid = os.fork()
if pid == 0:
    try:
        setup()
        if run_kernel is not None:
            run_kernel()  # forked from a fork server: the kernel runs here; never returns
        os.execvp(argv[0], argv)
    except BaseException as exc:
        os.write(2, ("kernelexec launcher: " + repr(exc) + "\n").encode())
    os._exit(127)
kernel[0] = pid
if stopping:
    on_term(signal.SIGTERM, None)
status = None
while status is None:
    try:
        done, st = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if done == pid:
        status = st
reap_all()
if status is not None and os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), sig)
sys.exit(os.WEXITSTATUS(status) if status is not None else 1)
"""
)


def launcher_config(
    *,
    procs: list[str],
    rlimits: list[tuple[int, int]],
    uid: int | None,
    host_pid: int,
    bridges: list[tuple[str, list[str]]] | None = None,
    scratch: dict[str, Any] | None = None,
    no_userns: bool = False,
    netns: bool = False,
) -> dict[str, Any]:
    """The launcher's configuration: the cgroup ``procs`` files to join, the rlimits, the
    kernel's uid, the process that must be its parent, the paths to bridge and the private
    scratch space (see :mod:`kernelexec._sandbox._mounts`), and whether user namespaces are
    taken away (:mod:`kernelexec._sandbox._seccomp`) and the network (an empty network
    namespace: ``netns``, used for builds; kernels under bwrap get bwrap's). The plain launch
    passes it on the command line; a fork server hands it to the launcher it runs in the
    forked child."""
    return {
        "procs": procs,
        "rlimits": rlimits,
        "uid": uid,
        "host": host_pid,
        "bridges": bridges or [],
        "scratch": scratch,
        "no_userns": no_userns,
        "netns": netns,
    }


def launcher_argv(kernel_argv: list[str], cfg: dict[str, Any]) -> list[str]:
    """The command line that runs ``kernel_argv`` under the launcher configured by ``cfg``
    (:func:`launcher_config`)."""
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        SOURCE,
        json.dumps(cfg, separators=(",", ":")),
        *kernel_argv,
    ]
