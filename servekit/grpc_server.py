"""The gRPC server scaffold every halfmoon server stands on: start/stop, health, a Prometheus
endpoint, and access control (TLS and bearer tokens, from the config's `security` section)."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, ClassVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server

from servekit.call_limit import CONTROL_THREADS, CallLimit
from servekit.security import SecurityConfig, add_port, server_interceptors

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


class GrpcServer(abc.ABC):
    """A gRPC server with the health service and an optional Prometheus endpoint (its own
    registry)."""

    # Methods ("/pkg.Service/Method") a client's API token may call; the rest are internal to the
    # cluster (cluster token). A server with any is client-facing: no client certificates asked.
    client_methods: ClassVar[frozenset[str]] = frozenset()
    # Methods that hold a thread while they wait (streams, queued work): at most `data_calls` of
    # them run at once, the next is refused with RESOURCE_EXHAUSTED (servekit.call_limit), and
    # the pool has CONTROL_THREADS more, so health, Load and Status always find a thread.
    data_methods: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, host: str, port: int, metrics_port: int = 0, data_calls: int = 32):
        self._host, self._port, self._metrics_port = host, port, metrics_port
        self.registry = CollectorRegistry()
        busy = Counter(
            "halfmoon_busy_refusals",
            "Data calls refused at once (RESOURCE_EXHAUSTED): every slot was taken",
            registry=self.registry,
        )
        self.call_limit = CallLimit(self.data_methods, data_calls, type(self).__name__, busy.inc)
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._metrics_http: WSGIServer | None = None
        self._stopped = threading.Event()
        self.address = ""
        self.metrics_address = ""
        # Services a host adds beside the server's own (servekit.worker.SwitchableWorker's
        # WorkerRole): each registers its servicer on the server and returns its service name
        self.extra_services: list[Callable[[grpc.Server], str]] = []

    @abc.abstractmethod
    def _add_services(self, server: grpc.Server) -> list[str]:
        """Register this server's servicers; return their full service names (for health)."""
        ...

    def _on_start(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """Start background threads (called before the port opens)."""

    def _on_stop(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """Stop background threads (called after the port closes)."""

    def security(self) -> SecurityConfig:
        """The access settings: the server config's `security` section (none: all open)."""
        return getattr(getattr(self, "config", None), "security", None) or SecurityConfig()

    def start(self) -> str:
        """Open the port and serve; returns "HOST:PORT"."""
        security = self.security()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.call_limit.limit + CONTROL_THREADS),
            options=[
                ("grpc.max_send_message_length", 256 << 20),
                ("grpc.max_receive_message_length", 256 << 20),
            ],
            # access first: a refused caller takes no data-call slot
            interceptors=[*server_interceptors(security, self.client_methods), self.call_limit],
        )
        names = self._add_services(server) + [add(server) for add in self.extra_services]
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{self._host}:{self._port}"
        port = add_port(server, address, security, client_facing=bool(self.client_methods))
        if port == 0:
            raise OSError(f"cannot listen on {self._host}:{self._port}")
        self._on_start()
        server.start()
        for name in ["", *names]:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.address = f"{self._host}:{port}"
        if self._metrics_port:
            httpd, _ = start_http_server(
                self._metrics_port, addr=self._host, registry=self.registry
            )
            self._metrics_http = httpd
            self.metrics_address = f"{self._host}:{httpd.server_address[1]}"
        return self.address

    def stop(self, grace: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self._on_stop()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()
