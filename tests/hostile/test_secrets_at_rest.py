"""Secrets at rest: whoever reads a ``state_dir`` (a backup, a copy, a later tenant of the
disk) must not find the executor's ``env_vars`` values there, and a secret rotated in the next
executor's ``env_vars`` must not be overridden by the old one a checkpoint remembered."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import kernelexec as kx


def _every_byte(root: Path) -> bytes:
    chunks = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            chunks.append(Path(dirpath, name).read_bytes())
    return b"\n".join(chunks)


@pytest.mark.parametrize("checkpoint", ["on_evict", "after_call"])
def test_env_vars_never_stored_and_a_rotated_secret_wins(tmp_path: Path, checkpoint: str) -> None:
    old, new, per_call = (f"sk-{kind}-{uuid.uuid4().hex}" for kind in ("old", "new", "call"))
    state = tmp_path / "state"
    with kx.KernelExecutor(state_dir=state, env_vars={"API_KEY": old}, checkpoint=checkpoint) as ex:
        s = ex.session("holder")
        first = s.run_code(
            "import os\nkey_length = len(os.environ['API_KEY'])\nos.environ['MINE'] = 'kept'\n"
        )
        assert first.ok, first.error
        second = s.run_code("token_length = 1", env_vars={"CALL_TOKEN": per_call})
        assert second.ok, second.error
        if checkpoint == "after_call":
            stored = _every_byte(state)  # the after-call checkpoint, taken inside the call
            assert per_call.encode() not in stored
            assert old.encode() not in stored
    stored = _every_byte(state)  # hibernated at close
    assert b"key_length" in stored  # the checkpoint is there
    assert old.encode() not in stored
    assert per_call.encode() not in stored

    with kx.KernelExecutor(state_dir=state, env_vars={"API_KEY": new}) as ex:
        back = ex.session("holder").run_code(
            "import os\nprint(os.environ['API_KEY'], os.environ.get('MINE'),"
            " os.environ.get('CALL_TOKEN'), key_length)"
        )
    assert back.ok, back.error
    assert back.restored is not None
    assert back.stdout == f"{new} kept None {len(old)}\n"
