"""What every halfmoon gRPC server shares: start/stop, the standard health service, a Prometheus endpoint, config loading."""

from __future__ import annotations

import abc
import dataclasses
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any] | None) -> C:
    """A config dataclass from a mapping (a YAML section); unknown keys are an error, not a silent typo."""
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    return cls(**data)


def config_from_yaml(cls: type[C], path: str | Path, section: str | None = None) -> C:
    """A config dataclass from a YAML file (or one top-level section of it)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    return config_from_dict(cls, data.get(section) if section else data)


class GrpcServer(abc.ABC):
    """A gRPC server with the health service and an optional Prometheus endpoint (its own registry)."""

    def __init__(self, host: str, port: int, metrics_port: int = 0, max_workers: int = 32):
        self._host, self._port, self._metrics_port, self._max_workers = host, port, metrics_port, max_workers
        self.registry = CollectorRegistry()
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._metrics_http = None
        self._stopped = threading.Event()
        self.address = ""
        self.metrics_address = ""

    @abc.abstractmethod
    def _add_services(self, server: grpc.Server) -> list[str]:
        """Register this server's servicers; return their full service names (for health)."""
        ...

    def _on_start(self) -> None:
        """Start background threads (called before the port opens)."""

    def _on_stop(self) -> None:
        """Stop background threads (called after the port closes)."""

    def start(self) -> str:
        """Open the port and serve; returns "HOST:PORT"."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers),
            options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)],
        )
        names = self._add_services(server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = server.add_insecure_port(f"{self._host}:{self._port}")
        if port == 0:
            raise OSError(f"cannot listen on {self._host}:{self._port}")
        self._on_start()
        server.start()
        for name in ["", *names]:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.address = f"{self._host}:{port}"
        if self._metrics_port:
            httpd, _ = start_http_server(self._metrics_port, addr=self._host, registry=self.registry)
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
