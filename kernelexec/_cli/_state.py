"""``kernelexec sessions --state-dir DIR``: the hibernated agents of a ``state_dir`` (size and
age), and ``--delete AGENT`` to delete one agent's saved state."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernelexec._durable._store import StateStore
from kernelexec._exceptions import ConfigError

EXIT_OK = 0
EXIT_USAGE = 2


def cmd_state_sessions(ns: argparse.Namespace) -> int:
    """List (or delete from) the hibernated agents of ``ns.state_dir``."""
    root = Path(ns.state_dir).expanduser()
    if not (root / "agents").is_dir():
        print(f"{root} is not a kernelexec state_dir", file=sys.stderr)
        return EXIT_USAGE
    store = StateStore(root)
    if ns.delete is not None:
        try:
            store.open(exclusive=True)  # not while an executor uses the directory
        except ConfigError as exc:
            print(f"kernelexec: {exc}", file=sys.stderr)
            return EXIT_USAGE
        try:
            found = store.delete(ns.delete)
        finally:
            store.close()
        print(f"deleted the state of {ns.delete!r}" if found else f"no state of {ns.delete!r}")
        return EXIT_OK
    agents = store.agents()
    if ns.json:
        print(json.dumps([a.model_dump() for a in agents], indent=2))
        return EXIT_OK
    rows = [("AGENT", "ENV", "NAMES", "SIZE", "SAVED", "AGE")]
    for a in agents:
        rows.append(
            (
                a.agent_id,
                a.env[:12] or "default",
                str(len(a.names)),
                _size(a.bytes),
                (a.saved_at or "?")[:19],
                _age(a.age_s),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return EXIT_OK


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
