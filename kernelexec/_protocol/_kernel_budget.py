"""A run's output budget inside the kernel: every output capped, counted, and the count reported.

Like ``_kernel_side.py`` this module is never imported by the host for use in a kernel: its
source rides in the install request and is executed in the kernel (as ``__kernelexec_budget__``),
standard library only. The host imports its constants (the payload's name and keys, the output
message types), so both halves spell them once.

The kernel otherwise ships a 200 MB print as one message: stdout/stderr, displays, errors and
tracebacks share ``max_output_chars``. Each run's output messages are counted, and the count
rides on the reply (``OUTPUTS_PAYLOAD``), so the host can tell when the transport dropped some
and, for a served call, when it has them all.

**Counted from the first message.** ipykernel makes a request the parent of the kernel's output
(of every thread without a parent of its own) as soon as it takes the request, before the run's
``pre_execute`` resets the budget: what is sent in that gap (a daemon thread that prints every
millisecond, an input transformer that prints) is the run's output too. Counted nowhere, it let
the host's count reach the reply's before the run's own ``execute_result`` had arrived, and the
host ended the run without it (the result lost, nothing said). Messages of a request that is
not the current run are counted aside (:attr:`Budget.early`) and become the run's at its reset.
"""

from __future__ import annotations

import json
import threading
from typing import Any

OUTPUTS_PAYLOAD = "kernelexec.outputs"
"""The ``source`` of the reply payload that says how many output messages a run sent."""

SENT = "sent"
"""The payload's count of the run's output messages handed to ipykernel for sending."""

SUPPRESSED = "suppressed"
"""The payload's count of the run's outputs not sent at all: the budget was spent."""

LIMIT = "limit"
"""The payload's copy of the budget, in characters."""

OUTPUT_TYPES = frozenset(
    {"stream", "display_data", "execute_result", "error", "update_display_data", "clear_output"}
)
"""The iopub message types that are a run's outputs (counted on both sides)."""

_ERROR_FLOOR = 2_000  # an error is always readable, even when prints used the whole budget

_EARLY_PARENTS = 64  # requests whose output is counted aside (threads with parents of their own)


class Budget:
    """A run's output budget, shared by every kind of output, and its count of sent messages.

    Enforced where ipykernel hands a message to its session for sending (:func:`guard_session`),
    below anything IPython or user code may swap (``sys.stdout.write`` is rewrapped by IPython
    9 around every cell). Also called from ipykernel's IOPub thread, hence the lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        # Output messages (sent, suppressed) of requests other than the current run, by
        # request, the newest last: a run's own from before its reset (see the module's
        # docstring). Bounded: only the newest requests can still become a run.
        self.early: dict[Any, list[int]] = {}
        self.reset(None)

    def reset(self, run_id: str | None) -> None:
        """Start ``run_id``'s budget; its messages sent before this count as its own."""
        with self.lock:
            sent, suppressed = self.early.pop(run_id, (0, 0)) if run_id is not None else (0, 0)
            self.early.clear()
            self.run_id = run_id
            self.used = 0
            self.sent = sent  # output messages of this run handed to the session
            self.suppressed = suppressed  # outputs not sent at all: the budget was spent
            self.stream_cut = False
            self.error_allowance = _ERROR_FLOOR

    def admit(self, kind: str, content: dict[str, Any], of: Any) -> bool:
        """Fit an output message into the budget (``content`` is cut in place); False: drop it.

        ``of``: the id of the request the message belongs to (its parent), counted as one of
        the current run's, or aside (:attr:`early`) for a request that may yet become one.
        """
        with self.lock:
            keep = self._fit(kind, content)
            if of is None:
                return keep
            if of == self.run_id:
                if keep:
                    self.sent += 1
                else:
                    self.suppressed += 1
                return keep
            counts = self.early.pop(of, None)
            if counts is None:
                counts = [0, 0]
                if len(self.early) >= _EARLY_PARENTS:
                    del self.early[next(iter(self.early))]
            counts[0 if keep else 1] += 1
            self.early[of] = counts  # (again) the newest
            return keep

    def _fit(self, kind: str, content: dict[str, Any]) -> bool:
        room = self.limit - self.used
        if kind == "stream":
            if self.stream_cut:
                return False
            text = str(content.get("text", ""))
            if len(text) > room:
                content["text"] = (
                    text[: max(room, 0)]
                    + f"\n[kernelexec: output truncated at {self.limit} characters]\n"
                )
                self.stream_cut = True
            self.used += min(len(text), max(room, 0))
            return True
        if kind in ("display_data", "execute_result", "update_display_data"):
            data = content.get("data")
            size = data_size(data) if isinstance(data, dict) else 0
            if size <= room:
                self.used += size
                return True
            if room <= 0:
                return False
            content["data"] = {
                "text/plain": f"[kernelexec: display output of {size} characters dropped: "
                f"over the output budget of {self.limit} characters]"
            }
            content["metadata"] = {}
            self.used = self.limit
            return True
        if kind == "error":
            self.error_allowance = max(room, _ERROR_FLOOR)
            self.used += cap_error(content, self.error_allowance)
            return True
        return True  # clear_output


