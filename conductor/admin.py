"""The conductor's administrative RPCs: Status (workers, loads, store tiers, totals, every
server's memory) and ClearCache (every store node and every prefill worker's device pool)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import psutil

from conductor.config import ConductorConfig
from conductor.fleet import AnyWorker, Fleet
from conductor.metrics import ConductorMetrics, Totals
from conductor.relay import abort
from kvstore import StoreControl
from protos import halfmoon_pb2 as pb
from servekit import memory_usage
from servekit.call_limit import CallLimit

log = logging.getLogger(__name__)

# the deadline of the calls an administrative request makes when its caller set none
ADMIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Identity:
    """What Status says the cluster serves."""

    model_name: str  # the name the model loaded as
    vocab_size: int  # the model's vocabulary
    fingerprint: str  # the weights and KV layout every worker must share


class Admin:
    """Answers Status and ClearCache from the fleet and the store nodes."""

    def __init__(
        self,
        config: ConductorConfig,
        identity: Identity,
        fleet: Fleet,
        metrics: ConductorMetrics,
        totals: Totals,
        call_limit: CallLimit,
    ):
        self.config = config
        self._identity = identity
        self._fleet = fleet
        self._metrics = metrics
        self._totals = totals
        self._call_limit = call_limit  # its refusals at the door are rejections too
        self._process = psutil.Process()

    def status(self) -> pb.StatusReply:
        who = self._identity
        reply = pb.StatusReply(
            model=who.model_name,
            block_size=self.config.block_size,
            default_policy=self.config.policy,
            vocab_size=who.vocab_size,
            conductor_rss_bytes=self._process.memory_info().rss,
            conductor_memory=self._own_memory(),
            model_fingerprint=who.fingerprint,
            kv_dtype=self.config.dtype
            if self.config.kv_cache_dtype == "auto"
            else self.config.kv_cache_dtype,
        )
        with self._fleet.lock:
            for w in self._fleet.workers:
                ws = reply.workers.add(
                    worker_id=w.worker_id, kind=w.kind, address=w.address, healthy=w.healthy
                )
                if w.load is not None:
                    ws.load.CopyFrom(w.load)
            workers = list(zip(self._fleet.workers, reply.workers))
        with self._totals.lock:
            # refused at the door when every Generate slot was taken: rejections too
            rejected = self._totals.rejected + self._call_limit.refused
            reply.requests_total = self._totals.requests + rejected
            reply.requests_rejected = rejected
            reply.prompt_tokens_total = self._totals.prompt_tokens
            reply.cached_tokens_total = self._totals.cached_tokens
            reply.requests_slo_met = self._totals.slo_met
            reply.requests_slo_missed = self._totals.slo_missed
            reply.requests_best_effort = self._totals.best_effort
        self._worker_memory(workers)
        for address in self.config.store_addresses:
            reply.stores.append(self._store_status(address))
        return reply

    def clear_cache(self, context: grpc.ServicerContext) -> pb.ClearCacheReply:
        reply = pb.ClearCacheReply()
        for address in self.config.store_addresses:
            try:
                with self._store(address, self._admin_timeout(context)) as store:
                    reply.store_blocks += store.clear()
            except Exception as exc:  # noqa: BLE001 - a half-cleared cluster must say so
                abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"store {address} could not be cleared: {exc}",
                )
        for w in self._fleet.prefill:
            try:
                cleared = w.stub.ClearCache(
                    pb.ClearCacheRequest(), timeout=self._admin_timeout(context)
                )
            except grpc.RpcError as exc:
                abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"prefill worker {w.worker_id} could not be cleared: {exc.details()}",
                )
            reply.device_blocks += cleared.device_blocks
        return reply

    def _own_memory(self) -> pb.MemoryReport:
        """The conductor's memory; it is configured to hold nothing (no weights, no KV)."""
        m = memory_usage()
        return pb.MemoryReport(rss_bytes=m.rss, uss_bytes=m.uss, pss_bytes=m.pss)

    def _worker_memory(self, workers: list[tuple[AnyWorker, pb.WorkerStatus]]) -> None:
        """Each worker's memory report (a Load that reads /proc), asked of all at once; a worker
        that does not answer shows none (logged, counted)."""
        timeout = self.config.load_timeout_s
        asked = [
            (w, ws, w.stub.Load.future(pb.LoadRequest(memory=True), timeout=timeout))
            for w, ws in workers
        ]
        for w, ws, fut in asked:
            try:
                ws.load.memory.CopyFrom(fut.result().memory)
            except grpc.RpcError as exc:
                self._metrics.errors.labels("worker_memory").inc()
                log.warning("worker %s did not report its memory: %s", w.worker_id, exc.code())

    def _store(self, address: str, timeout_s: float | None = None) -> StoreControl:
        """A control connection to one store node (TLS and the cluster token as configured);
        its calls' deadline `timeout_s`, else a load poll's."""
        return StoreControl(
            address,
            timeout_s=timeout_s or self.config.load_timeout_s,
            security=self.config.security,
        )

    def _admin_timeout(self, context: grpc.ServicerContext) -> float:
        """The deadline for the calls an administrative request makes (ClearCache): what is left
        of the caller's own, not a load poll's. A store's Clear waits up to 2 s for its index to
        hear of it, so with the load poll's 2 s the call raced its own deadline (the demo's replay
        failed on a loaded machine)."""
        left = context.time_remaining()
        return max(left, 0.01) if left is not None else ADMIN_TIMEOUT_S

    def _store_status(self, address: str) -> pb.StoreStatus:
        """One store node's tiers and bulk port; an unreachable store shows up with none (logged,
        counted)."""
        st = pb.StoreStatus(address=address)
        try:
            with self._store(address) as store:
                stats = store.stats()
                st.bulk_port = store.bulk_port()
        except Exception as exc:  # noqa: BLE001 - any failure: report the store empty, say why
            self._metrics.errors.labels("store_status").inc()
            log.warning("store %s did not answer a stats request: %r", address, exc)
            return st
        st.node_id = getattr(stats, "node_id", "")
        for t in getattr(stats, "tiers", []):
            st.tiers.add(
                tier=t.tier,
                used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes,
                blocks=t.blocks,
                hits=t.hits,
                misses=getattr(t, "misses", 0),
                evictions=t.evictions,
            )
        memory = stats.memory  # None from a node in this process
        if memory:
            m = st.memory
            m.rss_bytes, m.uss_bytes, m.pss_bytes, m.configured_bytes = memory
        return st
