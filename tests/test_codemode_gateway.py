"""Code mode on the Kernel Gateway: host calls travel over the kernel's websocket (an iopub
message there, the answer on the control channel), in both framings."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import kernelexec as kx
from kernelexec.backends import GatewayBackend
from tests.support.gateway import Gateway

pytest.importorskip("kernel_gateway", reason="jupyter-kernel-gateway is not installed")
pytest.importorskip("websockets", reason="websockets is not installed (kernelexec[gateway])")


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    with Gateway() as gw:
        yield gw


def lookup(key: str, agent_id: str) -> dict[str, Any]:
    """Look ``key`` up on the host."""
    return {"key": key, "agent": agent_id, "big": 2**200}


@pytest.mark.parametrize("offer_v1", [True, False], ids=["v1", "json"])
def test_host_calls_over_the_gateway(gateway: Gateway, offer_v1: bool) -> None:
    barrier = asyncio.Barrier(3)

    async def meet(i: int) -> int:
        """Returns once three calls are in flight together."""
        async with barrier:
            return i

    backend = GatewayBackend(gateway.url, token=gateway.token, offer_v1=offer_v1)
    with kx.KernelExecutor(backend=backend, default_timeout=30) as ex:
        s = ex.session("gw-codemode")
        s.expose(lookup)
        s.expose(meet, timeout=20)
        out = s.run_code(
            "import asyncio, inspect\nfrom tools import lookup, meet\n"
            "print(inspect.signature(lookup))\n"
            "r = lookup('k')\nprint(r['agent'], r['big'] == 2**200)\n"
            "print(await asyncio.gather(*(meet(i) for i in range(3))))\n"
        )
        assert out.ok, (out.error, out.stdout)
        assert out.stdout.splitlines() == [
            "(key: str) -> dict[str, Any]",
            "gw-codemode True",
            "[0, 1, 2]",
        ]
        assert [c.outcome for c in out.host_calls] == ["ok"] * 4
        s.restart()  # a fresh kernel gets the module again
        again = s.run_code("from tools import lookup\nprint(lookup('z')['key'])")
        assert again.ok and again.stdout == "z\n"
    assert gateway.kernels() == []
