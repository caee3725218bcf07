"""The gateway's REST API (Jupyter Server's ``/api/kernels``), with its failures translated once
into kernelexec's exceptions.

The token travels in the ``Authorization`` header only: a ``?token=`` query parameter would end
up in the gateway's and every proxy's access logs. No message here ever contains it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from typing import Any
from urllib.parse import quote, urlsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from kernelexec._exceptions import ConfigError, KernelStartError, PoolExhaustedError

log = logging.getLogger("kernelexec")

UNREACHABLE = 599
"""The status tornado gives a request that got no HTTP answer (refused, reset, timed out)."""


class GatewayUnreachable(KernelStartError):
    """No HTTP answer from the gateway (refused, reset, timed out)."""


class KernelGone(KernelStartError):
    """The gateway does not know the kernel (404): deleted behind our back, culled, or the
    gateway restarted."""


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or ConfigError naming what is wrong with it."""
    if not isinstance(url, str):
        raise ConfigError(f"gateway url must be a str, not {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"gateway url must be http(s)://host[:port][/base], got {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(
            "gateway url must not carry a query, fragment or credentials "
            "(give the token as token=..., it is sent in the Authorization header)"
        )
    return url.rstrip("/")


def ws_url(url: str) -> str:
    """The websocket form of a gateway's http(s) url."""
    return "ws" + url[len("http") :] if url.startswith("http") else url


class GatewayREST:
    """Calls to one gateway's kernels API.

    Args:
        url: The gateway's base url (checked by :func:`check_url`).
        token: Sent as ``Authorization: token ...``; None sends no credentials.
        ssl_context: For https gateways with a private CA or client certificates.
        request_timeout: Seconds for one request, connection included.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        ssl_context: ssl.SSLContext | None,
        request_timeout: float,
    ) -> None:
        self.url = url
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"token {token}"
        self.has_token = bool(token)
        self._ssl = ssl_context
        self._timeout = request_timeout

    @property
    def auth_headers(self) -> dict[str, str]:
        """The headers the websocket handshake must carry too."""
        return {k: v for k, v in self._headers.items() if k == "Authorization"}

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 0
    ) -> tuple[int, Any]:
        """``(status, parsed JSON body or None)``; status 599 when nothing answered.

        Raises:
            ConfigError: the gateway refused the credentials (401, or 403 without a resource
                limit).
            PoolExhaustedError: the gateway refuses more kernels (403 ``Resource Limit``).
        """
        req = HTTPRequest(
            self.url + path,
            method=method,
            headers=self._headers,
            body=None if body is None else json.dumps(body),
            allow_nonstandard_methods=True,
            request_timeout=timeout or self._timeout,
            connect_timeout=timeout or self._timeout,
            ssl_options=self._ssl,
            follow_redirects=False,
        )
        client = AsyncHTTPClient(force_instance=True)
        try:
            resp = await client.fetch(req, raise_error=False)
        except HTTPClientError as exc:  # pragma: no cover - raise_error=False returns these
            resp = exc.response  # type: ignore[assignment]
        except OSError as exc:
            return UNREACHABLE, str(exc)
        finally:
            client.close()
        if resp is None:
            return UNREACHABLE, None
        if resp.code == UNREACHABLE:
            return UNREACHABLE, str(resp.error)
        data: Any = None
        if resp.body:
            try:
                data = json.loads(resp.body)
            except ValueError:
                data = resp.body.decode(errors="replace")
        if resp.code in (401, 403):
            raise self._refused(resp.code, data, method, path)
        return resp.code, data

    def _refused(self, code: int, data: Any, method: str, path: str) -> Exception:
        reason = message_of(data)
        if code == 403 and "resource limit" in reason.lower():
            return PoolExhaustedError(f"the gateway at {self.url} refuses more kernels: {reason}")
        what = "refused the token" if self.has_token else "requires a token (none was given)"
        if code == 403:
            what = f"forbids {method} {path} with this token ({reason or 'no reason given'})"
        return ConfigError(f"the gateway at {self.url} {what} (HTTP {code})")

    async def start_kernel(self, kernel_name: str, env: dict[str, str], path: str | None) -> str:
        """Start a kernel; its id.

        Raises:
            KernelStartError: the gateway is unreachable or could not start the kernel.
        """
        body: dict[str, Any] = {"name": kernel_name, "env": env}
        if path is not None:
            body["path"] = path
        code, data = await self.request("POST", "/api/kernels", body)
        if code == UNREACHABLE:
            raise GatewayUnreachable(f"the gateway at {self.url} is unreachable: {data}")
        if code not in (200, 201) or not isinstance(data, dict) or "id" not in data:
            raise KernelStartError(
                f"the gateway at {self.url} could not start kernel {kernel_name!r} "
                f"(HTTP {code}): {message_of(data)}"
            )
        return str(data["id"])

    async def kernel_state(self, kernel_id: str, timeout: float = 0) -> str:
        """The kernel's ``execution_state`` as the gateway reports it.

        Raises:
            GatewayUnreachable: nothing answered.
            KernelGone: the gateway does not know the kernel.
        """
        code, data = await self.request("GET", f"/api/kernels/{quote(kernel_id)}", timeout=timeout)
        if code == UNREACHABLE:
            raise GatewayUnreachable(f"the gateway at {self.url} is unreachable: {data}")
        if code == 404:
            raise KernelGone(f"the gateway at {self.url} no longer has kernel {kernel_id}")
        if isinstance(data, dict):
            return str(data.get("execution_state", "unknown"))
        return "unknown"

    async def list_kernels(self) -> list[dict[str, Any]]:
        """The gateway's kernels (needs ``list_kernels`` enabled on Kernel Gateway)."""
        code, data = await self.request("GET", "/api/kernels")
        if code == UNREACHABLE:
            raise GatewayUnreachable(f"the gateway at {self.url} is unreachable: {data}")
        if code != 200 or not isinstance(data, list):
            raise KernelStartError(
                f"the gateway at {self.url} did not list its kernels (HTTP {code}): "
                f"{message_of(data)}"
            )
        return [k for k in data if isinstance(k, dict)]

    async def interrupt(self, kernel_id: str) -> int:
        """Ask the gateway to interrupt the kernel; the HTTP status."""
        code, _ = await self.request("POST", f"/api/kernels/{quote(kernel_id)}/interrupt", {})
        return code

    async def delete(self, kernel_id: str, timeout: float = 0) -> None:
        """Shut the kernel down; a kernel already gone is not an error.

        A 5xx is retried until ``timeout``: Jupyter Server fails a DELETE that arrives while it
        restarts a kernel that died (jupyter_client's ``ready`` future is not done yet).
        """
        timeout = timeout or self._timeout
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            try:
                code, data = await self.request(
                    "DELETE", f"/api/kernels/{quote(kernel_id)}", timeout=timeout
                )
            except (ConfigError, PoolExhaustedError) as exc:
                log.warning("could not delete gateway kernel %s: %s", kernel_id, exc)
                return
            if code in (204, 200, 404):
                return
            if code < 500 or code == UNREACHABLE or time.monotonic() + delay > deadline:
                log.warning(
                    "could not delete gateway kernel %s (HTTP %s): %s",
                    kernel_id,
                    code,
                    message_of(data),
                )
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def message_of(data: Any, limit: int = 300) -> str:
    """The gateway's error message in a body, trimmed: a 500 carries a whole server traceback."""
    if isinstance(data, dict):
        text = str(data.get("message") or data.get("reason") or "")
    elif data is None:
        text = ""
    else:
        text = str(data)
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + " ..."
