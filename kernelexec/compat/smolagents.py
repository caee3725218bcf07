"""smolagents on kernelexec: ``CodeAgent(executor=KernelPythonExecutor(...))``.

smolagents' remote executors run the model's code in a Jupyter kernel elsewhere (E2B, Docker,
Modal); :class:`KernelPythonExecutor` runs it in a persistent kernelexec session on this machine
(or a gateway), with its isolation level, limits and interrupting timeouts. Variables, imports
and the tools smolagents sends persist from step to step, and come back after the kernel is
replaced (a death, a stuck run, a memory limit): the adapter sends them again.

Needs the ``smolagents`` extra: ``pip install 'kernelexec[smolagents]'``.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

try:
    from smolagents.local_python_executor import CodeOutput
    from smolagents.remote_executors import RemotePythonExecutor
    from smolagents.utils import AgentError
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kernelexec.compat.smolagents needs smolagents ({exc.name} is missing): "
        "pip install 'kernelexec[smolagents]'"
    ) from exc

from kernelexec._assembly._executor import AsyncKernelExecutor
from kernelexec._core._session import AsyncSession
from kernelexec._models import Execution
from kernelexec._plaintext import strip_ansi
from kernelexec._sync import KernelExecutor
from kernelexec.compat._bridge import AgentKernel, describe_error, describe_loss, state_line

__all__ = ["KernelPythonExecutor"]

_IMAGE_TYPES = ("image/png", "image/jpeg")

_OPTIONAL_IMPORTS = ("numpy", "PIL")
"""Modules the code smolagents sends with its tools imports at its top, though the functions
using them import them only where installed (its final answer's serialiser): numpy is no
dependency of smolagents, and a kernel without it failed to define the tools."""


class KernelPythonExecutor(RemotePythonExecutor):  # type: ignore[misc]
    """A smolagents executor whose Python state lives in a kernelexec session.

    Args:
        additional_imports: Packages the agent's code may import. They must be importable in
            the session's environment; to have them installed, give a venv
            (``env=kx.VenvEnv(requirements=[...])``) rather than smolagents' ``!pip install``.
        logger: smolagents' ``AgentLogger``.
        agent_id: The session's agent id (default: a fresh ``smolagents-<hex>``).
        executor: A :class:`~kernelexec.KernelExecutor` (or an
            :class:`~kernelexec.AsyncKernelExecutor` running on another thread) to share; it
            stays open after :meth:`cleanup`.
        timeout: Seconds before a step's code is interrupted (default: the executor's).
        **executor_config: :class:`~kernelexec.ExecutorConfig` fields for an executor the
            adapter makes itself and closes in :meth:`cleanup`.
    """

    def __init__(
        self,
        additional_imports: list[str],
        logger: Any,
        *,
        agent_id: str | None = None,
        executor: KernelExecutor | AsyncKernelExecutor | None = None,
        timeout: float | None = None,
        **executor_config: Any,
    ) -> None:
        super().__init__(additional_imports, logger)
        self._kernel = AgentKernel("smolagents", agent_id, executor, executor_config)
        self._timeout = timeout
        self._setup: list[str] = []  # code that defined the tools and variables, in order
        self._recording = False  # inside send_tools / send_variables
        self._sending_tools = False
        self.installed_packages = self.install_packages(additional_imports)

    @property
    def agent_id(self) -> str:
        """The kernelexec session's agent id."""
        return self._kernel.agent_id

    def install_packages(self, additional_imports: list[str]) -> list[str]:
        """Nothing is installed into a running kernel (smolagents would run ``!pip install``
        there); the packages are expected in the session's environment."""
        return list(additional_imports)

    def send_tools(self, tools: dict[str, Any]) -> None:
        """Define the tools in the kernel (again after every kernel replacement). numpy and
        Pillow are used where the kernel's environment has them, and not needed."""
        self._recording = self._sending_tools = True
        try:
            super().send_tools(tools)
        finally:
            self._recording = self._sending_tools = False

    def send_variables(self, variables: dict[str, Any]) -> None:
        """Set variables in the kernel (again after every kernel replacement)."""
        self._recording = True
        try:
            super().send_variables(variables)
        finally:
            self._recording = False

    def run_code_raise_errors(self, code: str) -> CodeOutput:
        """Run one step's code: its stdout as ``logs``, its value or final answer as ``output``.

        Raises:
            AgentError: the code raised (the traceback is the message) or could not run.
        """
        if self._sending_tools:
            code = _tolerant_imports(code)
        result = self._kernel.run_code(code, timeout=self._timeout)
        loss = None
        if result.kernel_restarted and not self._recording:
            loss = describe_loss(result.lost_variables)
        if result.kernel_restarted and self._setup and not self._recording:
            # The kernel was replaced (a death, a stuck run, a limit, an eviction): the tools
            # and variables smolagents sent are gone. Send them again for the next steps; this
            # step's result (its error, with what was lost) goes to the model.
            for setup in self._setup:
                self._check(self._kernel.run_code(setup, timeout=self._timeout))
            back = set(self._kernel.call(_names))
            lost = [n for n in result.lost_variables if n not in back]
            loss = f"{describe_loss(lost)[:-1]}; the tools were defined again)"
        if self._recording:
            self._setup.append(code)
        return self._check(result, loss)

    def _check(self, result: Execution, loss: str | None = None) -> CodeOutput:
        """The step's outcome as smolagents takes it, plain text; ``loss`` says what a
        replaced kernel lost (told to the model after the step's output)."""
        error = result.error
        logs = strip_ansi(result.stdout)
        if error is not None and error.ename == self.FINAL_ANSWER_EXCEPTION:
            answer = self._deserialize_final_answer(error.evalue, self.allow_pickle)
            return CodeOutput(output=answer, logs=logs, is_final_answer=True)
        if error is not None:
            detail = describe_error(error)
            if loss is not None:
                detail = f"{detail}\n{loss}"
            elif result.rolled_back:
                detail = f"{detail}\n{state_line(result)}"
            raise AgentError(f"{logs}{detail}", self.logger)
        if loss is not None:
            logs = f"{logs}{loss}\n"
        return CodeOutput(output=_output(result), logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        """Close the session, and the executor when the adapter made it."""
        self._kernel.close()

    def delete(self) -> None:
        """smolagents' name for :meth:`cleanup`."""
        self.cleanup()


async def _names(session: AsyncSession) -> tuple[str, ...]:
    """The user's names in the session's kernel after its last run."""
    return session.lease.names


def _tolerant_imports(code: str) -> str:
    """``code`` with its top-level imports of :data:`_OPTIONAL_IMPORTS` skipped where the
    module is missing."""
    lines = []
    for line in code.split("\n"):
        if line.startswith("import ") and line[len("import ") :].strip() in _OPTIONAL_IMPORTS:
            line = f"try:\n    {line.strip()}\nexcept ImportError:\n    pass"
        lines.append(line)
    return "\n".join(lines)


def _output(result: Execution) -> Any:
    """The step's value: an image as a ``PIL.Image`` (as smolagents' E2B executor gives),
    else its ``text/plain``."""
    for output in result.outputs:
        if output.get("output_type") != "execute_result":
            continue
        data = output.get("data") or {}
        for mime in _IMAGE_TYPES:
            if mime in data:
                from PIL import Image

                return Image.open(io.BytesIO(base64.b64decode(data[mime])))
        if "application/json" in data:
            return json.loads(json.dumps(data["application/json"]))
    return result.result
