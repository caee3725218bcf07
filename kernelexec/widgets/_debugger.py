"""``ToolDebugger``: try a tool's arguments in a sandbox session and see what the agent would see.

Every call goes through the executor exactly as an agent's does (``KernelExecutor.call_tool``
with the debugger's agent id), never through the notebook's own kernel. Calls run on a worker
thread that waits on the executor's background loop, so clicking Run returns at once: the
notebook's kernel keeps handling widget messages (Interrupt, Restart) while a call runs, and the
call's stdout/stderr reach the output area as they arrive.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import html
import time
from pathlib import Path
from typing import Any

import ipywidgets as w
import nbformat

from kernelexec._exceptions import ConfigError, KernelExecError
from kernelexec._models import ExecError, ToolResult, Variable
from kernelexec._notebooks._io import safe_filename, write_atomic
from kernelexec._protocol._host import state_json
from kernelexec._sync import KernelExecutor, Session
from kernelexec._tools._tool import Tool
from kernelexec.widgets._form import UNSET, Field, FieldProblem, SchemaForm
from kernelexec.widgets._views import (
    Call,
    HistoryView,
    VariablesView,
    result_outputs,
    summary_html,
)


class ToolDebugger(w.VBox):
    """An interactive debugger for agent tools (an ``ipywidgets.VBox``).

    Pick a tool, fill the form generated from its JSON schema, and Run it in a sandbox
    session; the debugger shows live output, the result, the history of calls and the
    sandbox kernel's variables::

        dbg = ToolDebugger(tools)      # display(dbg) in a notebook
        dbg.select("add")
        dbg.set_args({"a": 1})
        r = dbg.run()                  # a ToolResult, as an agent would get it

    Args:
        tools: The tools (a list of :class:`~kernelexec.Tool`), or the path of a notebook
            whose ``tool`` cells define them.
        executor: The :class:`~kernelexec.KernelExecutor` to call through. None: the debugger
            starts its own (recording, so the session can be exported) and closes it in
            :meth:`close`.
        agent_id: The agent id of the debugger's sandbox session.

    Raises:
        ConfigError: no tools, two tools with one name, or an unreadable notebook.
        TypeError: ``tools`` or ``executor`` is of the wrong type.
    """

    def __init__(
        self,
        tools: list[Tool] | str | Path,
        executor: KernelExecutor | None = None,
        agent_id: str = "debug",
    ) -> None:
        self._tools = _tool_map(tools)
        if executor is not None and not isinstance(executor, KernelExecutor):
            raise TypeError(
                f"executor must be a kernelexec.KernelExecutor, not {type(executor).__name__}"
            )
        if not isinstance(agent_id, str) or not agent_id:
            raise TypeError("agent_id must be a non-empty str")
        self._owns_executor = executor is None
        self.executor = executor if executor is not None else KernelExecutor(record=True)
        self.agent_id = agent_id
        self._calls: list[Call] = []
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kx-debugger")
        self._last: concurrent.futures.Future[ToolResult] | None = None

        self.picker = w.Dropdown(description="tool", options=list(self._tools))
        self.description = w.HTML("")
        self.form = SchemaForm({})
        self._forms: dict[str, SchemaForm] = {}
        self._form_box = w.VBox([])
        self.agent_state = Field("agent_state", {"description": "the agent state (JSON)"}, False)
        self.env_vars = Field(
            "env vars", {"description": 'for this call only: {"NAME": "value"}'}, False
        )
        self.timeout = w.BoundedFloatText(
            description="timeout (s)",
            value=float(self.executor.config.default_timeout),
            min=0.0,
            max=1e9,
            style={"description_width": "12em"},
        )
        self.run_button = w.Button(description="Run", button_style="primary")
        self.interrupt_button = w.Button(description="Interrupt", disabled=True)
        self.restart_button = w.Button(description="Restart")
        self.status = w.HTML("idle")
        self.output = w.Output()
        self.summary = w.HTML("")
        self.history_view = HistoryView(self._load)
        self.variables_view = VariablesView()
        self._default_export = f"{safe_filename(agent_id)}.ipynb"
        self._exported: dict[Path, tuple[int, int]] = {}  # what export wrote: mtime_ns, size
        self.export_path = w.Text(description="export to", value=self._default_export)
        self.export_button = w.Button(description="Export notebook")
        self.export_status = w.HTML("")

        self.run_button.on_click(lambda _b: self._start())
        self.interrupt_button.on_click(lambda _b: self.interrupt())
        self.restart_button.on_click(lambda _b: self.restart())
        self.export_button.on_click(lambda _b: self._export_clicked())
        self.picker.observe(self._picked, names="value")
        for widget, name in [
            (self.output, "kx-output"),
            (self.summary, "kx-summary"),
            (self.status, "kx-status"),
        ]:
            widget.add_class(name)
        self.add_class("kx-debugger")
        super().__init__(
            [
                w.HTML(f"<h3>Tool debugger <small>(agent id {html.escape(agent_id)})</small></h3>"),
                self.picker,
                self.description,
                self._form_box,
                w.Accordion(
                    [w.VBox([self.agent_state.box, self.env_vars.box, self.timeout])],
                    titles=("Call settings",),
                    selected_index=None,
                ),
                w.HBox([self.run_button, self.interrupt_button, self.restart_button, self.status]),
                self.output,
                self.summary,
                w.Tab(
                    [
                        w.VBox(
                            [
                                self.history_view,
                                w.HBox([self.export_path, self.export_button]),
                                self.export_status,
                            ]
                        ),
                        self.variables_view,
                    ],
                    titles=("History", "Variables"),
                ),
            ]
        )
        self._picked({"new": self.picker.value})

    # -- the API ----------------------------------------------------------------------------

    @property
    def tool(self) -> Tool:
        """The selected tool."""
        return self._tools[self.picker.value]

    def select(self, name: str) -> None:
        """Pick the tool called ``name``; its form holds what it held when last shown.

        Raises:
            ConfigError: no tool has that name.
        """
        if name not in self._tools:
            raise ConfigError(f"no tool named {name!r} (tools: {', '.join(self._tools)})")
        self.picker.value = name

    def set_args(self, args: dict[str, Any]) -> None:
        """Fill the form: the given arguments, every other field back to its default.

        Raises:
            ConfigError: an unknown argument, or a value its field cannot hold.
        """
        self.form.fill(args)

    @property
    def args(self) -> dict[str, Any]:
        """The arguments the form holds now, as JSON data.

        Raises:
            ConfigError: a field cannot be read (invalid JSON), naming it.
        """
        args, problems = self.form.read()
        if problems:
            raise ConfigError("; ".join(f"argument {k!r}: {v}" for k, v in problems.items()))
        return args

    def run(self) -> ToolResult:
        """Run the selected tool with the form's arguments, as clicking Run does, and wait.

        Bad input (invalid JSON, arguments the schema rejects, a bad setting) runs nothing: the
        problems are shown next to their fields and returned as an ``invalid_args`` result.
        """
        return self._start().result()

    def wait(self, timeout: float | None = None) -> ToolResult | None:
        """The result of the last run (waiting for it); None when nothing ran yet."""
        return None if self._last is None else self._last.result(timeout)

    @property
    def history(self) -> list[tuple[dict[str, Any], ToolResult]]:
        """The calls made, oldest first, as ``(args, result)`` pairs."""
        return [(dict(c.args), c.result) for c in self._calls]

    @property
    def variables(self) -> dict[str, dict[str, str]]:
        """The sandbox session's user variables: name -> ``{"type": ..., "repr": ...}``
        (the type's own name and the bounded summary of :meth:`AsyncSession.variables`; read
        from the kernel now, the view is refreshed too)."""
        found = _by_name(self._session().variables())
        self.variables_view.update(found)
        return found

    @property
    def busy(self) -> bool:
        """Whether a call (or a restart) is running or queued."""
        return self._last is not None and not self._last.done()

    def interrupt(self) -> None:
        """Interrupt the running call (it ends with the kernel's ``KeyboardInterrupt``)."""
        self.status.value = "interrupting\u2026"
        self._session().interrupt()

    def restart(self) -> concurrent.futures.Future[None]:
        """Give the sandbox session a fresh kernel (state lost), after interrupting a running
        call; returns at once (the future is done when the kernel is replaced)."""
        if self.busy:
            self.interrupt()
        return self._worker.submit(self._restart)

    def export(self, path: str | Path | None = None, *, overwrite: bool = False) -> Path:
        """Write the session's recording (a notebook ``kernelexec replay`` re-runs); return
        the path written.

        A file is never overwritten unless it is one this debugger exported itself (and
        nobody changed since) or ``overwrite`` is True. With no name given (``path`` None
        and the "export to" field at its default) a free name is picked next to the default
        (``debug-1.ipynb``, ...; the same one on later exports); a name the user gave that
        exists is refused.

        Args:
            path: Where to write (None: the "export to" field).
            overwrite: Replace an existing file at a name the user gave.

        Raises:
            ConfigError: the executor does not record (create it with ``record=True``), or
                the named file exists.
        """
        notebook = self._session().notebook
        if notebook is None:
            raise ConfigError(
                "the executor does not record sessions: create it with record=True to export"
            )
        named = path is not None or self.export_path.value != self._default_export
        target = Path(path if path is not None else self.export_path.value).expanduser()
        if target.exists() and not overwrite and not self._wrote(target):
            if named:
                raise ConfigError(
                    f"{target} exists and was not written by this debugger: name another "
                    "file, or pass overwrite=True to replace it"
                )
            target = self._free_name(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, nbformat.writes(notebook))
        stat = target.stat()
        self._exported[target.resolve()] = (stat.st_mtime_ns, stat.st_size)
        return target

    def _free_name(self, target: Path) -> Path:
        """``target`` with the first ``-N`` suffix that names no file, or names this
        debugger's own earlier export (which is brought up to date)."""
        n = 1
        while True:
            candidate = target.with_name(f"{target.stem}-{n}{target.suffix}")
            if not candidate.exists() or self._wrote(candidate):
                return candidate
            n += 1

    def _wrote(self, target: Path) -> bool:
        """Whether ``target`` is, unchanged, a file this debugger exported."""
        try:
            stat = target.stat()
        except OSError:
            return False
        return self._exported.get(target.resolve()) == (stat.st_mtime_ns, stat.st_size)

    def close(self) -> None:
        """Close the widget; a debugger that started its own executor shuts it down."""
        if "_worker" not in self.__dict__:  # __init__ refused its arguments
            super().close()
            return
        if self.busy:
            with contextlib.suppress(KernelExecError):
                self._session().interrupt()
        self._worker.shutdown(wait=True)
        if self._owns_executor:
            self.executor.close()
        parts = [*self._forms.values(), self.agent_state.box, self.env_vars.box]
        for widget in _descendants([*self.children, *parts]):
            widget.close()  # each holds a comm in the notebook's kernel until closed
        super().close()

    # -- internals --------------------------------------------------------------------------

    def _session(self) -> Session:
        return self.executor.session(self.agent_id, self.executor.env_for(self.tool))

    def _picked(self, change: dict[str, Any]) -> None:
        tool = self._tools[change["new"]]
        form = self._forms.get(tool.name)
        if form is None:
            form = self._forms[tool.name] = SchemaForm(tool.parameters_schema)
        self.form = form
        self._form_box.children = [self.form]
        self.description.value = f"<p>{html.escape(tool.description)}</p>"
        self.agent_state.box.layout.display = None if tool.takes_agent_state else "none"

    def _settings(self) -> tuple[Any, dict[str, str] | None, float, list[str]]:
        problems: list[str] = []
        state: Any = None
        env: dict[str, str] | None = None
        for field in (self.agent_state, self.env_vars):
            field.show_problem("")
        if self.tool.takes_agent_state:
            try:
                state = self.agent_state.read()
            except FieldProblem as exc:
                self.agent_state.show_problem(str(exc))
                problems.append(f"agent_state: {exc}")
            state = None if state is UNSET else state
        try:
            raw = self.env_vars.read()
            if raw is not UNSET:
                if not isinstance(raw, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
                ):
                    raise FieldProblem("must be a JSON object of strings")
                env = raw
        except FieldProblem as exc:
            self.env_vars.show_problem(str(exc))
            problems.append(f"env vars: {exc}")
        timeout = float(self.timeout.value)
        if timeout <= 0:
            problems.append("timeout must be positive")
        return state, env, timeout, problems

    def _start(self) -> concurrent.futures.Future[ToolResult]:
        tool = self.tool
        args, field_problems = self.form.read()
        state, env, timeout, problems = self._settings()
        if field_problems:
            self.form.show_problems(field_problems)
            problems += [f"argument {k!r}: {v}" for k, v in field_problems.items()]
        else:
            schema_problems = tool.validate_args(args)
            self.form.show_schema_problems(schema_problems)
            problems += schema_problems
        if problems:
            return self._rejected(problems)
        self._last = self._worker.submit(self._call, tool, args, state, env, timeout)
        return self._last

    def _rejected(self, problems: list[str]) -> concurrent.futures.Future[ToolResult]:
        error = ExecError(kind="invalid_args", ename="InvalidArguments", evalue="; ".join(problems))
        result = ToolResult(status="error", error=error)
        self.summary.value = summary_html(result)
        self.status.value = "not run: fix the marked fields"
        done: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
        done.set_result(result)
        return done

    def _busy(self, busy: bool, status: str) -> None:
        self.run_button.disabled = busy
        self.interrupt_button.disabled = not busy
        self.status.value = html.escape(status)

    def _call(
        self,
        tool: Tool,
        args: dict[str, Any],
        state: Any,
        env: dict[str, str] | None,
        timeout: float,
    ) -> ToolResult:
        self._busy(True, f"running {tool.name}\u2026")
        self.output.outputs = ()
        self.summary.value = ""
        started = time.strftime("%H:%M:%S")
        try:
            result = self.executor.call_tool(
                tool,
                args,
                agent_id=self.agent_id,
                agent_state=state,
                env_vars=env,
                timeout=timeout,
                on_stdout=self.output.append_stdout,
                on_stderr=self.output.append_stderr,
                on_display=self._displayed,
            )
        except Exception as exc:
            self._busy(False, f"failed: {exc}")
            raise
        self._calls.append(Call(tool.name, args, result, started))
        self.output.outputs = result_outputs(result)
        self.summary.value = summary_html(result)
        if tool.takes_agent_state and result.agent_state is not None:
            self.agent_state.write(state_json(result.agent_state))
        self.history_view.update(self._calls)
        self._refresh_variables()
        self._busy(False, "done")
        return result

    def _displayed(self, output: dict[str, Any]) -> None:
        self.output.outputs = (*self.output.outputs, output)

    def _refresh_variables(self) -> None:
        try:
            self.variables_view.update(_by_name(self._session().variables()))
        except KernelExecError as exc:
            self.variables_view.value = f"<i>variables unavailable: {html.escape(str(exc))}</i>"

    def _restart(self) -> None:
        self._busy(True, "restarting\u2026")
        try:
            self._session().restart()
        finally:
            self._busy(False, "kernel restarted: state lost")
        self._refresh_variables()

    def _load(self, call: Call) -> None:
        self.select(call.tool)
        self.set_args(call.args)

    def _export_clicked(self) -> None:
        try:
            path = self.export()
        except (KernelExecError, OSError) as exc:
            self.export_status.value = f"<span style='color:#c62828'>{html.escape(str(exc))}</span>"
            return
        self.export_status.value = (
            f"wrote <code>{html.escape(str(path))}</code>: "
            f"<code>kernelexec replay {html.escape(str(path))}</code> re-runs it"
        )


def _descendants(roots: list[Any]) -> list[Any]:
    found: dict[int, Any] = {}
    todo = list(roots)
    while todo:
        widget = todo.pop()
        if id(widget) in found:
            continue
        found[id(widget)] = widget
        todo.extend(getattr(widget, "children", ()))
    return list(found.values())


def _tool_map(tools: Any) -> dict[str, Tool]:
    if isinstance(tools, (str, Path)):
        tools = Tool.from_notebook(tools)
    if not isinstance(tools, (list, tuple)):
        raise TypeError(
            f"tools must be a list of Tool or a notebook path, not {type(tools).__name__}"
        )
    found: dict[str, Tool] = {}
    for tool in tools:
        if not isinstance(tool, Tool):
            raise TypeError(f"tools must be kernelexec.Tool values, not {type(tool).__name__}")
        if tool.name in found:
            raise ConfigError(f"two tools are named {tool.name!r}")
        found[tool.name] = tool
    if not found:
        raise ConfigError("no tools to debug")
    return found


def _by_name(found: list[Variable]) -> dict[str, dict[str, str]]:
    return {v.name: {"type": v.type.rsplit(".", 1)[-1], "repr": v.summary} for v in found}
