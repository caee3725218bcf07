"""A real Jupyter Kernel Gateway on 127.0.0.1 for tests and benchmarks, started and stopped here.

The gateway runs from the test venv (``jupyter-kernel-gateway`` is in the dev extra) with a
random port, a random token, ``port_retries=0`` (it never moves to another port silently), in its
own process group, and with a private ``JUPYTER_PATH`` whose ``python3`` kernelspec starts
ipykernel with the same flags and lean launcher as the local backend, so the two compare fairly.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

from kernelexec.backends._local_process import KERNEL_FLAGS as _KERNEL_FLAGS
from kernelexec.backends._local_process import LEAN_LAUNCHER as _LEAN_LAUNCHER

SECRET = "GW_TEST_SECRET"
"""A variable set in the gateway's own environment; no kernel may see it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """One jupyter-kernel-gateway process and its private directory.

    Args:
        rate_limit: ``iopub_data_rate_limit`` in bytes/s (0: off, as recommended).
        env_whitelist: Variables a client may pass to kernels (``KG_ENV_WHITELIST``).
        max_kernels: The gateway's kernel limit (None: unlimited).
    """

    running: ClassVar[set[Gateway]] = set()
    """This process's gateways, from their start to their close: a failing test's report ends
    with their logs (``tests/conftest.py``), which go with their directories."""

    def __init__(
        self,
        *,
        rate_limit: int = 0,
        env_whitelist: tuple[str, ...] = (),
        max_kernels: int | None = None,
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kxgw-"))
        self.work = self.root / "work"
        self.work.mkdir()
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.rate_limit = rate_limit
        self.env_whitelist = env_whitelist
        self.max_kernels = max_kernels
        self.proc: subprocess.Popen[bytes] | None = None
        spec_dir = self.root / "share" / "jupyter" / "kernels" / "python3"
        spec_dir.mkdir(parents=True)
        spec = {
            "argv": [
                sys.executable,
                "-c",
                _LEAN_LAUNCHER,
                "-f",
                "{connection_file}",
                *_KERNEL_FLAGS,
            ],
            "display_name": "Python 3 (kernelexec tests)",
            "language": "python",
            "interrupt_mode": "signal",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        path = self.root / "gateway.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 60.0) -> None:
        """Start the gateway (again, on the same port and token) and wait until it answers."""
        args = [
            sys.executable,
            "-m",
            "kernel_gateway",
            "--KernelGatewayApp.ip=127.0.0.1",
            f"--KernelGatewayApp.port={self.port}",
            "--KernelGatewayApp.port_retries=0",
            f"--KernelGatewayApp.auth_token={self.token}",
            "--JupyterWebsocketPersonality.list_kernels=True",
            f"--ZMQChannelsWebsocketConnection.iopub_data_rate_limit={self.rate_limit}",
        ]
        if self.max_kernels is not None:
            args.append(f"--KernelGatewayApp.max_kernels={self.max_kernels}")
        env = dict(os.environ)
        env.update(
            {
                "JUPYTER_PATH": str(self.root / "share" / "jupyter"),
                "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"),
                "IPYTHONDIR": str(self.root / "ipython"),
                "KG_ENV_PROCESS_WHITELIST": "IPYTHONDIR",
                "KG_ENV_WHITELIST": ",".join(self.env_whitelist),
                SECRET: "hunter2",
            }
        )
        with open(self.root / "gateway.log", "ab") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=self.work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                if "already in use" in self.log:
                    raise PortTaken(self.port)
                raise RuntimeError(f"the gateway exited at start:\n{self.log[-3000:]}")
            try:
                self.get("/api")
                return
            except http.client.HTTPException:
                # Not HTTP: something else (a kernel's zmq socket) took the port meanwhile.
                self.stop()
                raise PortTaken(self.port) from None
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the gateway did not answer:\n{self.log[-3000:]}") from None
                time.sleep(0.05)  # polling its readiness endpoint: the event itself

    def get(self, path: str) -> Any:
        req = urllib.request.Request(
            self.url + path, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def delete_kernel(self, kernel_id: str) -> None:
        """Delete a kernel behind its client's back."""
        req = urllib.request.Request(
            f"{self.url}/api/kernels/{kernel_id}",
            method="DELETE",
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=15):
            pass

    def kernels(self) -> list[dict[str, Any]]:
        """The kernels the gateway runs now."""
        result: list[dict[str, Any]] = self.get("/api/kernels")
        return result

    def stop(self) -> None:
        """SIGTERM (the gateway shuts its kernels down), SIGKILL of its group after 15 s."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def kill(self) -> None:
        """SIGKILL the gateway (its kernels end on their own when their parent is gone)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def close(self) -> None:
        Gateway.running.discard(self)
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Gateway:
        try:
            for _ in range(3):
                try:
                    self.start()
                    Gateway.running.add(self)
                    return self
                except PortTaken:
                    self.stop()
                    self.port = free_port()  # taken between its choice and the gateway's bind
            raise RuntimeError("the gateway found no free port in three tries")
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class PortTaken(Exception):
    """The gateway's port was taken by another process before the gateway bound it."""


class TcpProxy:
    """A TCP relay on 127.0.0.1 in front of a gateway whose connections can be cut, to drop a
    client's websocket for real while the gateway and the kernel live on."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drop_websockets = False
        """When True, a connection whose first bytes ask for a websocket upgrade is closed
        before anything is answered (REST requests still pass)."""
        self.hold_kernel_starts = False
        """When True, the gateway's answer to ``POST /api/kernels`` is held back from the client
        (the start stays in flight) until :meth:`release_kernel_starts`."""
        self.start_answered = threading.Event()
        """Set when the gateway has answered a held kernel start: its kernel is up."""
        self._released = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            first = client.recv(65536)
        except OSError:
            first = b""
        if not first or (self.drop_websockets and b"upgrade: websocket" in first.lower()):
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            upstream.sendall(first)
        except OSError:
            client.close()
            return
        with self._lock:
            self.accepted += 1
            self._open += [client, upstream]
        held = self.hold_kernel_starts and first.startswith(b"POST /api/kernels ")
        for a, b, hold in ((client, upstream, False), (upstream, client, held)):
            threading.Thread(target=self._pump, args=(a, b, hold), daemon=True).start()

    def release_kernel_starts(self) -> None:
        """Let the held answers to kernel starts through (and hold no more)."""
        self.hold_kernel_starts = False
        self._released.set()

    def _pump(self, src: socket.socket, dst: socket.socket, hold: bool) -> None:
        try:
            while data := src.recv(65536):
                if hold:
                    self.start_answered.set()
                    self._released.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Reset every relayed connection now (new ones are still accepted)."""
        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._server.close()
        self._released.set()
        self.cut()
