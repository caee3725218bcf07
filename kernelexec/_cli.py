"""The ``kernelexec`` command line, a thin layer over the blocking API.

Exit codes: 0 the run succeeded, 1 the run failed (its error is printed or in the JSON),
2 bad usage (unknown option, unreadable file, invalid JSON arguments). With ``--json`` stdout holds
only the JSON document; progress and diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kernelexec._exceptions import KernelExecError
from kernelexec._models import Execution
from kernelexec._sync import KernelExecutor
from kernelexec._tools import Tool

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad command-line input; exit status 2."""


def _executor_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", default="default", help="agent (session) id")
    p.add_argument("--timeout", type=float, default=None, help="seconds before interrupting")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelexec", description="Run agent tools and code in persistent Jupyter kernels."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="call a tool defined in a Python file")
    run.add_argument("file", help="Python file defining the tool")
    run.add_argument("--args", default="{}", help="arguments as a JSON object")
    run.add_argument("--name", default=None, help="function to call (default: the only one)")
    _executor_options(run)

    exe = sub.add_parser("exec", help="run code (an argument, or - for stdin)")
    exe.add_argument("code")
    _executor_options(exe)

    schema = sub.add_parser("schema", help="print a tool's JSON schema")
    schema.add_argument("file")
    schema.add_argument("--name", default=None)

    repl = sub.add_parser("repl", help="an interactive prompt on a persistent kernel")
    repl.add_argument("--agent", default="default")

    demo = sub.add_parser("demo", help="a scripted stateful agent session")
    demo.add_argument("--calls", type=int, default=200, help="warm calls to time at the end")
    return parser


def _load_tool(path: str, name: str | None) -> Tool:
    try:
        source = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return Tool.from_source(source, name=name)
    except KernelExecError as exc:
        raise UsageError(f"{path}: {exc}") from None


def _print_result(result: Execution, as_json: bool) -> int:
    if as_json:
        print(result.model_dump_json())
    else:
        if result.stdout:
            sys.stdout.write(result.stdout)
        if result.stderr:
            sys.stderr.write(result.stderr)
        value = getattr(result, "func_return", None)
        if value is not None:
            print(json.dumps(value, ensure_ascii=False, indent=2))
        elif result.result is not None:
            print(result.result)
        if result.error is not None:
            print(
                f"error ({result.error.kind}): {result.error.ename}: {result.error.evalue}",
                file=sys.stderr,
            )
    return EXIT_OK if result.ok else EXIT_FAILED


def _cmd_run(ns: argparse.Namespace) -> int:
    tool = _load_tool(ns.file, ns.name)
    try:
        args = json.loads(ns.args)
    except ValueError as exc:
        raise UsageError(f"--args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise UsageError("--args must be a JSON object")
    with KernelExecutor() as ex:
        result = ex.call_tool(tool, args, agent_id=ns.agent, timeout=ns.timeout)
    return _print_result(result, ns.json)


def _cmd_exec(ns: argparse.Namespace) -> int:
    code = sys.stdin.read() if ns.code == "-" else ns.code
    with KernelExecutor() as ex:
        result = ex.run_code(code, agent_id=ns.agent, timeout=ns.timeout)
    return _print_result(result, ns.json)


def _cmd_schema(ns: argparse.Namespace) -> int:
    print(json.dumps(_load_tool(ns.file, ns.name).json_schema, indent=2, ensure_ascii=False))
    return EXIT_OK


def _cmd_repl(ns: argparse.Namespace) -> int:
    from IPython.core.inputtransformer2 import TransformerManager
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    completeness = TransformerManager()  # type: ignore[no-untyped-call]
    prompt: PromptSession[str] = PromptSession(history=InMemoryHistory())
    print("kernelexec repl: a persistent kernel; Ctrl-D to quit.", file=sys.stderr)
    with KernelExecutor() as ex:
        session = ex.session(ns.agent)
        while True:
            lines: list[str] = []
            try:
                lines.append(prompt.prompt(">>> "))
                status, indent = completeness.check_complete("\n".join(lines) + "\n")
                while status == "incomplete":
                    lines.append(prompt.prompt("... ", default=" " * (indent or 0)))
                    if not lines[-1].strip():
                        break
                    status, indent = completeness.check_complete("\n".join(lines) + "\n")
            except KeyboardInterrupt:
                continue
            except EOFError:
                return EXIT_OK
            code = "\n".join(lines)
            if code.strip():
                _print_result(session.run_code(code), False)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kernelexec`` command; returns the exit status."""
    ns = _parser().parse_args(argv)
    handlers: dict[str, Any] = {
        "run": _cmd_run,
        "exec": _cmd_exec,
        "schema": _cmd_schema,
        "repl": _cmd_repl,
    }
    try:
        if ns.command == "demo":
            from kernelexec._demo import run_demo

            return run_demo(calls=ns.calls)
        return int(handlers[ns.command](ns))
    except UsageError as exc:
        print(f"kernelexec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KernelExecError as exc:
        print(f"kernelexec: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def entry() -> None:
    """Console-script wrapper that exits with :func:`main`'s status."""
    sys.exit(main())
