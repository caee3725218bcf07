"""The ``kernelexec`` command line, a thin layer over the blocking API.

Exit codes: 0 the run succeeded, 1 the run failed (its error is printed or in the JSON),
2 bad usage (unknown option, unreadable file, invalid JSON arguments). With ``--json`` stdout holds
only the JSON document; progress and diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kernelexec._cli._attach import add_parsers, cmd_attach, cmd_sessions
from kernelexec._exceptions import ConfigError, EnvSetupError, KernelExecError

if TYPE_CHECKING:
    from kernelexec._envs._envs import VenvEnv
    from kernelexec._models import Execution
    from kernelexec._sync import KernelExecutor
    from kernelexec._tools._tool import Tool

# The library is imported inside each command, not here: `kernelexec --help` and a mistyped
# flag answer at once instead of after the library's 1.4 s of imports.

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad command-line input; exit status 2."""


_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_UNKNOWN = re.compile(r"unrecognized arguments: (.*)")
_BAD_CHOICE = re.compile(r"invalid choice: '([^']*)'")


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a mistyped flag or command."""

    def error(self, message: str) -> NoReturn:
        super().error(message + _suggestion(self, message))


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """The closest known flag or command to what was mistyped, as a hint (or "")."""
    unknown = _UNKNOWN.search(message)
    if unknown:
        words = [w.split("=")[0] for w in unknown.group(1).split() if w.startswith("-")]
        known = _option_strings(parser)
    else:
        choice = _BAD_CHOICE.search(message)
        words = [choice.group(1)] if choice else []
        known = re.findall(r"'([^']*)'", message.split("choose from", 1)[-1])
    hints = [m[0] for w in words if (m := difflib.get_close_matches(w, known, n=1, cutoff=0.6))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` and of its subcommands, recursively."""
    found: list[str] = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return sorted(set(found))


def _seconds(text: str) -> float:
    """``--timeout``: a finite positive number of seconds (argparse exits 2 otherwise)."""
    from kernelexec._config import valid_timeout

    try:
        return valid_timeout(float(text))
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(
            f"must be a finite positive number of seconds, got {text!r}"
        ) from None


def _executor_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", default="default", help="agent (session) id")
    p.add_argument("--timeout", type=_seconds, default=None, help="seconds before interrupting")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument(
        "--record", metavar="DIR", default=None, help="record the run in DIR/AGENT.ipynb"
    )
    _env_options(p)


