"""Moving files in and out of a session: ``session.files`` against the base64 baseline.

For 1 MiB and 100 MiB files, write and read MiB/s through a local kernel (``isolation="none"``)
and through a real Jupyter Kernel Gateway on 127.0.0.1 (``tests/support/gateway.py``), each measured
three times (the median is reported). The baseline, measured in the same run on the same
session, is what framework adapters did before ``session.files``: two kernelexec tools moving
4 MiB base64 chunks as JSON arguments and return values (``max_result_chars`` raised to fit).
Locally, a plain host copy into the session's directory is the ceiling.

Usage: ``.venv/bin/python benchmarks/files.py`` (about 2 min); prints a table and writes
``benchmarks/results/files.json``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernelexec as kx
from kernelexec.backends import GatewayBackend
from tests.support.gateway import Gateway

CHUNK = 4 << 20
SIZES = {"1 MiB": 1 << 20, "100 MiB": 100 << 20}
REPEATS = 3

WRITE_CHUNK = kx.Tool.from_source(
    '''
def write_chunk(path: str, data: str, append: bool) -> int:
    """Write one base64 chunk.

    Args:
        path: File name.
        data: Base64 bytes.
        append: Append instead of truncating.
    """
    import base64
    with open(path, "ab" if append else "wb") as f:
        return f.write(base64.b64decode(data))
'''
)

READ_CHUNK = kx.Tool.from_source(
    '''
def read_chunk(path: str, offset: int, size: int) -> str:
    """Read one chunk as base64.

    Args:
        path: File name.
        offset: Where to start.
        size: Most bytes to read.
    """
    import base64
    with open(path, "rb") as f:
        f.seek(offset)
        return base64.b64encode(f.read(size)).decode()
'''
)


def base64_write(s: kx.Session, path: str, data: bytes) -> None:
    for start in range(0, max(len(data), 1), CHUNK):
        piece = base64.b64encode(data[start : start + CHUNK]).decode()
        args = {"path": path, "data": piece, "append": start > 0}
        s.call_tool(WRITE_CHUNK, args).raise_for_error()


def base64_read(s: kx.Session, path: str, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        got = s.call_tool(READ_CHUNK, {"path": path, "offset": len(out), "size": CHUNK})
        got.raise_for_error()
        out += base64.b64decode(got.func_return)
    return bytes(out)


def rate(size: int, fn: Callable[[], object]) -> float:
    """Median MiB/s of ``fn`` over REPEATS runs."""
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return (size / (1 << 20)) / statistics.median(times)


def measure(s: kx.Session, where: str, host_dir: Path | None) -> list[dict[str, object]]:
    s.run_code("1")
    s.files.write("warm.bin", os.urandom(1 << 20))
    return [measure_size(s, where, label, size, host_dir) for label, size in SIZES.items()]


def measure_size(
    s: kx.Session, where: str, label: str, size: int, host_dir: Path | None
) -> dict[str, object]:
    data = os.urandom(size)
    row: dict[str, object] = {"where": where, "size": label}
    row["files_write"] = rate(size, lambda: s.files.write("f.bin", data))
    row["files_read"] = rate(size, lambda: s.files.read("f.bin"))
    assert s.files.read("f.bin") == data
    row["base64_write"] = rate(size, lambda: base64_write(s, "b.bin", data))
    row["base64_read"] = rate(size, lambda: base64_read(s, "b.bin", size))
    assert base64_read(s, "b.bin", size) == data
    if host_dir is not None:
        source = host_dir.parent / "source.bin"
        source.write_bytes(data)
        row["host_copy"] = rate(size, lambda: shutil.copyfile(source, host_dir / "c.bin"))
        source.unlink()
        (host_dir / "c.bin").unlink()
    s.files.remove("f.bin")
    s.files.remove("b.bin")
    return row


def main() -> None:
    rows = []
    with kx.KernelExecutor(isolation="none", max_result_chars=64_000_000) as ex:
        s = ex.session("bench")
        rows += measure(s, "local", Path(str(s.workdir)))
    with (
        Gateway() as gw,
        kx.KernelExecutor(
            backend=GatewayBackend(gw.url, token=gw.token), max_result_chars=64_000_000
        ) as ex,
    ):
        rows += measure(ex.session("bench"), "gateway", None)
    header = (
        f"{'where':8} {'size':8} {'files write':>12} {'files read':>11} "
        f"{'b64 write':>10} {'b64 read':>9} {'x write':>8} {'x read':>7} {'host copy':>10}"
    )
    print("MiB/s (median of 3)")
    print(header)
    for r in rows:
        w, rd = float(r["files_write"]), float(r["files_read"])  # type: ignore[arg-type]
        bw, br = float(r["base64_write"]), float(r["base64_read"])  # type: ignore[arg-type]
        r["write_ratio"], r["read_ratio"] = round(w / bw, 1), round(rd / br, 1)
        copy = f"{float(r['host_copy']):10.0f}" if "host_copy" in r else f"{'-':>10}"  # type: ignore[arg-type]
        print(
            f"{r['where']:8} {r['size']:8} {w:12.0f} {rd:11.0f} {bw:10.0f} {br:9.0f} "
            f"{r['write_ratio']:7.1f}x {r['read_ratio']:6.1f}x {copy}"
        )
    for r in rows:
        for key, value in r.items():
            if isinstance(value, float):
                r[key] = round(value, 1)
    out = Path(__file__).parent / "results" / "files.json"
    out.write_text(json.dumps({"chunk_bytes": CHUNK, "repeats": REPEATS, "rows": rows}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
