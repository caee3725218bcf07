"""Wheels made by the tests themselves: offline and byte-for-byte deterministic."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

_EPOCH = (2020, 1, 1, 0, 0, 0)


def make_wheel(directory: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel holding package ``name`` whose ``__init__`` is ``source``."""
    dist = f"{name}-{version}"
    files = {
        f"{name}/__init__.py": source,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: kernelexec-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    path = directory / f"{dist}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{member},sha256={digest.decode()},{len(data)}")
            wheel.writestr(zipfile.ZipInfo(member, _EPOCH), data)
        record.append(f"{dist}.dist-info/RECORD,,")
        wheel.writestr(zipfile.ZipInfo(f"{dist}.dist-info/RECORD", _EPOCH), "\n".join(record))
    return path
