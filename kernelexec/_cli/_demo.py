"""``kernelexec demo``: a scripted, stateful multi-call agent session printed as it runs."""

from __future__ import annotations

import statistics
import sys
import textwrap
import time

from kernelexec._cli._progress import ProgressDisplay
from kernelexec._models import Execution, ToolResult
from kernelexec._sync import KernelExecutor, replay
from kernelexec._tools._tool import Tool

_TOOLS = [
    '''
    def load_orders(n: int) -> dict:
        """Load n synthetic orders into the session (kept in the kernel between calls).

        Args:
            n: How many orders to generate.
        """
        import random
        global orders
        rng = random.Random(7)
        regions = ["north", "south", "east", "west"]
        orders = [
            {"id": i, "region": rng.choice(regions), "amount": round(rng.uniform(5, 500), 2)}
            for i in range(n)
        ]
        return {"loaded": len(orders)}
    ''',
    '''
    def add_tax(rate: float) -> dict:
        """Add a taxed total to every order loaded earlier.

        Args:
            rate: Tax rate, e.g. 0.2 for 20%.
        """
        for order in orders:
            order["total"] = round(order["amount"] * (1 + rate), 2)
        return {"taxed": len(orders), "rate": rate}
    ''',
    '''
    def top_regions(k: int = 2) -> list:
        """The k regions with the highest taxed revenue.

        Args:
            k: How many regions to return.
        """
        totals = {}
        for order in orders:
            totals[order["region"]] = totals.get(order["region"], 0) + order["total"]
        best = sorted(totals.items(), key=lambda kv: -kv[1])[:k]
        return [{"region": r, "revenue": round(v, 2)} for r, v in best]
    ''',
    '''
    def refund(order_id: int) -> dict:
        """Refund one order (fails for unknown ids).

        Args:
            order_id: The order to refund.
        """
        matches = [o for o in orders if o["id"] == order_id]
        if not matches:
            raise KeyError(f"no order {order_id}")
        matches[0]["total"] = 0.0
        return {"refunded": order_id}
    ''',
]


def _say(text: str) -> None:
    print(text, flush=True)


def _show(label: str, result: Execution) -> None:
    ms = result.duration_s * 1000
    if result.ok:
        value = result.func_return if isinstance(result, ToolResult) else result.result
        _say(f"  {label:<34} ok    {ms:7.1f} ms  -> {value}")
    else:
        assert result.error is not None
        extra = " (kernel restarted)" if result.kernel_restarted else " (state kept)"
        if "state kept" in result.error.evalue:
            extra = ""
        _say(
            f"  {label:<34} ERROR {ms:7.1f} ms  -> {result.error.kind}: "
            f"{result.error.ename}: {result.error.evalue[:70]}{extra}"
        )


def run_demo(calls: int = 200, record_dir: str = "kernelexec-demo") -> int:
    """Run the demo session, recorded as a notebook in ``record_dir`` and replayed; returns the
    exit status."""
    tools = {t.name: t for t in (Tool.from_source(textwrap.dedent(s)) for s in _TOOLS)}
    _say("kernelexec demo: one agent, one persistent kernel, state kept across tool calls\n")
    start = time.monotonic()
    agent_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    display = ProgressDisplay()
    with KernelExecutor(default_timeout=30, interrupt_grace=2.0, record_dir=record_dir) as ex:
        agent = ex.session(agent_id)
        with display.step("starting a kernel"):
            first = agent.call_tool(tools["load_orders"], {"n": 10_000})
        _show("load_orders(n=10000)", first)
        _say(f"  (first call includes starting the kernel: {time.monotonic() - start:.2f} s)")
        _show("add_tax(rate=0.2)", agent.call_tool(tools["add_tax"], {"rate": 0.2}))
        _show("top_regions(k=2)", agent.call_tool(tools["top_regions"], {"k": 2}))
        bad = agent.call_tool(tools["add_tax"], {"rate": "high"})
        _show("add_tax(rate='high')  bad args", bad)
        missing = agent.call_tool(tools["refund"], {"order_id": 99999})
        _show("refund(order_id=99999)  raises", missing)
        _show("refund(order_id=3)", agent.call_tool(tools["refund"], {"order_id": 3}))
        _show(
            "run_code: sleep 60 s, timeout 1 s",
            agent.run_code("import time\ntime.sleep(60)", timeout=1.0),
        )
        _show("run_code: len(orders) after timeout", agent.run_code("len(orders)"))
        _show("top_regions(k=4)", agent.call_tool(tools["top_regions"], {"k": 4}))
        notebook = agent.record_path
        assert notebook is not None  # the executor records into record_dir
    _say(f"\nrecorded the session as a notebook: {notebook}")
    _say(f"  open it in Jupyter, or re-run it: kernelexec replay {notebook}")
    with display.step("replaying the recording in a fresh kernel"):
        report = replay(notebook, default_timeout=30)
    verdict = "no differences" if report.ok else f"{len(report.differences)} cell(s) differ"
    _say(f"  replayed {report.cells_run} cells in a fresh kernel: {verdict}")

    with KernelExecutor(prewarm=1) as ex:
        ex.warm_up()
        agent = ex.session("timing")
        agent.call_tool(tools["load_orders"], {"n": 10_000})
        agent.call_tool(tools["add_tax"], {"rate": 0.2})
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            result = agent.call_tool(tools["top_regions"], {"k": 1})
            times.append(time.perf_counter() - t0)
            if not result.ok:
                _say(f"warm call failed: {result.error}")
                return 1
        times.sort()
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        _say(
            f"\n{calls} warm calls of top_regions over 10,000 orders: "
            f"median {statistics.median(times) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"
        )
    _say(f"all kernels shut down; total {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo())
