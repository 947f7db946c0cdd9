"""The prefill runner: the model, the paged pool and the KV connector; prepares a job's prefix,
runs batched forwards, and builds a job's answer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc
import torch

from kernels import ReleasingThreadPool
from kvstore import block_keys
from kvstore.client import CACHEGEN_LEVELS, ChunkPlan, KVConnector
from model import KVPool, sample
from prefill_node.config import PrefillConfig
from prefill_node.job import Failure, PrefillJob
from prefill_node.metrics import PrefillMetrics
from protos import halfmoon_pb2 as pb
from servekit import LinearTimeModel, cpu_turns, predict, prefill_features, reusable_blocks
from servekit.worker import load_worker_model, sampling_params

log = logging.getLogger(__name__)


class PrefillRunner:
    """Owns the model and the pool; the scheduler calls prepare -> compute_step* -> finish."""

    def __init__(self, config: PrefillConfig, metrics: PrefillMetrics, registry, lm=None):
        self.config = config
        self.metrics = metrics
        wm = load_worker_model(config, lm)
        self.device, self.lm, self.fingerprint = wm.device, wm.lm, wm.fingerprint
        # Prefill computes in full precision; blocks are stored as the KV cache type says
        # (KIVI: packed as they leave), and the residual window travels inline unpacked.
        self.store_layout = wm.layout
        self.window_blocks = getattr(wm.layout, "residual", 0) // config.block_size
        # A full-precision cache is computed into in its own dtype (fp16/bf16 under fp32 compute);
        # KIVI's prefill pool holds the compute dtype and packs on the way out.
        full = wm.layout.name != "kivi"  # full K/V or an MLA latent: the pool is the layout
        self.pool = KVPool(
            wm.lm.config,
            config.num_blocks,
            config.block_size,
            wm.layout.dtype if full else wm.dtype,
            device=self.device,
            layout=wm.layout if full else None,
        )
        self._pool_lock = threading.Lock()
        self.fetch_block_bytes = 0.0  # bytes per block a fetch moves (set below)
        # CacheGen codes K and V blocks [L, 2, T, H, D]: not KIVI-packed or MLA-latent pools
        self.cachegen = wm.layout.name == "full" and self.pool.kv.dim() == 6
        if (config.cachegen_levels or config.cachegen_fetch) and not self.cachegen:
            log.warning(
                "%s: CacheGen is off: it codes per-head K/V blocks, this pool holds %s blocks",
                config.worker_id,
                wm.layout.name,
            )
        self.kv = KVConnector(
            self.pool.kv,
            self.pool.layout,
            self.fingerprint,
            config.store_address,
            store_node=config.store_node,
            index_url=config.index_url,
            device_node=config.worker_id if config.device_cache else "",
            worker=config.worker_id,
            registry=registry,
            store_layout=self.store_layout,
            security=config.security,
            timeout_s=config.kv_timeout_s,
        )
        # a block at the store's codec, until a CacheGen fetch says what its chunks move
        self.fetch_block_bytes = float(self.kv.wire_block_bytes)
        # forwards take turns at the CPUs with the host's other workers on them
        self.turns = cpu_turns(config, registry, self.device)
        self.turn_wait_ms = 0.0  # the last forward's wait for its turn
        # the store checks of the jobs one forward finished, side by side (store_all)
        self._storing = ReleasingThreadPool(
            max_workers=4, thread_name_prefix=f"{config.worker_id}-store"
        )

    def close(self) -> None:
        self._storing.shutdown(wait=True)
        self.kv.close()

    # ---- the pool ----

    def allocate(self, n: int) -> list[int]:
        """n pool blocks, evicting device-tier blocks when the pool is short."""
        with self._pool_lock:
            short = n - self.pool.num_free
            if short > 0:
                self.pool.free(self.kv.evict_device(short))
            if n > self.pool.num_free:
                raise Failure(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prefill worker {self.config.worker_id}: {n} KV blocks needed, "
                    f"{self.pool.num_free} free",
                )
            return self.pool.allocate(n)

    def free(self, ids: Sequence[int]) -> None:
        if ids:
            with self._pool_lock:
                self.pool.free(list(ids))
        self.metrics.free.set(self.pool.num_free)

    def clear_device(self) -> int:
        """Drop the device tier's blocks (those a running request holds stay); how many."""
        ids = self.kv.evict_device(self.kv.device_blocks())
        self.free(ids)
        return len(ids)

    def release(self, job: PrefillJob) -> None:
        """Give back everything a job holds (it failed or was put off)."""
        self.kv.drop(job.table, job.pinned, self.free)
        job.pinned, job.table = [], []

    # ---- one request ----

    def keys_of(self, job: PrefillJob) -> list[bytes]:
        r = job.request
        return block_keys(job.ids, self.config.block_size, self.fingerprint, r.cache_salt)

    def reusable(self, job: PrefillJob, keys: list[bytes]) -> int:
        """Blocks of the prompt this request may reuse (none under cache_off)."""
        if job.request.no_cache:
            return 0
        return reusable_blocks(len(keys), len(job.ids), self.config.block_size)

    def prepare(self, job: PrefillJob, timing: LinearTimeModel) -> None:
        """The prefix the decision names into the pool (own tiers; `fetch_from` for
        `fetch_blocks`, nothing else remote: as raw blocks, or with cachegen_fetch as CacheGen
        chunks at the levels the link and the TTFT budget allow), and pool blocks for the rest."""
        cfg, bs, r = self.config, self.config.block_size, job.request
        keys = job.keys = self.keys_of(job)
        cap = self.reusable(job, keys)
        chunked = self.cachegen and cfg.cachegen_fetch and r.fetch_from
        loaded = self.kv.load_prefix(
            keys,
            cap,
            "" if chunked else r.fetch_from,
            0 if chunked else r.fetch_blocks,
            self.allocate,
            self.free,
        )
        job.table, job.pinned = loaded.table, loaded.pinned
        job.counts, job.transfer_ms = loaded.counts, loaded.transfer_ms
        job.fetched_bytes, job.fetch_ms = loaded.fetched_bytes, loaded.fetch_ms
        if chunked:
            try:
                self._fetch_chunks(job, min(cap, r.fetch_blocks), timing)
            except BaseException:
                self.kv.drop(job.table, job.pinned, self.free)
                job.table, job.pinned = [], []
                raise
        job.pos = len(job.table) * bs
        job.table.extend(self.allocate(-(-len(job.ids) // bs) - len(job.table)))

    def _fetch_chunks(self, job: PrefillJob, want: int, timing: LinearTimeModel) -> None:
        """CacheGen streaming of blocks [len(job.table), want) from the decision's node. The
        budget: the request's TTFT budget left, less the predicted compute of what follows the
        fetched prefix; no budget sent = no deadline."""
        cfg, bs, r = self.config, self.config.block_size, job.request
        n = len(job.ids)
        rest_ms = predict(timing.coef, prefill_features(n - want * bs, n))
        chunk_tokens = cfg.cachegen_chunk_blocks * bs
        deadline = (
            job.arrived + (r.deadline_ms - rest_ms) / 1000.0 if r.deadline_ms > 0 else float("inf")
        )
        plan = ChunkPlan(
            levels=tuple(CACHEGEN_LEVELS),
            chunk_blocks=cfg.cachegen_chunk_blocks,
            deadline=deadline,
            # the marginal cost of one more chunk in the forward that runs anyway (no fixed part)
            recompute_s_per_chunk=predict(
                timing.coef, [0.0, *prefill_features(chunk_tokens, want * bs)[1:]]
            )
            / 1000.0,
            prior_bytes_per_s=cfg.cachegen_prior_gbps * 1e9 / 8,
        )
        before = len(job.table)
        got = self.kv.fetch_chunks(r.fetch_from, job.keys, job.table, want, self.allocate, plan)
        job.counts["remote"] += len(job.table) - before
        job.transfer_ms += got.ms
        job.cachegen_levels, job.fetched_bytes, job.fetch_ms = got.levels, got.bytes, got.ms
        if got.blocks:
            self.fetch_block_bytes = got.bytes / got.blocks

    @torch.inference_mode()
    def compute_step(self, step: list[PrefillJob], spans: list[tuple[int, int]]) -> list:
        """One forward over each job's positions [s, e); the full blocks it completes go to the
        store layer by layer while later layers compute. Last-position logits per job (CPU)."""
        bs = self.config.block_size
        # (job, its first and end block, the publisher of those blocks)
        publishing = [
            (j, s // bs, e // bs, p)
            for j, (s, e) in zip(step, spans)
            if (p := self._publisher(j, s, e)) is not None
        ]

        shared_s = 0.0

        def on_layer(layer: int) -> None:
            nonlocal shared_s
            for *_, p in publishing:
                p.layer_done(layer)
            # a decode step waiting for the CPUs runs between two layers (CpuTurns.share)
            shared_s += self.turns.share()

        seqs = [
            (torch.tensor(j.ids[s:e], dtype=torch.long), j.table, s)
            for j, (s, e) in zip(step, spans)
        ]
        ok = False
        try:
            with self.turns.turn() as waited:
                logits = self.lm.model.prefill_batch(seqs, self.pool, on_layer_done=on_layer)
            self.turn_wait_ms = (waited + shared_s) * 1000.0
            ok = True
        finally:
            for job, first, end, p in publishing:
                # blocks the store confirmed from the job's first on need no lookup at its end
                if p.finish(ok) and first <= job.stored_blocks:
                    job.stored_blocks = max(job.stored_blocks, end)
        return [lg.float().cpu() for lg in logits]

    def _publisher(self, job: PrefillJob, s: int, e: int):
        """A layer-wise publisher for the full blocks [s, e) completes; None if none or off."""
        if not self.config.layerwise:
            return None
        bs = self.config.block_size
        first, end = s // bs, e // bs
        parent = job.keys[first - 1] if first else None
        return self.kv.open_layerwise(job.keys[first:end], job.table[first:end], parent)

    def store_all(self, jobs: Sequence[PrefillJob]) -> None:
        """Every full block of each job in this host's store, for decode workers to pull: the
        jobs a forward finished check (and fill) their blocks side by side. One by one, a burst
        of 16 short prompts answered its last job ~150 ms after its first, each store lookup
        waiting for the one before."""

        def store(job: PrefillJob) -> None:
            t1 = time.perf_counter()
            # a job whose forwards' commits confirmed every block (a cold prompt's whole
            # publish) needs no lookup round trip before its answer
            if job.stored_blocks < len(job.keys):
                self.kv.ensure_stored(job.keys, job.table)
            job.transfer_ms += (time.perf_counter() - t1) * 1000.0
            job.stored = True

        if len(jobs) == 1:
            store(jobs[0])
            return
        for f in [self._storing.submit(store, j) for j in jobs]:
            f.result()

    def finish(self, job: PrefillJob) -> pb.PrefillReply:
        """Every full block in the store, the first token, the tail block inline; the full
        blocks stay as the device tier."""
        cfg, bs, r = self.config, self.config.block_size, job.request
        t = len(job.ids)
        self.metrics.prefill.observe(job.prefill_ms / 1000.0)
        if not job.stored:
            self.store_all([job])
        if self.cachegen and cfg.cachegen_levels:  # copied now, encoded in the background
            self.kv.publish_chunks(
                job.keys, job.table, cfg.cachegen_levels, cfg.cachegen_chunk_blocks
            )
        sp = sampling_params(r.sampling)
        first = int(sample(job.logits, [sp], [sp.generator()])[0])
        # Inline, in full precision: the partial block and, with KIVI, the residual window's
        # full blocks (stored packed too, for whoever reuses the prefix).
        window = min(len(job.keys), self.window_blocks)
        tail_tokens = window * bs + t % bs
        first_inline = len(job.keys) - window
        tail = self.kv.encode_tail(job.table[first_inline:], tail_tokens) if tail_tokens else b""
        table, pinned = job.table, job.pinned
        job.table, job.pinned = [], []  # the device tier owns them now
        self.kv.keep(job.keys, table, pinned, self.free)
        counts = job.counts
        for tier, n in counts.items():
            if n:
                self.metrics.cached.labels(cfg.worker_id, tier).inc(n * bs)
        computed = t - sum(counts.values()) * bs
        self.metrics.computed.inc(computed)
        handle = pb.KVHandle(
            block_keys=job.keys,
            store_node=cfg.store_node,
            store_address=cfg.store_address,
            num_tokens=t,
            tail=tail,
            tail_tokens=tail_tokens,
            window_blocks=window,
        )
        return pb.PrefillReply(
            first_token=first,
            handle=handle,
            cached_device_tokens=counts["device"] * bs,
            cached_dram_tokens=counts["dram"] * bs,
            cached_ssd_tokens=counts["ssd"] * bs,
            cached_remote_tokens=counts["remote"] * bs,
            computed_tokens=computed,
            queue_ms=job.queue_ms,
            prefill_ms=job.prefill_ms,
            transfer_ms=job.transfer_ms,
            cachegen_levels=job.cachegen_levels,
            fetched_bytes=job.fetched_bytes,
            fetch_ms=job.fetch_ms,
        )
