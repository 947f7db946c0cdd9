"""HttpServer: the OpenAI-compatible app under uvicorn, on a thread with its own event loop, with
the same lifecycle as halfmoon's gRPC servers (config in, `start() -> "HOST:PORT"`, `stop()`)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn

from openai_api.config import HttpConfig
from openai_api.metrics import HttpMetrics
from openai_api.server import build_app

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0


class HttpServer:
    """`HttpServer(HttpConfig(conductor=address)).start()` -> "HOST:PORT"; `stop()` ends it."""

    def __init__(self, config: HttpConfig):
        if not config.conductor:
            raise ValueError("HttpConfig.conductor: the conductor's gRPC address is required")
        self.config = config
        self.metrics = HttpMetrics()
        self.address = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._error: BaseException | None = None

    def start(self) -> str:
        """Bind the port (an error naming it when taken), serve, return "HOST:PORT"."""
        host, port = self.config.host, self.config.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
        # proto says TCP, and a stream's chunks held back for the peer's delayed ACK cost ~40 ms
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"http: cannot listen on {host}:{port} ({exc.strerror})") from None
        sock.listen(2048)
        self._socket = sock
        uv = uvicorn.Config(
            build_app(self.config, self.metrics),
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=self.config.shutdown_grace_s,
        )
        self._server = uvicorn.Server(uv)
        self._thread = threading.Thread(target=self._serve, name="halfmoon-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"http server did not start: {self._error or 'timed out'}")
            time.sleep(0.01)
        self.address = f"{host}:{sock.getsockname()[1]}"
        return self.address

    def _serve(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException as exc:  # noqa: BLE001 - start() reports it
            self._error = exc
            log.exception("http server stopped on an error")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.config.shutdown_grace_s + 10.0)
            if self._thread.is_alive():
                log.warning("http server thread did not end in time")
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self.address = ""


def wait_http_healthy(address: str, timeout_s: float, what: str = "http server") -> None:
    """Block until GET http://address/health answers 200 (its conductor is SERVING)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=2.0) as reply:
                if reply.status == 200:
                    return
                last = f"HTTP {reply.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} at {address} not healthy after {timeout_s:.0f} s ({last})")
        time.sleep(0.2)
