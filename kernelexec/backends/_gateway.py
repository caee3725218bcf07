"""The gateway backend: kernels on a Jupyter Kernel Gateway or Enterprise Gateway, one websocket
per kernel.

REST (``_gateway_rest``) starts, interrupts and deletes kernels; one websocket per kernel
(``/api/kernels/{id}/channels``) carries shell, control and iopub in the framing the server
picks (``_gateway_wire``). Everything above the backend interface (readiness, the helper, the
run loop, timeouts, tools, recording, the pool) is unchanged. ``websockets`` is imported only
when a kernel is started, so ``kernelexec.backends`` imports without the ``gateway`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import socket
import ssl
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from kernelexec._aio import finish_shielded, finish_then_cancel
from kernelexec._exceptions import ConfigError, KernelExecError, KernelStartError
from kernelexec.backends._base import (
    KernelBackend,
    KernelConnection,
    KernelDied,
    KernelLaunch,
    KernelMessage,
)
from kernelexec.backends._gateway_rest import (
    GatewayREST,
    GatewayUnreachable,
    KernelGone,
    check_url,
    ws_url,
)
from kernelexec.backends._gateway_wire import V1, decode, encode, new_message

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

log = logging.getLogger("kernelexec")

_SILENCE_CHECK = 2.0
"""Seconds without a message after which ``receive`` asks the gateway whether the kernel still
exists (a deleted kernel's websocket may stay open and silent)."""

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_RATE_NOTICES = ("IOPub data rate exceeded", "IOPub message rate exceeded")
_TRUNCATED = (
    "\n[kernelexec: output truncated: the gateway dropped output over its IOPub rate limit "
    "(start it with --ZMQChannelsWebsocketConnection.iopub_data_rate_limit=0)]\n"
)


if sys.version_info >= (3, 11):

    async def _recv(ws: ClientConnection, timeout: float) -> str | bytes:
        # asyncio.timeout does not wrap recv() in a task as wait_for does (per message).
        async with asyncio.timeout(timeout):
            return await ws.recv()

else:  # pragma: no cover

    async def _recv(ws: ClientConnection, timeout: float) -> str | bytes:
        return await asyncio.wait_for(ws.recv(), timeout)


class _RedactAuthorization(logging.Filter):
    """websockets logs every handshake header at DEBUG level; the token must not reach a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 2 and str(args[0]).lower() == "authorization":
            record.args = (args[0], "[redacted]")
        return True


_WS_LOG = logging.getLogger("kernelexec.gateway.websockets")
_WS_LOG.addFilter(_RedactAuthorization())


def _websockets() -> Any:
    try:
        from websockets.asyncio import client
    except ImportError:
        raise ConfigError(
            "the gateway backend needs the websockets package: pip install 'kernelexec[gateway]'"
        ) from None
    return client


class GatewayBackend(KernelBackend):
    """Runs kernels on a Jupyter Kernel Gateway or Enterprise Gateway.

    Args:
        url: The gateway's base url, ``http(s)://host:port[/base]``.
        token: The gateway's auth token, sent in the ``Authorization`` header only (never in a
            url, never logged). None sends no credentials.
        kernel_name: The kernelspec to start; on the gateway a kernelspec is how one picks an
            interpreter (a ``VenvEnv`` is refused).
        username: Sent as ``KERNEL_USERNAME`` (Enterprise Gateway's per-user limits and
            authorisation use it); default: the current user.
        path: The kernel's working directory relative to the gateway's root (``"path"`` of
            ``POST /api/kernels``); None: the gateway's default.
        ssl_context: For https gateways with a private CA or client certificates.
        request_timeout: Seconds for one REST request.
        reconnect_timeout: Seconds to keep reconnecting a dropped websocket (with the same
            session id, so the gateway replays what it buffered) before the kernel counts as
            lost.
        max_message_bytes: The largest websocket message accepted (a bigger one ends the
            kernel's connection with a clear reason). Outputs beyond ``max_output_chars`` are
            cut in the kernel already, so this bounds images and other rich outputs.
        ping_interval: Seconds between websocket pings (a silent dead peer is noticed within
            twice this); None turns pings off.
        offer_v1: Offer the ``v1.kernel.websocket.jupyter.org`` subprotocol (binary framing);
            False always uses the legacy JSON framing, as servers without v1 do anyway.
        quickack: Re-arm ``TCP_QUICKACK`` after every receive (Linux): Jupyter Server never sets
            ``TCP_NODELAY`` on kernel websockets, so without it every call waits ~40 ms for the
            client's delayed ACK.
    """

    name = "gateway"
    host_filesystem = False
    filters_env = True  # Kernel Gateway and Enterprise Gateway drop what is not whitelisted

    def __init__(
        self,
        url: str,
        token: str | None = None,
        kernel_name: str = "python3",
        *,
        username: str | None = None,
        path: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        request_timeout: float = 30.0,
        reconnect_timeout: float = 10.0,
        max_message_bytes: int = 256 * 1024 * 1024,
        ping_interval: float | None = 20.0,
        offer_v1: bool = True,
        quickack: bool = True,
    ) -> None:
        self.url = check_url(url)
        if token is not None and not isinstance(token, str):
            raise ConfigError("gateway token must be a str")
        if not isinstance(kernel_name, str) or not kernel_name:
            raise ConfigError("gateway kernel_name must be a non-empty str")
        for field, value in (
            ("request_timeout", request_timeout),
            ("reconnect_timeout", reconnect_timeout),
            ("max_message_bytes", max_message_bytes),
        ):
            if not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"gateway {field} must be positive, got {value!r}")
        if ping_interval is not None and ping_interval <= 0:
            raise ConfigError(
                f"gateway ping_interval must be positive or None, got {ping_interval}"
            )
        self.kernel_name = kernel_name
        self.username = username or getpass.getuser()
        self.path = path
        self.ssl_context = ssl_context
        self.reconnect_timeout = float(reconnect_timeout)
        self.max_message_bytes = int(max_message_bytes)
        self.ping_interval = ping_interval
        self.offer_v1 = offer_v1
        self.quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        self.rest = GatewayREST(self.url, token, ssl_context, float(request_timeout))
        host = urlsplit(self.url).hostname or ""
        if token and self.url.startswith("http:") and host not in _LOOPBACK:
            log.warning(
                "the gateway token is sent in clear text to %s: use https:// (see the README)",
                self.url,
            )

    def __repr__(self) -> str:
        return f"GatewayBackend({self.url!r}, kernel_name={self.kernel_name!r})"

    def describe(self) -> str:
        # The kernelspec is the environment on a gateway, so it is part of the fingerprint.
        return f"gateway:{self.url}#{self.kernel_name}"

    def check(self, launch: KernelLaunch) -> None:
        if launch.interpreter is not None:
            raise ConfigError(
                "the 'gateway' backend cannot run a VenvEnv: kernels run on the gateway's "
                "side, where an interpreter is picked by kernelspec; install a kernelspec for "
                "that environment on the gateway host and use GatewayBackend(kernel_name=...)"
            )
        super().check(launch.model_copy(update={"kernel_name": None}))

    async def start(self, launch: KernelLaunch, *, timeout: float) -> KernelConnection:
        self.check(launch)
        conn = GatewayConnection(self, launch)
        try:
            await asyncio.wait_for(conn.launch(), timeout)
        except asyncio.TimeoutError:
            await finish_then_cancel(conn.shutdown())
            raise KernelStartError(
                f"the gateway at {self.url} did not start a kernel within {timeout:g} s"
            ) from None
        except BaseException:
            await finish_then_cancel(conn.shutdown())
            raise
        return conn

    async def list_kernels(self) -> list[dict[str, Any]]:
        """The gateway's kernels as it reports them (``GET /api/kernels``).

        Raises:
            KernelStartError: the gateway is unreachable or does not list kernels (Kernel
                Gateway needs ``--JupyterWebsocketPersonality.list_kernels=True``).
        """
        return await self.rest.list_kernels()


class GatewayConnection(KernelConnection):
    """One kernel on a gateway: its id, and the websocket carrying its channels."""

    def __init__(self, backend: GatewayBackend, launch: KernelLaunch) -> None:
        self._backend = backend
        self._rest = backend.rest
        self._kernel_name = launch.kernel_name or backend.kernel_name
        env = dict(launch.env)
        env.setdefault("KERNEL_USERNAME", backend.username)
        self._env = env
        self.kernel_id: str | None = None
        self._session = uuid.uuid4().hex
        self._ws: ClientConnection | None = None
        self._v1 = False
        self._sock: socket.socket | None = None
        self._outbox: list[str | bytes] = []
        self._died: KernelDied | None = None
        self._dropped_at: float | None = None
        self._drop_reason = ""
        self._heard = time.monotonic()
        self._seen: dict[str, None] = {}
        self._warned_rate = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def launch(self) -> None:
        """Start a kernel on the gateway and connect its websocket."""
        self._died = None
        self._outbox.clear()
        self._seen.clear()
        self._drop_reason = ""  # the last kernel's: it would be read as this one's failure
        self._session = uuid.uuid4().hex
        start = asyncio.ensure_future(
            self._rest.start_kernel(self._kernel_name, self._env, self._backend.path)
        )
        try:
            self.kernel_id = await asyncio.shield(start)
        except asyncio.CancelledError:
            # Cancelled mid-request (an executor closing while its pool refills): the gateway
            # starts the kernel anyway and only the reply says which, so wait for it and
            # delete the kernel before the cancellation goes on.
            with contextlib.suppress(Exception):
                kernel_id = await finish_shielded(start)
                await finish_then_cancel(self._rest.delete(kernel_id))
            raise
        # The handshake waits for the kernel's first reply; start() bounds the whole launch.
        await self._connect(open_timeout=None)

    async def _connect(self, open_timeout: float | None) -> None:
        try:
            ws = await self._open(open_timeout)
        except Exception as exc:
            raise self._translated(exc) from None
        try:
            while self._outbox:
                await ws.send(self._outbox[0])
                del self._outbox[0]
        except Exception as exc:
            ws.transport.abort()  # what was not sent stays queued for the next connection
            raise self._translated(exc) from None
        self._ws = ws
        self._v1 = ws.subprotocol == V1
        self._sock = ws.transport.get_extra_info("socket") if self._backend.quickack else None
        self._heard = time.monotonic()
        self._dropped_at = None

    def _translated(self, exc: Exception) -> Exception:
        """The one place where a failure of the websocket library becomes kernelexec's own
        exception: no ``websockets`` exception leaves this backend."""
        from websockets.exceptions import InvalidStatus, WebSocketException

        url = self._backend.url
        if isinstance(exc, InvalidStatus):
            code = exc.response.status_code
            if code in (401, 403):
                what = "refused the token" if self._rest.has_token else "requires a token"
                return ConfigError(f"the gateway at {url} {what} (HTTP {code})")
            if code == 404:
                return KernelGone(f"the gateway at {url} no longer has the kernel")
            return KernelStartError(
                f"the gateway at {url} refused the kernel's websocket (HTTP {code})"
            )
        if isinstance(exc, OSError | asyncio.TimeoutError | WebSocketException):
            # Refused, reset, timed out, or cut mid-handshake (a gateway killed while it
            # answers gives InvalidMessage, a closed socket ConnectionClosed).
            return GatewayUnreachable(
                f"the gateway at {url} is unreachable: {exc or type(exc).__name__}"
            )
        if isinstance(exc, KernelExecError):
            return exc
        return KernelStartError(
            f"the websocket to the gateway at {url} failed: {type(exc).__name__}: {exc}"
        )

    async def _open(self, open_timeout: float | None) -> ClientConnection:
        client = _websockets()
        backend = self._backend
        assert self.kernel_id is not None
        url = f"{ws_url(backend.url)}/api/kernels/{self.kernel_id}/channels"
        ws: ClientConnection = await client.connect(
            f"{url}?session_id={self._session}",
            additional_headers=self._rest.auth_headers,
            subprotocols=[V1] if backend.offer_v1 else None,
            compression=None,
            max_size=backend.max_message_bytes,
            max_queue=None,
            ping_interval=backend.ping_interval,
            ping_timeout=backend.ping_interval,
            open_timeout=open_timeout,
            close_timeout=2,
            proxy=None,
            ssl=backend.ssl_context if backend.url.startswith("https") else None,
            user_agent_header="kernelexec",
            logger=_WS_LOG,
        )
        return ws

    async def restart(self) -> None:
        # A fresh kernel rather than POST .../restart: the gateway's own restart would arrive
        # on this socket as a "restarting" status, which means death when the kernel did it.
        await self.shutdown()
        await self.launch()

    async def shutdown(self) -> None:
        ws, self._ws = self._ws, None
        kernel_id, self.kernel_id = self.kernel_id, None
        self._sock = None
        self._outbox.clear()
        self._died = KernelDied("the kernel is shut down")
        # Both run to their end even if the caller is cancelled meanwhile (an executor closing
        # while a kernel is culled): an interrupted DELETE would leave the kernel running on
        # the gateway, and this connection no longer knows its id.
        if ws is not None:
            with contextlib.suppress(Exception):
                await finish_then_cancel(ws.close())
        if kernel_id is not None:
            with contextlib.suppress(Exception):
                await finish_then_cancel(self._rest.delete(kernel_id))

    async def interrupt(self) -> None:
        if self.kernel_id is not None:
            with contextlib.suppress(Exception):
                await self._rest.interrupt(self.kernel_id)

    def diagnostics(self) -> str:
        return f"\n{self._drop_reason}" if self._drop_reason else ""

    # -- messages ----------------------------------------------------------------------------

    async def send(
        self,
        channel: Literal["shell", "control"],
        msg_type: str,
        content: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        buffers: tuple[bytes, ...] = (),
    ) -> str:
        if self.kernel_id is None:
            raise KernelStartError("the kernel is shut down")
        msg = new_message(self._session, self._backend.username, msg_type, content, metadata)
        frame = encode(msg, channel, buffers, self._v1)
        ws = self._ws
        if ws is None:
            self._outbox.append(frame)  # sent once the websocket is back
        else:
            try:
                await ws.send(frame)
            except Exception:
                self._outbox.append(frame)
            self._quickack()
        return str(msg["header"]["msg_id"])

    async def receive(self, timeout: float) -> KernelMessage | KernelDied | None:
        if self._died is not None:
            return self._died
        from websockets.exceptions import ConnectionClosed

        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if self._ws is None:
                died = await self._reconnect(deadline)
                if died is not None:
                    return self._die(died)
                if self._ws is None:
                    return None  # still reconnecting at the caller's deadline
            ws = self._ws
            assert ws is not None
            wait = max(0.001, min(deadline - now, self._heard + _SILENCE_CHECK - now))
            try:
                frame = await _recv(ws, wait)
            except asyncio.TimeoutError:
                now = time.monotonic()
                if now - self._heard >= _SILENCE_CHECK:
                    died = await self._check_kernel()
                    if died is not None:
                        return self._die(died)
                    self._heard = time.monotonic()
                if now >= deadline:
                    return None
                continue
            except ConnectionClosed as exc:
                self._dropped(exc)
                if 1009 in (getattr(exc.rcvd, "code", None), getattr(exc.sent, "code", None)):
                    return self._die(
                        KernelDied(
                            "a message from the kernel was larger than max_message_bytes="
                            f"{self._backend.max_message_bytes}; the connection was closed"
                        )
                    )
                continue
            self._heard = time.monotonic()
            self._quickack()
            msg = self._accept(frame)
            if isinstance(msg, KernelDied):
                return self._die(msg)
            if msg is not None:
                return msg
            if time.monotonic() >= deadline:
                return None

    def _quickack(self) -> None:
        # Not sticky: the kernel drops back to delayed ACKs, so it is re-armed after every
        # receive (and send). Measured on Kernel Gateway 3.0.1: 48 ms -> 4-5 ms per call.
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def _accept(self, frame: str | bytes) -> KernelMessage | KernelDied | None:
        decoded = decode(frame, self._v1)
        if decoded is None:
            return None
        msg_id, msg = decoded
        if msg_id:
            if msg_id in self._seen:
                return None  # replayed twice after a reconnect
            self._seen[msg_id] = None
            if len(self._seen) > 4096:
                del self._seen[next(iter(self._seen))]
        if msg.channel == "iopub":
            if msg.msg_type == "status" and msg.parent_id is None:
                state = msg.content.get("execution_state")
                if state == "restarting":
                    return KernelDied("the kernel died and the gateway restarted it")
                if state == "dead":
                    return KernelDied("the gateway reports the kernel dead")
            if msg.msg_type == "stream" and str(msg.content.get("text", "")).startswith(
                _RATE_NOTICES
            ):
                return self._rate_notice(msg)
        return msg

    def _rate_notice(self, msg: KernelMessage) -> KernelMessage:
        if not self._warned_rate:
            self._warned_rate = True
            log.warning("the gateway at %s dropped kernel output (IOPub rate limit)", self._url)
        return KernelMessage(
            channel="iopub",
            msg_type="stream",
            parent_id=msg.parent_id,
            content={"name": "stderr", "text": _TRUNCATED},
        )

    @property
    def _url(self) -> str:
        return self._backend.url

    def _die(self, died: KernelDied) -> KernelDied:
        self._died = died
        ws, self._ws = self._ws, None
        if ws is not None:
            # Closing waits for the peer; the kernel is gone either way.
            with contextlib.suppress(Exception):
                ws.transport.abort()
        return died

    def _dropped(self, exc: Exception) -> None:
        self._ws = None
        self._sock = None
        if self._dropped_at is None:
            self._dropped_at = time.monotonic()
        self._drop_reason = f"the websocket to the gateway at {self._url} closed: {exc}"
        log.warning("%s; reconnecting", self._drop_reason)

    async def _check_kernel(self) -> KernelDied | None:
        """Death, if the gateway says the kernel is gone; None while it lives or while the
        gateway does not answer (the websocket's pings notice a dead gateway)."""
        assert self.kernel_id is not None
        try:
            state = await self._rest.kernel_state(self.kernel_id)
        except KernelGone:
            return KernelDied(
                "the gateway no longer has the kernel (deleted, culled, or the gateway restarted)"
            )
        except Exception:
            return None
        if state == "dead":
            return KernelDied("the gateway reports the kernel dead")
        return None

    async def _reconnect(self, deadline: float) -> KernelDied | None:
        """Reconnect with the same session id (the gateway replays what it buffered); death
        when the kernel is gone or the gateway stays unreachable past ``reconnect_timeout``."""
        assert self._dropped_at is not None and self.kernel_id is not None
        give_up = self._dropped_at + self._backend.reconnect_timeout
        delay = 0.05
        while True:
            window = max(0.5, give_up - time.monotonic())
            try:
                await self._rest.kernel_state(self.kernel_id, timeout=window)
                await self._connect(open_timeout=window)
                log.warning("reconnected to kernel %s on %s", self.kernel_id, self._url)
                return None
            except KernelGone:
                return KernelDied(
                    "the gateway no longer has the kernel "
                    "(deleted, culled, or the gateway restarted)"
                )
            except (GatewayUnreachable, KernelStartError, ConfigError) as exc:
                last = str(exc)
            now = time.monotonic()
            if now >= give_up:
                return KernelDied(
                    f"lost the connection to the gateway at {self._url} and could not "
                    f"reconnect within {self._backend.reconnect_timeout:g} s",
                    last,
                )
            if now >= deadline:
                return None
            await asyncio.sleep(min(delay, give_up - now, max(0.0, deadline - now)))
            delay = min(delay * 2, 1.0)
