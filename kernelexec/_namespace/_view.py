"""The host half of the namespace view: reading a run's changes off its reply, and the
variables listing off its answer (the kernel half is ``_kernel_namespace.py``)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from kernelexec._models import StateChanges, Variable
from kernelexec._namespace import _kernel_namespace as kernel_namespace

CHANGES_PAYLOAD = kernel_namespace.CHANGES_PAYLOAD
MODULE_NAME = kernel_namespace.MODULE_NAME
NO_CHANGES = StateChanges()


def read_changes(reply: dict[str, Any] | None) -> StateChanges:
    """The changes the kernel half put in ``reply``'s payload (none when it has none)."""
    payloads = (reply or {}).get("payload")
    for payload in payloads if isinstance(payloads, list) else []:
        if isinstance(payload, dict) and payload.get("source") == CHANGES_PAYLOAD:
            try:
                return StateChanges.model_validate(payload)
            except ValidationError:
                return NO_CHANGES
    return NO_CHANGES


def read_variables(text: Any) -> list[Variable]:
    """The listing the kernel half answered (JSON text; empty when it is not one)."""
    try:
        data = json.loads(text) if isinstance(text, str) else []
    except ValueError:
        return []
    found: list[Variable] = []
    for entry in data if isinstance(data, list) else []:
        try:
            found.append(Variable.model_validate(entry))
        except ValidationError:
            continue
    return found
