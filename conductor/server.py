"""The conductor's gRPC service: it loads what describes the model (never its weights), builds
its parts (the fleet, the index lookups, routing, preparation, the relay, the admin RPCs) and
hands each call to the part whose job it is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import grpc

from conductor.admin import Admin, Identity
from conductor.config import ConductorConfig
from conductor.fleet import Fleet, LoadPoller
from conductor.generate import RequestFlow
from conductor.metrics import ConductorMetrics, Totals
from conductor.prefixes import PrefixIndex
from conductor.prepare import Preparer
from conductor.recent import RecentRequests
from conductor.relay import Relay
from conductor.role_switch import RoleSwitcher
from conductor.routing import Router, make_policies
from model import ModelConfig, Tokenizer, kv_fingerprint, load_model_info
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import GrpcServer, kv_cache_layout_id, release_freed_heap


class ModelDescription(Protocol):
    """What the conductor takes of a model: model.ModelInfo, or a LoadedModel a test holds."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def config(self) -> ModelConfig: ...
    @property
    def name(self) -> str: ...
    @property
    def weights_id(self) -> str: ...


class _Configured(Protocol):
    config: ConductorConfig


class Conductor(GrpcServer, pb_grpc.ConductorServicer):
    """gRPC `Conductor`: Generate (server-streaming), Status, ClearCache and RecentTrace."""

    # what an API token may call; ClearCache wipes every tenant's cache and RecentTrace shows
    # every tenant's requests: the cluster token only
    client_methods = frozenset({"/halfmoon.Conductor/Generate", "/halfmoon.Conductor/Status"})
    data_methods = frozenset({"/halfmoon.Conductor/Generate"})  # a stream holds a thread

    def __init__(self, config: ConductorConfig, lm: ModelDescription | None = None):
        GrpcServer.__init__(
            self, config.host, config.port, config.metrics_port, config.grpc_workers
        )
        self._config = config
        # Only the tokenizer and the architecture: the conductor never touches tensors, and its
        # process never imports torch. A test may hand over a LoadedModel it already holds.
        if lm is None:
            lm = load_model_info(config.model)
            # building the tokenizer from the checkpoint's vocabulary frees ~40 MiB that glibc
            # would otherwise keep for the process's life
            release_freed_heap()
        self.tokenizer = lm.tokenizer
        self.model_config = lm.config
        self.model_name = lm.name
        # Block keys chain from the weights and the layout the workers store blocks in (KV cache
        # type, dtype and shape), so the fingerprint is the weights id and that layout.
        layout_id = kv_cache_layout_id(lm.config, config, config.dtype)
        self.fingerprint = kv_fingerprint(lm.weights_id, layout_id)
        policies = make_policies(config)  # an unknown default policy fails before any channel
        self.metrics = ConductorMetrics(self.registry)
        self.totals = Totals()
        self.fleet = Fleet(config, self.fingerprint, self.metrics)
        self.prefixes = PrefixIndex(config, self.metrics)
        self.router = Router(config, policies, self.fleet, self.prefixes, self.registry)
        self.preparer = Preparer(config, lm.tokenizer, lm.config, lm.name, policies)
        self.relay = Relay(config, self.fleet, self.metrics, self.totals)
        self.recent = RecentRequests(config.recent_requests)  # the offered load, as a trace
        self.requests = RequestFlow(
            config,
            self.fingerprint,
            preparer=self.preparer,
            router=self.router,
            relay=self.relay,
            fleet=self.fleet,
            metrics=self.metrics,
            totals=self.totals,
            recent=self.recent,
        )
        # the runtime planner: moves workers between roles when configured (role_switching)
        self.role_switcher = RoleSwitcher(config, self.fleet, self.router, self.totals,
                                          self.metrics)  # fmt: skip
        identity = Identity(lm.name, lm.config.vocab_size, self.fingerprint)
        self.admin = Admin(config, identity, self.fleet, self.metrics, self.totals, self.call_limit)
        # Looked up at each refresh: a wrapper set on the conductor's refresh_loads (a test
        # counting refreshes) is what the poller runs.
        self._poller = LoadPoller(self.fleet, lambda: self.refresh_loads())
        self._configured: list[_Configured] = [
            self.fleet,
            self.prefixes,
            self.router,
            self.preparer,
            self.relay,
            self.requests,
            self.admin,
            self.role_switcher,
        ]

    @property
    def config(self) -> ConductorConfig:
        return self._config

    @config.setter
    def config(self, config: ConductorConfig) -> None:
        # Settings replaced while it serves (a test tightening the SLOs) reach every part.
        self._config = config
        for part in self._configured:
            part.config = config

    # ---- lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_ConductorServicer_to_server(self, server)
        return ["halfmoon.Conductor"]

    def _on_start(self) -> None:
        self.refresh_loads()
        self._poller.start()
        self.role_switcher.start()

    def _on_stop(self) -> None:
        self.role_switcher.stop()
        self._poller.stop()
        self.fleet.close()
        self.prefixes.close()

    def refresh_loads(self) -> None:
        """Ask every worker for its load (in parallel); one that does not answer is out of
        routing."""
        self.fleet.refresh_loads()

    # ---- the RPCs ----

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        """Route, prefill, decode; when the decode worker is lost, resume on another pair from
        the tokens already sent."""
        return self.requests.run(request, context)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.admin.status()

    def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.ServicerContext
    ) -> pb.ClearCacheReply:
        return self.admin.clear_cache(context)

    def RecentTrace(
        self, request: pb.RecentTraceRequest, context: grpc.ServicerContext
    ) -> pb.RecentTraceReply:
        c = self.config
        reply = self.recent.reply(request.limit, c.block_size)
        reply.ttft_slo_ms = c.ttft_slo_ms
        reply.tbt_slo_ms = c.tbt_slo_ms
        reply.tpot_slo_ms = c.tpot_slo_ms
        reply.prefill_workers = len(self.fleet.prefill)
        reply.decode_workers = len(self.fleet.decode)
        reply.models.extend(self.fleet.models())
        reply.refused_at_door = self.call_limit.refused
        return reply