def data_size(data: dict[str, Any]) -> int:
    size = 0
    for value in data.values():
        if isinstance(value, str):
            size += len(value)
        else:
            try:
                size += len(json.dumps(value))
            except (TypeError, ValueError):
                size += len(repr(value))
    return size


def cap_error(content: dict[str, Any], allowance: int) -> int:
    """Cut an error's message and traceback (in place) to ``allowance`` characters in all,
    keeping the end of the traceback (where the failure is); returns the size kept."""
    evalue = str(content.get("evalue", ""))
    traceback = [str(line) for line in content.get("traceback") or []]
    size = len(evalue) + sum(len(line) for line in traceback)
    if size <= allowance:
        return size
    half = allowance // 2
    if len(evalue) > half:
        dropped = len(evalue) - half
        evalue = evalue[:half] + f"... [kernelexec: {dropped} characters cut]"
    rest = allowance - len(evalue)
    kept: list[str] = []
    for line in reversed(traceback):
        if rest <= 0:
            break
        if len(line) > rest:
            line = line[:rest] + "... [kernelexec: cut]"
        kept.append(line)
        rest -= len(line)
    if sum(len(line) for line in kept) < sum(len(line) for line in traceback):
        kept.append(f"[kernelexec: traceback cut to the output budget of {allowance} characters]")
    content["evalue"] = evalue
    content["traceback"] = kept[::-1]
    return allowance


def parent_id(parent: Any) -> Any:
    if not isinstance(parent, dict):
        return None
    header = parent.get("header", parent)
    return header.get("msg_id") if isinstance(header, dict) else None


def guard_session(session: Any, budget: Budget, gate: Any) -> None:
    """Make every output message pass the budget before it is serialised and sent, once the
    host has room for it (``gate``: see ``_kernel_output``)."""
    original = session.send

    def send(
        stream: Any,
        msg_or_type: Any,
        content: Any = None,
        parent: Any = None,
        *args: Any,
        **kw: Any,
    ) -> Any:
        if isinstance(msg_or_type, dict):
            kind = (msg_or_type.get("header") or {}).get("msg_type")
            body = msg_or_type.get("content")
            of = parent_id(msg_or_type.get("parent_header"))
        else:
            kind, body, of = msg_or_type, content, parent_id(parent)
        if kind in OUTPUT_TYPES and isinstance(body, dict):
            if gate is not None:
                gate.wait()
            if not budget.admit(str(kind), body, of):
                return None
        return original(stream, msg_or_type, content, parent, *args, **kw)

    session.send = send


def account(budget: Budget, parent: Any, reply: Any) -> None:
    """Put the run's output count in its reply, and cut the reply's copy of an error."""
    if not isinstance(reply, dict) or parent_id(parent) != budget.run_id:
        return
    if reply.get("status") == "error":
        cap_error(reply, budget.error_allowance)
    with budget.lock:
        counts = {SENT: budget.sent, SUPPRESSED: budget.suppressed, LIMIT: budget.limit}
    payload = reply.get("payload")
    if isinstance(payload, list):
        payload.append({"source": OUTPUTS_PAYLOAD, **counts})
