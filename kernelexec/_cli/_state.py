"""``kernelexec sessions --state-dir DIR``: the agents of a ``state_dir`` (hibernated ones with
their size and age, and which executor holds each, or none), and ``--delete AGENT`` to delete
one agent's saved state."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kernelexec._durable._leases import Holder, LeaseBook
from kernelexec._durable._store import StateStore
from kernelexec._exceptions import ConfigError

EXIT_OK = 0
EXIT_USAGE = 2


def cmd_state_sessions(ns: argparse.Namespace) -> int:
    """List (or delete from) the agents of ``ns.state_dir``."""
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
    holders = LeaseBook(root).held()
    listed: list[dict[str, Any]] = []
    for a in agents:
        holder = holders.pop((a.agent_id, a.env), None)
        listed.append({**a.model_dump(), "holder": _holder(holder)})
    for (agent_id, env), holder in sorted(holders.items()):  # held, no checkpoint yet
        listed.append({"agent_id": agent_id, "env": env, "holder": _holder(holder)})
    if ns.json:
        print(json.dumps(listed, indent=2))
        return EXIT_OK
    rows = [("AGENT", "ENV", "NAMES", "SIZE", "SAVED", "AGE", "HOLDER")]
    for entry in listed:
        held = entry["holder"]
        rows.append(
            (
                entry["agent_id"],
                entry["env"][:12] or "default",
                str(len(entry["names"])) if "names" in entry else "-",
                _size(entry["bytes"]) if "bytes" in entry else "-",
                (entry.get("saved_at") or "-")[:19],
                _age(entry["age_s"]) if "age_s" in entry else "-",
                f"pid {held['pid']} on {held['host']}" if held else "none",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return EXIT_OK


def _holder(holder: Holder | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    return {
        "pid": holder.pid,
        "host": holder.host,
        "since": holder.since,
        "renewed_at": holder.renewed_at,
    }


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
