"""A worker that can change role without reloading its weights: it holds the loaded model and a
config for each role, serves one role's server, and answers WorkerRole.SwitchRole on the same
port. A switch stops the current server once its calls are done (gRPC's graceful stop), then
starts the other role's server on the same port with the same model: the conductor's runtime
planner (conductor/role_switch.py) drains the worker first, and a worker with work left
refuses. The weights keep the packed form of the role the worker started in (same values)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import grpc

from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit.roles import WORKER_ROLES, SwitchableConfig, role_classes, work_left
from servekit.worker.model import load_worker_model

log = logging.getLogger(__name__)

SWITCH_GRACE_S = 30.0  # a call still running when the server stops gets this long to finish


class SwitchableWorker(pb_grpc.WorkerRoleServicer):
    """`SwitchableWorker(config, lm=None).start()` -> "HOST:PORT"; `.stop()`. `role` and `server`
    are the role served now and its server (a prefill_node.PrefillWorker or a
    decode_node.DecodeWorker)."""

    def __init__(self, config: SwitchableConfig, lm=None):
        self.config = config
        self.role = config.role
        first = config.of(config.role)
        self.lm = lm if lm is not None else load_worker_model(first).lm
        self._lock = threading.Lock()  # the role, the server, a switch under way
        self._switching: threading.Thread | None = None
        self._stopped = False
        self.switches = 0  # switches completed
        self.server = self._build(self.role, first)
        self.address = ""

    def _build(self, role: str, config: Any):
        _, server_cls = role_classes(role)
        server = server_cls(config, lm=self.lm)
        server.extra_services.append(self._add_service)
        return server

    def _add_service(self, server: grpc.Server) -> str:
        pb_grpc.add_WorkerRoleServicer_to_server(self, server)
        return "halfmoon.WorkerRole"

    # ---- lifecycle ----

    def start(self) -> str:
        self.address = self.server.start()
        # the other role binds the same port: the conductor's channel finds it there
        port = int(self.address.rsplit(":", 1)[1])
        for role in WORKER_ROLES:
            setattr(self.config, role, dataclasses.replace(self.config.of(role), port=port))
        return self.address

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            thread = self._switching
        if thread is not None:
            thread.join(timeout=SWITCH_GRACE_S + 60)
        with self._lock:
            self.server.stop()

    # ---- the RPC ----

    def SwitchRole(
        self, request: pb.SwitchRoleRequest, context: grpc.ServicerContext
    ) -> pb.SwitchRoleReply:
        role = request.role
        if role not in WORKER_ROLES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"SwitchRoleRequest.role: prefill or decode, not {role!r}",
            )
        with self._lock:
            if self._switching is not None and self._switching.is_alive():
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a role switch is under way")
            if self._stopped:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
            if role == self.role:
                return pb.SwitchRoleReply(role=role, switching=False, message=f"already {role}")
            left = work_left(self.server.load())
            if left:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"worker {self.config.worker_id} still holds {left} request(s) as "
                    f"{self.role}: drain it before switching its role",
                )
            old = self.role
            self._switching = threading.Thread(
                target=self._switch, args=(role,), name="role-switch", daemon=True
            )
            self._switching.start()
        log.info("worker %s: switching from %s to %s", self.config.worker_id, old, role)
        return pb.SwitchRoleReply(role=role, switching=True, message=f"{old} -> {role}")

    def _switch(self, role: str) -> None:
        """Stop the current server (this call's answer goes out first: a graceful stop lets
        running calls end), then serve `role` on the same port; if that fails, serve the old
        role again."""
        with self._lock:
            old_role, old = self.role, self.server
            old.stop(grace=SWITCH_GRACE_S)
            self.server = old = None  # its pool goes before the next role's is allocated
            try:
                self.server = self._build(role, self.config.of(role))
                self.server.start()
                self.role = role
                self.switches += 1
                log.info("worker %s now serves %s at %s", self.config.worker_id, role,
                         self.address)  # fmt: skip
            except Exception:
                log.exception("worker %s could not start as %s: serving %s again",
                              self.config.worker_id, role, old_role)  # fmt: skip
                self.server = self._build(old_role, self.config.of(old_role))
                self.server.start()
