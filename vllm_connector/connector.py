"""HalfmoonConnector: halfmoon's store as a KV cache tier of vLLM (its v1 KV connector API).

    --kv-transfer-config '{"kv_connector": "HalfmoonConnector",
        "kv_connector_module_path": "vllm_connector.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"stores": ["127.0.0.1:50051"]}}'

Extra config: `stores` (store node addresses) or `index_url` (the cluster's Redis index: every
live node), `transport` (auto | shm | tcp | grpc, the worker's reads and writes), `queue_mib`
(saves waiting for the store, past which a save is dropped), `model_id` (names the weights when
two instances load them from different paths). Loads are synchronous (before the step's forward,
written into each layer as the forward reaches it); saves are copied out layer by layer as the
forward writes them and sent from a background thread."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_connector.identity import fingerprint, layout_id, weights_id
from vllm_connector.plan import Planner, StepPlan, Stores
from vllm_connector.stats import HalfmoonPromMetrics, HalfmoonStats
from vllm_connector.worker import LayerIO

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_SOURCES = {
    "device": CacheHitSource.DEVICE,
    "dram": CacheHitSource.HOST,
    "ssd": CacheHitSource.DISK,
}


class HalfmoonMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step: its loads and saves."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class HalfmoonConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        if tc.kv_load_failure_policy != "recompute":
            # "fail" would answer a request with an error when a block is lost or corrupt;
            # the store's promise is a miss, and a recompute
            raise ValueError(
                "HalfmoonConnector needs kv_load_failure_policy='recompute' in "
                f"kv_transfer_config (got {tc.kv_load_failure_policy!r})"
            )
        extra = tc.kv_connector_extra_config
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self.block_size = vllm_config.cache_config.block_size
        heads, head_size = mc.get_num_kv_heads(pc), mc.get_head_size()
        layers = mc.get_num_layers(pc)
        dtype = str(mc.dtype).removeprefix("torch.")
        self.fingerprint = fingerprint(
            str(extra.get("model_id") or weights_id(mc.model)),
            layout_id(dtype, layers, heads, self.block_size, head_size),
        )
        stores = [str(a) for a in extra.get("stores", [])]
        self._stores = Stores(stores, str(extra.get("index_url", "")))
        self._planner: Planner | None = None
        self._io: LayerIO | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = Planner(self._stores, self.block_size, self.fingerprint)
        else:
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self._io = LayerIO(
                self.fingerprint,
                self.block_size,
                heads,
                head_size,
                num_blocks,
                transport=str(extra.get("transport", "auto")),
                queue_bytes=int(float(extra.get("queue_mib", 256)) * (1 << 20)),
            )
        log.info(
            "halfmoon connector (%s): stores %s, block %d tokens, fingerprint %s",
            role.name,
            stores or extra.get("index_url"),
            self.block_size,
            self.fingerprint,
        )

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        prompt = list(request.prompt_token_ids or [])
        return self._planner.match(request.request_id, prompt, num_computed_tokens), False

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._planner is not None
        out: dict[CacheHitSource, int] = {}
        for tier, n in self._planner.tiers(request.request_id, num_external_tokens).items():
            source = _SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + n
        return out

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._planner.allocated(request.request_id, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        so = scheduler_output
        new = [
            (r.req_id, list(r.block_ids[0]), r.num_computed_tokens) for r in so.scheduled_new_reqs
        ]
        grown = []
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            added = list(ids[0]) if ids else []
            if req_id in cached.resumed_req_ids:  # its blocks anew, recomputed
                new.append((req_id, added, cached.num_computed_tokens[i]))
            else:
                grown.append((req_id, added, cached.num_computed_tokens[i]))
        return HalfmoonMetadata(self._planner.step(new, grown, dict(so.num_scheduled_tokens)))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        self._planner.finished(request.request_id)
        return False, None  # saves copy their blocks out during the step: free them now

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._io is not None
        self._io.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # bound before every forward; start_load_kv runs after the forward when the step loads
        # nothing, too late to ready its saves
        super().bind_connector_metadata(connector_metadata)
        assert self._io is not None and isinstance(connector_metadata, HalfmoonMetadata)
        self._io.begin_saves(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._io is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, HalfmoonMetadata)
        self._io.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._io is not None
        self._io.layer_loaded(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._io is not None
        self._io.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._io is not None
        self._io.submit()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._io.take_errors() if self._io is not None else set()

    def get_kv_connector_stats(self) -> HalfmoonStats | None:
        if self._io is None:
            return None
        stats = HalfmoonStats(data=self._io.counters.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HalfmoonStats:
        return HalfmoonStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HalfmoonPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._io is not None:
            self._io.close()
        self._stores.close()