def _env_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--requirement",
        "-r",
        action="append",
        default=None,
        metavar="REQ",
        help="run in a venv with this requirement (repeatable)",
    )
    p.add_argument("--python", default=None, help="interpreter the venv is built from")
    p.add_argument("--cache-dir", default=None, help="where venvs are built")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kernelexec", description="Run agent tools and code in persistent Jupyter kernels."
    )
    parser.add_argument("--version", action="version", version=f"kernelexec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="call a tool defined in a Python file")
    run.add_argument("file", help="Python file defining the tool")
    run.add_argument("--args", default="{}", help="arguments as a JSON object")
    run.add_argument("--name", default=None, help="function to call (default: the only one)")
    _executor_options(run)

    exe = sub.add_parser("exec", help="run code (an argument, or - for stdin)")
    exe.add_argument("code", help="the code to run, or - to read it from stdin")
    _executor_options(exe)

    schema = sub.add_parser("schema", help="print a tool's JSON schema")
    schema.add_argument("file", help="Python file defining the tool")
    schema.add_argument("--name", default=None, help="function to describe (default: the only one)")

    repl = sub.add_parser("repl", help="an interactive prompt on a persistent kernel")
    repl.add_argument("--agent", default="default", help="agent (session) id")
    repl.add_argument("--record", metavar="DIR", default=None, help="record to DIR/AGENT.ipynb")
    _env_options(repl)

    replay = sub.add_parser("replay", help="re-run a recorded notebook and report differences")
    replay.add_argument("notebook", help="the recorded notebook (.ipynb)")
    replay.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="seconds per cell: for unrecorded ones (default 60), and the cap on recorded ones",
    )
    replay.add_argument("--json", action="store_true", help="print the report as JSON only")
    replay.add_argument(
        "--build-requirements",
        action="store_true",
        help="build the recorded venv's requirements when they are not in the cache: a "
        "notebook is untrusted, and building runs its requirements' own code (under the "
        "replay's isolation); without this flag such a replay stops before anything runs",
    )
    replay.add_argument(
        "--isolation",
        choices=("none", "process", "bwrap"),
        default=None,
        help="isolation of the replay's kernel (default: the backend's, 'process' locally)",
    )

    tools = sub.add_parser("tools", help="tools authored in notebooks")
    tools_sub = tools.add_subparsers(dest="tools_command", required=True)
    export = tools_sub.add_parser("export", help="print the tools of cells tagged `tool` as JSON")
    export.add_argument("notebook", help="the notebook (.ipynb) holding the tool cells")

    env = sub.add_parser("env", help="the cached virtual environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    env_list = env_sub.add_parser("list", help="list the cached venvs")
    env_list.add_argument("--cache-dir", default=None, help="where venvs are built")
    env_list.add_argument("--json", action="store_true", help="print the list as JSON only")
    env_prune = env_sub.add_parser("prune", help="remove cached venvs")
    env_prune.add_argument(
        "--older-than",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="remove venvs unused for DAYS days (default 30)",
    )
    env_prune.add_argument("--all", action="store_true", help="remove every cached venv")
    env_prune.add_argument("--cache-dir", default=None, help="where venvs are built")
    env_prune.add_argument("--json", action="store_true", help="print what was removed as JSON")
    env_build = env_sub.add_parser("build", help="build (or reuse) the venv for requirements")
    env_build.add_argument(
        "requirements", nargs="*", metavar="REQ", help="requirements (pip's syntax)"
    )
    env_build.add_argument("--python", default=None, help="interpreter the venv is built from")
    env_build.add_argument(
        "--installer",
        choices=["auto", "uv", "pip"],
        default="auto",
        help="what installs the requirements (auto: uv where found, else pip)",
    )
    env_build.add_argument("--cache-dir", default=None, help="where venvs are built")
    env_build.add_argument("--json", action="store_true", help="print the venv as JSON only")

    mcp = sub.add_parser("mcp", help="serve kernels to MCP clients (stdio or streamable HTTP)")
    mcp.add_argument(
        "--tools",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE.py|NOTEBOOK",
        help="expose a file's public functions, or a notebook's `tool` cells, as MCP tools",
    )
    mcp.add_argument(
        "--transport",
        choices=["stdio", "http"],
        default="stdio",
        help="stdio (one client, the default) or streamable HTTP",
    )
    mcp.add_argument("--host", default="127.0.0.1", help="HTTP: address to bind")
    mcp.add_argument("--port", type=int, default=8000, help="HTTP: port (0: any free port)")
    mcp.add_argument(
        "--token",
        default=None,
        help="HTTP: bearer token (default: $KERNELEXEC_MCP_TOKEN, else "
        "a generated one, printed at start)",
    )
    mcp.add_argument("--record", metavar="DIR", default=None, help="record sessions in DIR")
    mcp.add_argument("--isolation", metavar="LEVEL", default=None, help="kernels' isolation level")
    mcp.add_argument(
        "--requirement",
        "-r",
        action="append",
        default=[],
        metavar="REQ",
        help="run the kernels in a venv with this requirement (repeatable)",
    )
    mcp.add_argument("--timeout", type=float, default=None, help="default seconds per run")
    mcp.add_argument(
        "--upstream",
        metavar="NAME=COMMAND",
        action="append",
        default=[],
        help="another MCP server (stdio command) whose tools code calls as tools.NAME.<tool>",
    )
    mcp.add_argument(
        "--upstream-env",
        metavar="VAR",
        action="append",
        default=[],
        help="hand the variable VAR of this server's environment to every upstream "
        "(repeatable; for secrets, which a command line would show to kernels)",
    )
    mcp.add_argument(
        "--idle-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="HTTP: end an MCP session idle for S seconds and shut its kernels down (default 1800)",
    )

    demo = sub.add_parser("demo", help="a scripted stateful agent session")
    demo.add_argument("--calls", type=int, default=200, help="warm calls to time at the end")
    demo.add_argument(
        "--record", metavar="DIR", default="kernelexec-demo", help="where the notebook goes"
    )
    add_parsers(sub)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kernelexec")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def _load_tool(path: str, name: str | None) -> Tool:
    from kernelexec._tools._tool import Tool

    try:
        source = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return Tool.from_source(source, name=name)
    except KernelExecError as exc:
        # The library's advice names its keyword; on the command line it is a flag.
        message = str(exc).replace("pass name=", "pass --name NAME")
        raise UsageError(f"{path}: {message}") from None


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
            _print_error(result)
    return EXIT_OK if result.ok else EXIT_FAILED


def _print_error(result: Execution) -> None:
    """The error's traceback as the kernel sent it (colours kept on a terminal), then a summary."""
    error = result.error
    assert error is not None
    colour = sys.stderr.isatty()
    for line in error.traceback:
        print(line if colour else _CSI.sub("", line), file=sys.stderr)
    print(f"error ({error.kind}): {error.ename}: {error.evalue}", file=sys.stderr)


def _cmd_run(ns: argparse.Namespace) -> int:
    tool = _load_tool(ns.file, ns.name)
    try:
        args = json.loads(ns.args)
    except ValueError as exc:
        raise UsageError(f"--args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise UsageError("--args must be a JSON object")
    from kernelexec._sync import KernelExecutor

    config = _record_config(ns)
    with KernelExecutor(**config) as ex, config["on_progress"].step("running (kernel start)"):
        result = ex.call_tool(tool, args, agent_id=ns.agent, timeout=ns.timeout)
        _report_recording(ex, ns)
    return _print_result(result, ns.json)


def _cmd_exec(ns: argparse.Namespace) -> int:
    from kernelexec._sync import KernelExecutor

    code = sys.stdin.read() if ns.code == "-" else ns.code
    config = _record_config(ns)
    with KernelExecutor(**config) as ex, config["on_progress"].step("running (kernel start)"):
        result = ex.run_code(code, agent_id=ns.agent, timeout=ns.timeout)
        _report_recording(ex, ns)
    return _print_result(result, ns.json)


def _record_config(ns: argparse.Namespace) -> dict[str, Any]:
    from kernelexec._cli._progress import ProgressDisplay

    config: dict[str, Any] = {"record_dir": ns.record} if getattr(ns, "record", None) else {}
    if getattr(ns, "cache_dir", None):
        config["cache_dir"] = ns.cache_dir
    if getattr(ns, "requirement", None) or getattr(ns, "python", None):
        config["env"] = _venv(ns.requirement or [], ns.python)
    config["on_progress"] = ProgressDisplay()
    return config


def _venv(requirements: list[str], python: str | None) -> VenvEnv:
    from kernelexec._envs._envs import VenvEnv

    try:
        return VenvEnv(requirements=tuple(requirements), python=python)
    except ValueError as exc:
        raise UsageError(f"bad requirement: {exc}") from None


def _cmd_env(ns: argparse.Namespace) -> int:
    from kernelexec._cli._progress import ProgressDisplay
    from kernelexec._envs._builder import EnvBuilder, list_envs, prune_envs
    from kernelexec._envs._envs import default_cache_dir

    cache = Path(ns.cache_dir) if ns.cache_dir else default_cache_dir()
    if ns.env_command == "list":
        envs = list_envs(cache)
        if ns.json:
            print(json.dumps(envs, indent=2))
        elif not envs:
            print(f"no venvs in {cache / 'envs'}", file=sys.stderr)
        for info in [] if ns.json else envs:
            reqs = ", ".join(info.get("requirements") or []) or "(ipykernel only)"
            print(
                f"{info['fingerprint']}  py{info.get('python_version', '?')}  "
                f"last used {info['last_used']}  {reqs}"
            )
        return EXIT_OK
    if ns.env_command == "prune":
        older = None if ns.all else ns.older_than * 86400
        removed = prune_envs(cache, older)
        if ns.json:
            print(json.dumps({"removed": removed}))
        else:
            for path in removed:
                print(f"removed {path}")
            print(f"{len(removed)} removed", file=sys.stderr)
        return EXIT_OK
    env = _venv(ns.requirements, ns.python)
    builder = EnvBuilder(cache, ns.installer, ProgressDisplay())
    try:
        built = asyncio.run(builder.ensure(env))
    except EnvSetupError as exc:
        if ns.json:
            print(json.dumps({"error": {"kind": "env_setup_failed", "message": str(exc)}}))
        print(f"kernelexec: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if ns.json:
        print(built.model_dump_json())
    else:
        print(
            f"{built.fingerprint}  {built.path}  ({'built' if built.built else 'reused'} "
            f"in {built.seconds:.1f} s)"
        )
    return EXIT_OK


def _report_recording(ex: KernelExecutor, ns: argparse.Namespace) -> None:
    if getattr(ns, "record", None):
        print(f"recorded to {ex.session(ns.agent).record_path}", file=sys.stderr)


def _cmd_replay(ns: argparse.Namespace) -> int:
    from kernelexec._sync import replay
    from kernelexec.backends import LocalBackend

    options: dict[str, Any] = {"build_requirements": ns.build_requirements}
    if ns.isolation is not None:
        options["isolation"] = ns.isolation
    if ns.timeout is not None:
        options.update(default_timeout=ns.timeout, max_timeout=ns.timeout)
    level = ns.isolation or LocalBackend.default_isolation
    print(f"replaying {ns.notebook} in a fresh kernel at isolation={level!r}", file=sys.stderr)
    report = replay(ns.notebook, **options)
    for note in report.notes:
        print(f"kernelexec: {note}", file=sys.stderr)
    if ns.json:
        print(report.model_dump_json())
    else:
        for diff in report.differences:
            print(f"cell {diff.index} ({diff.first_line}): outputs differ")
            if diff.recorded_status != diff.replayed_status:
                print(f"  status: recorded {diff.recorded_status}, replayed {diff.replayed_status}")
            for line in diff.diff.splitlines():
                print(f"  {line}")
        verdict = "no differences" if report.ok else f"{len(report.differences)} cell(s) differ"
        print(f"{report.cells_run} cells replayed: {verdict}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _cmd_tools(ns: argparse.Namespace) -> int:
    from kernelexec._tools._tool import Tool

    tools = Tool.from_notebook(ns.notebook)
    if not tools:
        print(f"kernelexec: no code cells tagged 'tool' in {ns.notebook}", file=sys.stderr)
    data = [t.model_dump(mode="json", exclude_none=True) for t in tools]
    print(json.dumps(data, indent=2, ensure_ascii=False))
    return EXIT_OK


def _cmd_schema(ns: argparse.Namespace) -> int:
    print(json.dumps(_load_tool(ns.file, ns.name).json_schema, indent=2, ensure_ascii=False))
    return EXIT_OK


def _cmd_repl(ns: argparse.Namespace) -> int:
    from kernelexec._cli._repl import run_repl

    path = run_repl(_record_config(ns), ns.agent)
    if path is not None:
        print(f"recorded to {path}", file=sys.stderr)
    return EXIT_OK


def _cmd_mcp(ns: argparse.Namespace) -> int:
    try:
        from kernelexec._mcp._serve import serve
    except ImportError as exc:
        if not (exc.name or "").startswith(("mcp", "uvicorn", "starlette")):
            raise
        raise UsageError(
            f"the MCP server needs the mcp extra ({exc.name} is missing): "
            "pip install 'kernelexec[mcp]'"
        ) from None
    from kernelexec._mcp._options import McpOptions

    options = McpOptions.from_flags(
        tools=tuple(ns.tools),
        transport=ns.transport,
        host=ns.host,
        port=ns.port,
        token=ns.token,
        record_dir=ns.record,
        isolation=ns.isolation,
        requirements=tuple(ns.requirement),
        timeout=ns.timeout,
        upstream=tuple(ns.upstream),
        upstream_env=tuple(ns.upstream_env),
        idle_timeout=ns.idle_timeout,
    )
    serve(options)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kernelexec`` command; returns the exit status."""
    ns = _parser().parse_args(argv)
    handlers: dict[str, Any] = {
        "run": _cmd_run,
        "exec": _cmd_exec,
        "schema": _cmd_schema,
        "repl": _cmd_repl,
        "replay": _cmd_replay,
        "tools": _cmd_tools,
        "env": _cmd_env,
        "mcp": _cmd_mcp,
        "sessions": cmd_sessions,
        "attach": cmd_attach,
    }
    try:
        if ns.command == "demo":
            from kernelexec._cli._demo import run_demo

            return run_demo(calls=ns.calls, record_dir=ns.record)
        return int(handlers[ns.command](ns))
    except (UsageError, ConfigError) as exc:
        # ConfigError covers unreadable notebooks and bad --record directories: bad input.
        print(f"kernelexec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KernelExecError as exc:
        print(f"kernelexec: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def entry() -> None:
    """Console-script wrapper that exits with :func:`main`'s status."""
    sys.exit(main())
