"""Durable sessions on the gateway backend, against two real jupyter-kernel-gateway processes on
127.0.0.1: an agent hibernated by an executor on one gateway resumes in another executor on
another gateway (its own directory tree), its checkpoint carried through the kernel protocol."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec.backends._gateway import GatewayBackend
from tests.gateway import Gateway

pytest.importorskip("kernel_gateway", reason="jupyter-kernel-gateway is not installed")
pytest.importorskip("websockets", reason="websockets is not installed (kernelexec[gateway])")


@pytest.fixture(scope="module")
def gateways() -> Iterator[tuple[Gateway, Gateway]]:
    with Gateway() as one, Gateway() as two:
        yield one, two


@pytest.fixture(autouse=True)
def no_gateway_leaks(gateways: tuple[Gateway, Gateway]) -> Iterator[None]:
    yield
    for gw in gateways:
        assert gw.kernels() == [], "kernels left running on a gateway"


def backend(gw: Gateway) -> GatewayBackend:
    return GatewayBackend(gw.url, token=gw.token)


def test_agent_hibernated_on_one_gateway_resumes_on_another(
    gateways: tuple[Gateway, Gateway], tmp_path: Path
) -> None:
    one, two = gateways
    state = tmp_path / "state"
    with kx.KernelExecutor(backend=backend(one), state_dir=state, default_timeout=60) as ex:
        r = ex.run_code(
            "big = bytes(range(256)) * 1024\n"  # 256 KiB: a raw record of its own
            "nums = [1, 2, 3]\n"
            "def twice(x):\n    return 2 * x\n"
            "open('notes.txt', 'w').write('kept on gateway one')\n"
            "import os; os.makedirs('sub', exist_ok=True)\n"
            "open('sub/b.bin', 'wb').write(b'\\x00\\x01' * 5000)",
            agent_id="a",
        )
        assert r.error is None, r.error
        saved = ex.session("a").hibernate()
        assert saved.saved == ["big", "nums", "os", "twice"], saved
        assert saved.not_saved == {}
    # The first gateway's copy of the directory is not where the second one looks.
    assert (one.work / "kernelexec" / "a" / "notes.txt").read_text() == "kept on gateway one"
    assert not (two.work / "kernelexec" / "a").exists()

    with kx.KernelExecutor(backend=backend(two), state_dir=state, default_timeout=60) as ex:
        back = ex.run_code(
            "import os\n"
            "print(twice(nums[2]), big == bytes(range(256)) * 1024, open('notes.txt').read(),"
            " len(open('sub/b.bin', 'rb').read()), os.getcwd())",
            agent_id="a",
        )
        assert back.error is None, back.error
        cwd = two.work / "kernelexec" / "a"
        assert back.stdout == f"6 True kept on gateway one 10000 {cwd}\n"
        assert back.restored is not None
        assert back.restored.names == ["big", "nums", "os", "twice"]
        assert back.restored.not_restored == {} and back.restored.problems == []
        assert back.lost_variables == []
        assert back.restored.bytes > 256 * 1024
        # The kernel's staging directory is gone; the files are the second gateway's now.
        assert sorted(p.name for p in cwd.iterdir()) == ["notes.txt", "sub"]


def test_checkpoint_over_the_limit_is_refused_as_locally(
    gateways: tuple[Gateway, Gateway], tmp_path: Path
) -> None:
    one, _ = gateways
    state = tmp_path / "state"
    with kx.KernelExecutor(
        backend=backend(one), state_dir=state, max_checkpoint_bytes=100_000, default_timeout=60
    ) as ex:
        ex.run_code("blob = b'x' * 200_000", agent_id="a")
        with pytest.raises(kx.CheckpointTooLargeError, match="blob") as caught:
            ex.session("a").hibernate()
        assert "max_checkpoint_bytes=100000" in str(caught.value)
        # The kernel and its state are kept, as locally.
        assert ex.run_code("print(len(blob))", agent_id="a").stdout == "200000\n"
        # Files past the limit are refused the same way (the variables alone fit).
        ex.run_code("del blob; open('big.bin', 'wb').write(b'y' * 150_000)", agent_id="a")
        with pytest.raises(kx.CheckpointTooLargeError, match="big.bin"):
            ex.session("a").hibernate()
    assert not any((state / "agents").glob("*/manifest.json"))
    assert not any((state / "staging").glob("*")) if (state / "staging").exists() else True
