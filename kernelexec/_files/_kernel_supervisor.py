"""The supervisor of one background command, run by the commands helper inside a kernel.

Never imported, in the kernel or on the host: its source text is handed to the commands helper
(``_kernel_commands.py``) at install, which runs it with ``python -I -S -c`` as the command's
parent, titled ``kernelexec command`` in ``ps``. Standard library only (it runs in the kernel's
interpreter, with neither the environment nor the installed packages).

It runs the command as its child, in the process group the supervisor leads, and kills that
group when the kernel dies (the read end of a pipe whose write end only the kernel holds
reaches end of file): a command never outlives its kernel, whatever killed the kernel. It exits
as the command did; 127 when the program does not exist, 126 when it may not be run.
"""

import os
import select
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    """Supervise the command ``argv[1:]``; ``argv[0]`` is the kernel's liveness descriptor."""
    alive = int(argv[0])
    try:
        child = subprocess.Popen(argv[1:], stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        sys.stderr.write(f"{argv[1]}: command not found ({exc.strerror})\n")
        return 127
    except PermissionError as exc:
        sys.stderr.write(f"{argv[1]}: {exc.strerror}\n")
        return 126
    watch = select.poll()  # not select(): it cannot take a descriptor above 1023
    watch.register(alive, select.POLLIN)
    waiting: int | None = 500
    try:
        watch.register(os.pidfd_open(child.pid), select.POLLIN)
        waiting = None
    except (AttributeError, OSError):
        pass
    while child.poll() is None:
        ready = [fd for fd, _ in watch.poll(waiting)]
        if alive in ready:
            os.killpg(0, signal.SIGKILL)
    code = child.returncode
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
