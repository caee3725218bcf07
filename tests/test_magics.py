"""The IPython extension (``%load_ext kernelexec``) in a real kernel: ``%%tool`` and
``%tool_call`` start a sandbox kernel of their own, and ``%unload_ext`` shuts it down."""

from __future__ import annotations

import kernelexec as kx

DOUBLE = '''%%tool
def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x
'''

# The kernel's own descendants that kernelexec names (``tests/support/procs.py``), zombies
# aside; its namespace helper lives as long as the process that started it, by design.
SANDBOX = (
    "import psutil\n"
    "sorted(p.name() for p in psutil.Process().children(recursive=True)\n"
    "       if p.status() != psutil.STATUS_ZOMBIE and p.name() != 'kx-ns-helper')"
)


def test_unload_ext_shuts_the_sandbox_kernel_down() -> None:
    # isolation "none": the kernel imports kernelexec from this environment, as a notebook does.
    with kx.KernelExecutor(isolation="none") as ex:
        s = ex.session("magics")
        assert s.run_code("%load_ext kernelexec").ok
        defined = s.run_code(DOUBLE)
        assert defined.ok, defined.error
        assert '"name": "double"' in defined.stdout
        called = s.run_code('r = %tool_call double {"x": 21}\nr.func_return')
        assert called.result == "42", called.error
        assert "kx-kernel" in (s.run_code(SANDBOX).result or "")
        assert s.run_code("%unload_ext kernelexec").ok
        s.run_code(
            "left = [p for p in psutil.Process().children(recursive=True)"
            " if p.name() != 'kx-ns-helper']\n"
            "psutil.wait_procs(left, timeout=30)"
        )
        gone = s.run_code(SANDBOX)
        assert gone.result == "[]", gone.error
