"""``kernelexec sessions`` and ``kernelexec attach``: list live agent kernels, open a console.

Only sessions of executors made with ``attachable=True`` are registered (see
``kernelexec._core._attach``). The console is jupyter-console's, with one change: leaving it
(``exit``, ``quit``, Ctrl-D) never stops the agent's kernel. Stock jupyter-console sends
``exit`` to the kernel, which stops it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_LEAVE = frozenset({"exit", "quit", "exit()", "quit()", "%exit", "%quit"})


def add_parsers(sub: Any) -> None:
    """Add ``sessions`` and ``attach`` to the ``kernelexec`` parser's subcommands."""
    sessions = sub.add_parser(
        "sessions", help="list the live sessions of attachable executors on this machine"
    )
    sessions.add_argument("--json", action="store_true", help="print them as JSON only")
    sessions.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="list the agents of a state_dir instead (size, age and holder)",
    )
    sessions.add_argument(
        "--delete",
        default=None,
        metavar="AGENT_ID",
        help="with --state-dir: delete that agent's saved state",
    )
    attach = sub.add_parser("attach", help="open a console on a live agent's kernel")
    attach.add_argument("agent_id", metavar="AGENT_ID", help="the live session's agent id")
    attach.add_argument(
        "--host-pid", type=int, default=None, help="the executor's process, when several match"
    )
    attach.add_argument(
        "--fingerprint", default=None, help="the environment (a prefix), when several match"
    )


def cmd_sessions(ns: argparse.Namespace) -> int:
    """Print the live sessions (or a state_dir's hibernated agents), as a table or JSON."""
    if ns.delete is not None and ns.state_dir is None:
        print("kernelexec: --delete needs --state-dir DIR", file=sys.stderr)
        return EXIT_USAGE
    if ns.state_dir is not None:
        from kernelexec._cli._state import cmd_state_sessions

        return cmd_state_sessions(ns)
    from kernelexec._core._attach import live_sessions

    found = [_public(e) for e in live_sessions()]
    if ns.json:
        print(json.dumps(found, indent=2))
        return EXIT_OK
    if not found:
        print("no live attachable sessions (executors need attachable=True)", file=sys.stderr)
        return EXIT_OK
    rows = [("AGENT", "ENV", "KERNEL PID", "HOST PID", "STARTED", "CALLS")]
    for e in found:
        kernel = str(e["kernel_pid"]) if e.get("kernel_pid") else "-"
        rows.append(
            (
                str(e.get("agent_id", "?")),
                str(e.get("fingerprint", "?"))[:12],
                kernel,
                str(e.get("host_pid", "?")),
                str(e.get("started", "?"))[:19],
                str(e.get("calls", "?")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return EXIT_OK


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "host_start"}


class AttachError(Exception):
    """No single live session matches; exit status 2."""


def find_session(
    agent_id: str, host_pid: int | None = None, fingerprint: str | None = None
) -> dict[str, Any]:
    """The one live session of ``agent_id`` (narrowed by host pid and fingerprint prefix).

    Raises:
        AttachError: none or several match, or it has no kernel right now.
    """
    from kernelexec._core._attach import live_sessions

    live = live_sessions()
    matches = [
        e
        for e in live
        if e.get("agent_id") == agent_id
        and (host_pid is None or e.get("host_pid") == host_pid)
        and (fingerprint is None or str(e.get("fingerprint", "")).startswith(fingerprint))
    ]
    if not matches:
        known = ", ".join(sorted({str(e.get("agent_id")) for e in live})) or "none"
        raise AttachError(f"no live attachable session of agent {agent_id!r} (live: {known})")
    if len(matches) > 1:
        which = "; ".join(
            f"--host-pid {e['host_pid']} --fingerprint {e['fingerprint']}" for e in matches
        )
        raise AttachError(f"{len(matches)} sessions of agent {agent_id!r}: choose with {which}")
    entry = matches[0]
    if not entry.get("connection_file"):
        raise AttachError(
            f"agent {agent_id!r} has no kernel right now (it gets one at its next call)"
        )
    return entry


def cmd_attach(ns: argparse.Namespace) -> int:
    """Open jupyter-console on the agent's live kernel; return when the console is left."""
    try:
        entry = find_session(ns.agent_id, ns.host_pid, ns.fingerprint)
    except AttachError as exc:
        print(f"kernelexec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        app = _console_app()
    except ImportError:
        print(
            "kernelexec: attach needs jupyter-console: pip install 'kernelexec[attach]'",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(
        f"kernelexec: attached to agent {entry['agent_id']!r} (kernel pid {entry['kernel_pid']}, "
        f"host pid {entry['host_pid']}). Its calls go on; they wait while your code runs. "
        "Ctrl-D or exit leaves the kernel running.",
        flush=True,
    )
    app.launch_instance(
        argv=[
            "--existing",
            str(entry["connection_file"]),
            "--ZMQTerminalInteractiveShell.include_other_output=False",
        ]
    )
    return EXIT_OK


def _console_app() -> Any:
    from jupyter_client.consoleapp import JupyterConsoleApp
    from jupyter_console.app import ZMQTerminalIPythonApp
    from jupyter_console.ptshell import ZMQTerminalInteractiveShell

    class AgentShell(ZMQTerminalInteractiveShell):  # type: ignore[misc]
        """Leaving never shuts the kernel down: it is the agent's, not the console's."""

        def run_cell(self, cell: str, store_history: bool = True) -> None:
            # Sent to the kernel, ``exit`` would stop the kernel itself (ipykernel sets
            # exit_now), whatever the console then decides: leave here instead.
            if cell.strip() in _LEAVE:
                self.ask_exit()
                return
            super().run_cell(cell, store_history)

        def ask_exit(self) -> None:
            self.keepkernel = True
            super().ask_exit()

    class AttachApp(ZMQTerminalIPythonApp):  # type: ignore[misc]
        def init_shell(self) -> None:
            JupyterConsoleApp.initialize(self)
            signal.signal(signal.SIGINT, self.handle_sigint)
            self.shell = AgentShell.instance(
                parent=self,
                manager=None,
                client=self.kernel_client,
                confirm_exit=False,
            )
            self.shell.own_kernel = False

    return AttachApp
