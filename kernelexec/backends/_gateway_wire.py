"""The kernel websocket's wire formats: building Jupyter messages and framing them both ways.

A Jupyter Server kernel websocket (``/api/kernels/{id}/channels``) carries every channel's
messages. Two framings exist:

* ``v1.kernel.websocket.jupyter.org`` (offered as a subprotocol; Jupyter Server 2): one binary
  frame per message: a little-endian u64 count ``n``, ``n`` u64 offsets, then the channel name,
  the header, parent header, metadata and content as JSON, and the binary buffers.
* the legacy framing (servers that pick no subprotocol, such as Enterprise Gateway 3 on Jupyter
  Server 1): a text frame holding the message as one JSON object with a ``channel`` key, or, when
  it has buffers, a binary frame: a big-endian u32 count, u32 offsets, the JSON, the buffers.

Nothing here does I/O. Decoding never raises: the peer is untrusted and garbage is dropped.
"""

from __future__ import annotations

import json
import struct
import uuid
from datetime import datetime, timezone
from typing import Any

from kernelexec.backends._base import KernelMessage

V1 = "v1.kernel.websocket.jupyter.org"
PROTOCOL_VERSION = "5.3"
_RECEIVED = frozenset(("shell", "iopub", "control"))


def new_message(
    session: str,
    username: str,
    msg_type: str,
    content: dict[str, Any],
    metadata: dict[str, Any] | None,
) -> dict[str, Any]:
    """A request message (no channel, no buffers) with a fresh ``msg_id``."""
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "username": username,
            "session": session,
            "date": datetime.now(timezone.utc).isoformat(),
            "version": PROTOCOL_VERSION,
        },
        "parent_header": {},
        "metadata": metadata or {},
        "content": content,
    }


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def encode(msg: dict[str, Any], channel: str, buffers: tuple[bytes, ...], v1: bool) -> str | bytes:
    """One websocket frame for ``msg`` on ``channel`` in the negotiated framing."""
    if v1:
        parts = [
            channel.encode(),
            _dumps(msg["header"]),
            _dumps(msg["parent_header"]),
            _dumps(msg["metadata"]),
            _dumps(msg["content"]),
            *buffers,
        ]
        offsets = [8 * (len(parts) + 2)]
        for part in parts:
            offsets.append(offsets[-1] + len(part))
        head = struct.pack(f"<{len(offsets) + 1}Q", len(offsets), *offsets)
        return head + b"".join(parts)
    body = dict(msg, channel=channel)
    if not buffers:
        return json.dumps(body, ensure_ascii=False)
    # The buffer list in the JSON is replaced by the frame's binary parts.
    blobs = [_dumps(body), *buffers]
    offsets = [4 * (len(blobs) + 1)]
    for blob in blobs[:-1]:
        offsets.append(offsets[-1] + len(blob))
    return struct.pack(f"!{len(blobs) + 1}I", len(blobs), *offsets) + b"".join(blobs)


def decode(frame: str | bytes, v1: bool) -> tuple[str, KernelMessage] | None:
    """The message in one frame and its ``msg_id``, or None for anything malformed or for a
    channel kernelexec does not read (stdin)."""
    try:
        if isinstance(frame, str):
            return _from_dict(json.loads(frame), ())
        if v1:
            return _decode_v1(frame)
        return _decode_legacy_binary(frame)
    except Exception:
        return None


def _decode_v1(frame: bytes) -> tuple[str, KernelMessage] | None:
    (count,) = struct.unpack_from("<Q", frame, 0)
    if not 6 <= count <= 4096 or len(frame) < 8 * (count + 1):
        return None
    offsets = struct.unpack_from(f"<{count}Q", frame, 8)
    parts = [frame[offsets[i] : offsets[i + 1]] for i in range(count - 1)]
    channel = parts[0].decode()
    if channel not in _RECEIVED:
        return None
    header = json.loads(parts[1])
    parent = json.loads(parts[2]) or {}
    content = json.loads(parts[4])
    return _message(channel, header, parent, content, tuple(parts[5:]))


def _decode_legacy_binary(frame: bytes) -> tuple[str, KernelMessage] | None:
    (count,) = struct.unpack_from("!I", frame, 0)
    if not 1 <= count <= 4096 or len(frame) < 4 * (count + 1):
        return None
    offsets = [*struct.unpack_from(f"!{count}I", frame, 4), len(frame)]
    blobs = [frame[offsets[i] : offsets[i + 1]] for i in range(count)]
    return _from_dict(json.loads(blobs[0]), tuple(blobs[1:]))


def _from_dict(msg: Any, buffers: tuple[bytes, ...]) -> tuple[str, KernelMessage] | None:
    if not isinstance(msg, dict):
        return None
    channel = msg.get("channel")
    if channel not in _RECEIVED:
        return None
    return _message(
        channel, msg["header"], msg.get("parent_header") or {}, msg.get("content"), buffers
    )


def _message(
    channel: str, header: Any, parent: Any, content: Any, buffers: tuple[bytes, ...]
) -> tuple[str, KernelMessage] | None:
    if not isinstance(header, dict) or not isinstance(parent, dict):
        return None
    parent_id = parent.get("msg_id")
    msg = KernelMessage(
        channel=channel,  # type: ignore[arg-type]
        msg_type=str(header["msg_type"]),
        parent_id=str(parent_id) if parent_id else None,
        content=content if isinstance(content, dict) else {},
        buffers=buffers,
    )
    return str(header.get("msg_id") or ""), msg
