"""Durable sessions on the gateway backend, against two real jupyter-kernel-gateway processes on
127.0.0.1: an agent hibernated by an executor on one gateway resumes in another executor on
another gateway (its own directory tree), its checkpoint carried through the kernel protocol."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kernelexec as kx
from kernelexec.backends._gateway import GatewayBackend
from tests.support.gateway import Gateway

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
            "edge = b'e' * ((2 << 20) + 1)\n"  # one byte past a transfer chunk
            "nums = [1, 2, 3]\n"
            "def twice(x):\n    return 2 * x\n"
            "open('notes.txt', 'w').write('kept on gateway one')\n"
            "import os; os.makedirs('sub', exist_ok=True)\n"
            "open('sub/b.bin', 'wb').write(b'\\x00\\x01' * 5000)",
            agent_id="a",
        )
        assert r.error is None, r.error
        saved = ex.session("a").hibernate()
        assert saved.saved == ["big", "edge", "nums", "os", "twice"], saved
        assert saved.not_saved == {}
    # The first gateway's copy of the directory is not where the second one looks.
    assert (one.work / "kernelexec" / "a" / "notes.txt").read_text() == "kept on gateway one"
    assert not (two.work / "kernelexec" / "a").exists()

    with kx.KernelExecutor(backend=backend(two), state_dir=state, default_timeout=60) as ex:
        back = ex.run_code(
            "import os\n"
            "same = big == bytes(range(256)) * 1024 and edge == b'e' * ((2 << 20) + 1)\n"
            "print(twice(nums[2]), same,"
            " open('notes.txt').read(),"
            " len(open('sub/b.bin', 'rb').read()), os.getcwd())",
            agent_id="a",
        )
        assert back.error is None, back.error
        cwd = two.work / "kernelexec" / "a"
        assert back.stdout == f"6 True kept on gateway one 10000 {cwd}\n"
        assert back.restored is not None
        assert back.restored.names == ["big", "edge", "nums", "os", "twice"]
        assert back.restored.not_restored == {} and back.restored.problems == []
        assert back.lost_variables == []
        assert back.restored.bytes > 256 * 1024
        # The kernel's staging directory is gone; the files are the second gateway's now.
        assert sorted(p.name for p in cwd.iterdir()) == ["notes.txt", "sub"]
        ex.run_code(
            "nums.append(4)\nopen('notes.txt', 'w').write('changed on gateway two')\n"
            "os.remove('sub/b.bin')",
            agent_id="a",
        ).raise_for_error()
    # Closed: saved on the way out. Back on gateway one, whose directory still holds the older
    # files: they are replaced by the checkpoint's.
    with kx.KernelExecutor(backend=backend(one), state_dir=state, default_timeout=60) as ex:
        again = ex.run_code(
            "print(nums, open('notes.txt').read(), sorted(os.listdir('sub')))", agent_id="a"
        )
        assert again.error is None, again.error
        assert again.stdout == "[1, 2, 3, 4] changed on gateway two []\n"
        assert again.lost_variables == []
        ex.delete_state("a")


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
        with pytest.raises(kx.CheckpointTooLargeError, match=r"big\.bin"):
            ex.session("a").hibernate()
    assert not any((state / "agents").glob("*/manifest.json"))
    assert list((state / "staging").iterdir()) == []  # the host's fetched records: removed


def test_after_call_checkpoints_are_refused_with_a_reason(
    gateways: tuple[Gateway, Gateway], tmp_path: Path
) -> None:
    with pytest.raises(kx.ConfigError, match=r"after_call.*on_evict"):
        kx.KernelExecutor(
            backend=backend(gateways[0]), state_dir=tmp_path / "s", checkpoint="after_call"
        )


# -- what a kernel announces is checked, never trusted ------------------------------------------

_FORGE_RECORD = (
    "import os, sys\n"
    "st = sys.modules['__kernelexec_state__']\n"
    "def forged(staging, *a, **k):\n"
    "    os.makedirs(staging, exist_ok=True)\n"
    "    with open(os.path.join(staging, 'r' + 'c' * 24 + '.rec'), 'wb') as f:\n"
    "        f.truncate(2 << 30)\n"
    "    return st._Answer({'gen': 1, 'records': [{'kind': 'raw', 'names': ['big'],\n"
    "        'file': NAME, 'size': SIZE, 'crc': 0}], 'unsaved': {}, 'environ': {}})\n"
    "st.save = forged\n"
)
_GOOD = "'r' + 'c' * 24 + '.rec'"


@pytest.mark.parametrize(
    ("name", "size"),
    [
        (_GOOD, "-1"),
        (_GOOD, str(2 << 30)),  # the sparse file's real size, past the bound
        (_GOOD, "'2147483648'"),
        (_GOOD, "1000"),  # smaller than the file: the kernel would send more
        ("'../../r' + 'c' * 24 + '.rec'", "1"),
        ("'manifest.json'", "1"),
    ],
)
def test_a_forged_record_is_refused_and_nothing_is_saved(
    gateways: tuple[Gateway, Gateway], tmp_path: Path, name: str, size: str
) -> None:
    state = tmp_path / "state"
    with kx.KernelExecutor(
        backend=backend(gateways[0]), state_dir=state, max_checkpoint_bytes=64 << 20
    ) as ex:
        s = ex.session("forger")
        s.run_code("x = 1").raise_for_error()
        s.hibernate()  # installs the kernel side of durable state
        s.run_code(_FORGE_RECORD.replace("NAME", name).replace("SIZE", size)).raise_for_error()
        with pytest.raises(kx.StateError):
            s.hibernate()
        held = sum(p.stat().st_blocks * 512 for p in state.rglob("*") if p.is_file())
        assert held < 1 << 20
        assert s.run_code("print(x)").stdout == "1\n"  # the kernel and its state are kept
        ex.delete_state("forger")


_FORGE_BYTES = (
    "import sys\n"
    "t = sys.modules['__kernelexec_transfer__']\n"
    "real = t._read\n"
    "def forged(staging, name, offset, size):\n"
    "    got = real(staging, name, offset, size)\n"
    "    if got['data']:\n"
    "        import base64\n"
    "        got['data'] = base64.b64encode(b'z' * len(base64.b64decode(got['data']))).decode()\n"
    "    return got\n"
    "t._read = forged\n"
    "t._OPS['read'] = forged\n"
)


def test_bytes_changed_on_the_way_are_refused_by_their_crc(
    gateways: tuple[Gateway, Gateway], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    with kx.KernelExecutor(backend=backend(gateways[1]), state_dir=state) as ex:
        s = ex.session("a")
        s.run_code("x = 1").raise_for_error()
        first = s.hibernate()  # a good checkpoint; the transfer helper is in the next kernel
        assert first.saved == ["x"]
        s.run_code("x = 2").raise_for_error()
        s.hibernate()
        s.run_code(_FORGE_BYTES + "x = 3").raise_for_error()
        with pytest.raises(kx.StateError, match="CRC"):
            s.hibernate()
        assert s.run_code("print(x)").stdout == "3\n"
        ex.delete_state("a")


def test_a_live_agent_is_handed_over_between_executors_on_two_gateways(
    gateways: tuple[Gateway, Gateway], tmp_path: Path
) -> None:
    one, two = gateways
    state = tmp_path / "state"
    with (
        kx.KernelExecutor(backend=backend(one), state_dir=state, default_timeout=60) as first,
        kx.KernelExecutor(backend=backend(two), state_dir=state, default_timeout=60) as second,
    ):
        first.run_code("x = 1\nopen('log.txt', 'w').write('1')", agent_id="a").raise_for_error()
        # The first executor holds the agent, idle: asked, it hibernates it and lets it go.
        moved = second.run_code("x += 1\nopen('log.txt', 'a').write('2')\nprint(x)", agent_id="a")
        assert moved.stdout == "2\n" and moved.restored is not None
        assert moved.restored.names == ["x"] and moved.lost_variables == []
        back = first.run_code("x += 1\nprint(x, open('log.txt').read())", agent_id="a")
        assert back.stdout == "3 12\n" and back.restored is not None
