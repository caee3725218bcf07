"""Virtual-environment benchmark: building (uv vs pip), reuse, and the first call in a venv.

Prints a table and writes JSON (default ``benchmarks/results/envs.json``). Each build uses a new
wheel made here (so a new fingerprint), i.e. a real cold build of the venv; "warm cache" means
the installer's own download cache already holds ipykernel and its dependencies.

    python benchmarks/envs.py            # about a minute and a half
    python benchmarks/envs.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernelexec as kx
from tests.support.wheels import make_wheel

TOOL = '''
def version(name: str) -> str:
    """The VERSION of a package.

    Args:
        name: The package.
    """
    import importlib
    return importlib.import_module(name).VERSION
'''


ONE = 'def one() -> int:\n    """One."""\n    return 1\n'


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheels = root / "wheels"
        self.wheels.mkdir()
        self.count = 0

    def new_env(self) -> tuple[kx.VenvEnv, str]:
        self.count += 1
        name = f"kxbench{self.count}"
        wheel = make_wheel(self.wheels, name, "1.0", "VERSION = '1.0'\n")
        return kx.VenvEnv(requirements=[str(wheel)]), name

    async def build(self, installer: str, cache: Path, env_vars: dict[str, str]) -> float:
        env, _ = self.new_env()
        saved = {k: os.environ.get(k) for k in env_vars}
        os.environ.update(env_vars)
        try:
            builder = kx.EnvBuilder(cache, installer)  # type: ignore[arg-type]
            start = time.perf_counter()
            built = await builder.ensure(env)
            assert built.built
            return time.perf_counter() - start
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def row(name: str, samples: list[float]) -> dict[str, Any]:
    return {
        "name": name,
        "n": len(samples),
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
    }


async def first_call(
    env: kx.VenvEnv | kx.LocalEnv, name: str, cache: Path, prewarm: int, repeats: int
) -> list[float]:
    """Seconds from asking to having the result of a new session's first tool call."""
    tool = kx.Tool.from_source(TOOL if name else ONE)
    args = {"name": name} if name else {}
    samples = []
    for _ in range(repeats):
        async with kx.AsyncKernelExecutor(env=env, cache_dir=cache, prewarm=prewarm) as ex:
            if prewarm:
                await ex.warm_up()
            start = time.perf_counter()
            result = await ex.call_tool(tool, args)
            samples.append(time.perf_counter() - start)
            assert result.ok, result.error
    return samples


async def main(quick: bool, out: Path) -> None:
    n = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="kxbench-envs-") as tmp:
        bench = Bench(Path(tmp))
        cache = Path(tmp) / "cache"
        rows = []
        # Warm the installers' download caches once (not measured).
        await bench.build("uv", cache, {})
        rows.append(
            row("build, uv, warm uv cache", [await bench.build("uv", cache, {}) for _ in range(n)])
        )
        cold_uv = str(Path(tmp) / "uv-cache")
        rows.append(
            row(
                "build, uv, empty uv cache (downloads)",
                [
                    await bench.build("uv", cache, {"UV_CACHE_DIR": cold_uv + str(i)})
                    for i in range(1)
                ],
            )
        )
        rows.append(
            row(
                "build, venv + pip, warm pip cache",
                [await bench.build("pip", cache, {}) for _ in range(1 if quick else 2)],
            )
        )
        rows.append(
            row(
                "build, venv + pip, no pip cache",
                [await bench.build("pip", cache, {"PIP_NO_CACHE_DIR": "1"}) for _ in range(1)],
            )
        )

        env, name = bench.new_env()
        builder = kx.EnvBuilder(cache)
        await builder.ensure(env)
        reuse = []
        for _ in range(20):
            start = time.perf_counter()
            built = await builder.ensure(env)
            reuse.append(time.perf_counter() - start)
            assert not built.built
        rows.append(row("warm reuse of a built venv (ensure)", reuse))
        rows.append(
            row(
                "first call in a built venv, no prewarm",
                await first_call(env, name, cache, 0, n + 2),
            )
        )
        rows.append(
            row(
                "first call in a built venv, prewarm=1",
                await first_call(env, name, cache, 1, n + 2),
            )
        )
        local = kx.LocalEnv()
        rows.append(
            row(
                "first call, host interpreter, no prewarm",
                await first_call(local, "", cache, 0, n + 2),
            )
        )
        rows.append(
            row(
                "first call, host interpreter, prewarm=1",
                await first_call(local, "", cache, 1, n + 2),
            )
        )

    print(f"{'row':44} {'n':>3} {'median':>9} {'min':>9} {'max':>9}")
    for r in rows:
        print(
            f"{r['name']:44} {r['n']:>3} {r['median_s'] * 1000:>7.1f}ms "
            f"{r['min_s'] * 1000:>7.1f}ms {r['max_s'] * 1000:>7.1f}ms"
        )
    uv, pip = rows[0]["median_s"], rows[2]["median_s"]
    print(f"\nuv builds {pip / uv:.1f}x faster than venv + pip (warm caches, same run)")
    _write(
        out,
        json.dumps(
            {
                "machine": platform.platform(),
                "python": sys.version.split()[0],
                "cpus": os.cpu_count(),
                "rows": rows,
                "uv_vs_pip_speedup": pip / uv,
            },
            indent=2,
        )
        + "\n",
    )


def _write(out: Path, text: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "envs.json")
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.out))
