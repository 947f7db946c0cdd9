"""The Ray actor that hosts one halfmoon gRPC server, and the health check the launcher waits on."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servekit import (
    SwitchableConfig,
    configure_server_logging,
    freeze_startup_objects,
    open_channel,
    role_classes,
    server_class,
)


class ServerActor:
    """Hosts one server of a role; created early (imports happen then), started once its config is
    known."""

    def __init__(self, role: str):
        configure_server_logging(role)  # this actor's process is the server's
        self.role = role
        _, self._server_cls = role_classes(role)
        self.server = None
        self.address = ""

    def start(self, config: Any) -> str:
        """Build `Server(config)` and open its gRPC port; returns its address."""
        switchable = isinstance(config, SwitchableConfig)  # a worker that can switch roles
        server_cls = server_class(self.role, config) if switchable else self._server_cls
        self.server = server_cls(config)
        self.address = self.server.start()
        freeze_startup_objects()  # the actor's process is the server's for its life
        return self.address

    def info(self) -> dict:
        import ray

        return {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": self.address,
        }

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def wait_healthy(
    address: str, timeout_s: float, what: str = "server", security: Any = None
) -> None:
    """Block until the standard gRPC health service at `address` answers SERVING; over TLS (with
    this node's certificate under mutual TLS) when `security` (a servekit.SecurityConfig) says."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} at {address} not healthy after {timeout_s:.0f} s ({last})"
                )
            time.sleep(0.2)
