"""The prefill worker: longest cached prefix from every tier, chunked prefill, layer-wise publishing, first token."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from conductor import GrpcServer, PrefillTimeModel, reusable_blocks
from kvstore import Index, StoreClient, block_keys, encode_block
from model import KVPool, load_model, sample
from prefill_node.config import PrefillConfig
from prefill_node.device_cache import DevicePrefixCache
from prefill_node.sampling import sampling_params, torch_dtype
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc


class _Failure(Exception):
    """A request that cannot be served, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class _Job:
    """A queued request and, once its round starts, its prefix, pool blocks and progress."""

    def __init__(self, request: pb.PrefillRequest):
        self.request = request
        self.ids = list(request.token_ids)
        self.arrived = time.perf_counter()
        self.started = 0.0  # when its round took it
        self.done = threading.Event()
        self.cancelled = False
        self.reply: pb.PrefillReply | None = None
        self.error: _Failure | None = None
        self.keys: list[bytes] = []  # block keys of the prompt's full blocks
        self.table: list[int] = []  # pool blocks: the reused prefix, then the new ones
        self.pinned: list[bytes] = []  # device-tier keys held while the job runs
        self.counts = {"device": 0, "dram": 0, "ssd": 0, "remote": 0}  # reused blocks by tier
        self.transfer_ms = 0.0
        self.pos = 0  # next position to compute
        self.logits: torch.Tensor | None = None  # the last computed position's logits
        self.prefill_ms = 0.0  # from the round's first forward to this job's last


class PrefillWorker(GrpcServer, pb_grpc.PrefillWorkerServicer):
    """gRPC `PrefillWorker`: one scheduler thread computes; a publisher thread streams finished layers to the store."""

    def __init__(self, config: PrefillConfig, lm=None):
        GrpcServer.__init__(self, config.host, config.port, config.metrics_port, config.grpc_workers)
        if not config.store_address:
            raise ValueError("PrefillConfig.store_address is required: the KV cache travels to decode workers through the store")
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.dtype = torch_dtype(config.dtype)
        self.lm = lm if lm is not None else load_model(config.model, dtype=self.dtype)
        self.pool = KVPool(self.lm.config, config.num_blocks, config.block_size, self.dtype)
        self.fingerprint = self.lm.fingerprint
        self.device = DevicePrefixCache(self.pool.kv)
        self.timing = PrefillTimeModel()
        self._pool_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._queued: list[_Job] = []  # the jobs in _queue, for load reports
        self._queued_lock = threading.Lock()
        self._current: tuple[float, float] | None = None  # (start, predicted ms) of the round computing now
        self.max_batch_seen = 0  # the most requests one batched forward has carried
        self._store = StoreClient(config.store_address)
        self._publish_store = StoreClient(config.store_address)  # used by the publisher thread only
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{config.worker_id}-publish")
        self._index = Index(config.index_url) if config.index_url else None
        self._remote: dict[str, StoreClient] = {}
        self._thread: threading.Thread | None = None
        self._requests_done = 0
        self._init_metrics()

    # ---- metrics ----

    def _init_metrics(self) -> None:
        r, wid = self.registry, self.config.worker_id
        labels = {"worker": wid}
        self.m_requests = Counter("halfmoon_prefill_requests", "Prefill requests by outcome", ["worker", "outcome"], registry=r)
        self.m_rejected = Counter("halfmoon_prefill_rejections", "Prefill requests refused", ["worker", "reason"], registry=r)
        self.m_cached = Counter("halfmoon_prefill_cached_tokens", "Prompt tokens reused, by tier", ["worker", "tier"], registry=r)
        self.m_computed = Counter("halfmoon_prefill_computed_tokens", "Prompt tokens computed", ["worker"], registry=r).labels(**labels)
        self.m_prefill = Histogram(
            "halfmoon_prefill_seconds", "Prefill time (compute) per request", ["worker"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(**labels)
        self.m_queue = Histogram("halfmoon_prefill_queue_seconds", "Time queued before compute", ["worker"], registry=r).labels(**labels)
        self.m_queued = Gauge("halfmoon_prefill_queued_requests", "Requests waiting", ["worker"], registry=r).labels(**labels)
        self.m_free = Gauge("halfmoon_prefill_free_blocks", "KV pool blocks free", ["worker"], registry=r).labels(**labels)

    # ---- server lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)
        return ["halfmoon.PrefillWorker"]

    def _on_start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"{self.config.worker_id}-prefill", daemon=True)
        self._thread.start()

    def _on_stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._publisher.shutdown(wait=True)
        for c in [self._store, self._publish_store, *self._remote.values()]:
            c.close()
        if self._index is not None:
            self._index.close()

    # ---- RPCs ----

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillReply:
        problem = self._validate(request)
        if problem:
            self.m_rejected.labels(self.config.worker_id, "invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.stopped:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.config.worker_id} is stopping")
        with self._queued_lock:
            if len(self._queued) >= self.config.max_queue:
                self.m_rejected.labels(self.config.worker_id, "queue_full").inc()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill queue full ({self.config.max_queue} requests)")
            job = _Job(request)
            self._queued.append(job)
            self.m_queued.set(len(self._queued))
        self._queue.put(job)
        while not job.done.wait(0.05):
            if not context.is_active():
                job.cancelled = True
                return pb.PrefillReply()
        if job.error is not None:
            context.abort(job.error.code, str(job.error))
        return job.reply

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.WorkerLoad:
        return self.load()

    def ClearCache(self, request: pb.ClearCacheRequest, context: grpc.ServicerContext) -> pb.ClearCacheReply:
        """Drop the device tier's blocks (those a running request holds stay until it ends)."""
        with self._pool_lock:
            ids = self.device.evict(len(self.device))
            self.pool.free(ids)
        self.m_free.set(self.pool.num_free)
        return pb.ClearCacheReply(device_blocks=len(ids))

    def load(self) -> pb.WorkerLoad:
        """The load report the conductor routes by."""
        with self._queued_lock:
            waiting = [len(j.request.token_ids) for j in self._queued]
        predicted = sum(self.timing.predict(t, t) for t in waiting)
        current = self._current
        if current is not None:
            predicted += max(0.0, current[1] - (time.perf_counter() - current[0]) * 1000.0)
        nodes = [n for n in (self.config.store_node, self.config.worker_id) if n]
        return pb.WorkerLoad(
            worker_id=self.config.worker_id, kind="prefill", queued_requests=len(waiting),
            queued_tokens=sum(waiting), predicted_queue_ms=predicted, free_blocks=self.pool.num_free,
            total_blocks=self.pool.num_blocks, prefill_coef=self.timing.coef, nodes=nodes,
            block_bytes=self.pool.block_bytes, block_size=self.pool.block_size,
            model_fingerprint=self.fingerprint, requests_done=self._requests_done, max_batch_seen=self.max_batch_seen,
        )

    def _validate(self, request: pb.PrefillRequest) -> str:
        ids, c = request.token_ids, self.lm.config
        if not ids:
            return "token_ids: empty prompt"
        if len(ids) >= c.max_position_embeddings:
            return f"token_ids: {len(ids)} tokens leave no room in the context window of {c.max_position_embeddings}"
        bad = [t for t in ids if not 0 <= t < c.vocab_size]
        if bad:
            return f"token_ids: id {bad[0]} outside the vocabulary [0, {c.vocab_size})"
        if request.fetch_blocks < 0:
            return f"fetch_blocks: must be >= 0, got {request.fetch_blocks}"
        if request.sampling.max_tokens < 0:
            return f"sampling.max_tokens: must be >= 0, got {request.sampling.max_tokens}"
        return ""

    # ---- the scheduler ----

    def _loop(self) -> None:
        waiting: list[_Job] = []  # jobs put off to the next round
        while True:
            if not waiting:
                job = self._queue.get()
                if job is None:
                    return
                waiting = [job]
            # A round takes waiting requests up to max_batch_tokens, in arrival order.
            batch, tokens = waiting, sum(len(j.ids) for j in waiting)
            while tokens < self.config.max_batch_tokens:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                tokens += len(nxt.ids)
            waiting = self._serve_round(batch)

    def _serve_round(self, batch: list[_Job]) -> list[_Job]:
        """Prepare each job, compute them all together, answer each; returns the jobs put off to the next round."""
        with self._queued_lock:
            for job in batch:
                if job in self._queued:
                    self._queued.remove(job)
            self.m_queued.set(len(self._queued))
        jobs: list[_Job] = []
        later: list[_Job] = []
        computing: set[bytes] = set()  # keys of the blocks this round computes
        for job in batch:
            if job.cancelled:
                job.done.set()
                continue
            if jobs and self._shares_new_blocks(job, computing):
                later.append(job)  # next round it reuses them instead of computing them again
                continue
            job.started = time.perf_counter()
            try:
                self._prepare(job)
            except _Failure as exc:
                self._release(job)
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and jobs:
                    later.append(job)  # the pool is held by this round's jobs: room comes back after it
                else:
                    self._fail(job, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the RPC answers INTERNAL; the worker keeps serving
                self._fail(job, exc)
                continue
            self.m_queue.observe(job.started - job.arrived)
            computing.update(job.keys[job.pos // self.config.block_size :])
            jobs.append(job)
        predicted = sum(self.timing.predict(len(j.ids) - j.pos, len(j.ids)) for j in jobs)
        self._current = (time.perf_counter(), predicted)
        try:
            self._compute(jobs)
        finally:
            self._current = None
        return later

    def _shares_new_blocks(self, job: _Job, computing: set[bytes]) -> bool:
        """Whether a reusable block of the job is one this round computes for an earlier job."""
        r = job.request
        if r.no_cache or not computing:
            return False
        keys = block_keys(job.ids, self.config.block_size, self.fingerprint, r.cache_salt)
        return any(k in computing for k in keys[: reusable_blocks(len(keys), len(job.ids), self.config.block_size)])

    def _answer(self, job: _Job) -> None:
        try:
            job.reply = self._finish(job, queue_ms=(job.started - job.arrived) * 1000.0)
        except Exception as exc:  # noqa: BLE001 - the RPC answers INTERNAL; the worker keeps serving
            self._fail(job, exc)
            return
        self._complete(job, "ok")

    def _fail(self, job: _Job, exc: Exception) -> None:
        """Answer the job with exc's status (INTERNAL unless a _Failure) and give its blocks back."""
        if not isinstance(exc, _Failure):
            exc = _Failure(grpc.StatusCode.INTERNAL, f"prefill failed: {type(exc).__name__}: {exc}")
        job.error = exc
        self._release(job)
        self._complete(job, "error")

    def _release(self, job: _Job) -> None:
        self.device.release(job.pinned)
        self._free(job.table[len(job.pinned) :])
        job.pinned, job.table = [], []

    def _complete(self, job: _Job, outcome: str) -> None:
        self.m_requests.labels(self.config.worker_id, outcome).inc()
        self._requests_done += 1
        self.m_free.set(self.pool.num_free)
        job.done.set()

    # ---- one request ----

    def _allocate(self, n: int) -> list[int]:
        """n pool blocks, evicting device-tier blocks when the pool is short."""
        with self._pool_lock:
            short = n - self.pool.num_free
            if short > 0:
                self.pool.free(self.device.evict(short))
            if n > self.pool.num_free:
                raise _Failure(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prefill worker {self.config.worker_id}: {n} KV blocks needed, {self.pool.num_free} free",
                )
            return self.pool.allocate(n)

    def _free(self, ids: Sequence[int]) -> None:
        if ids:
            with self._pool_lock:
                self.pool.free(list(ids))

    def _remote_client(self, node: str) -> StoreClient | None:
        if node in self._remote:
            return self._remote[node]
        if self._index is None:
            return None
        info = self._index.nodes().get(node)
        if info is None:
            return None
        with torch.inference_mode(False):  # its shm slab tensor is written to later, outside inference mode
            self._remote[node] = StoreClient(info.address)
        return self._remote[node]

    def _pull(self, client: StoreClient, keys: Sequence[bytes], table: list[int]) -> tuple[int, list[str]]:
        """Pull the longest held run of `keys` from a store into new pool blocks appended to `table`."""
        if not keys:
            return 0, []
        found = client.lookup(list(keys))
        n = found.num_blocks
        if n == 0:
            return 0, []
        ids = self._allocate(n)
        staging = torch.empty((n, *self.pool.block_shape), dtype=self.dtype)
        try:
            got = client.get_into(list(keys[:n]), staging)
        except Exception:  # noqa: BLE001 - a failed transfer is a cache miss, recomputed below
            got = 0
        if got:
            self.pool.kv[torch.tensor(ids[:got])] = staging[:got]
        self._free(ids[got:])
        table.extend(ids[:got])
        return got, list(found.tiers[:got])

    def _prepare(self, job: _Job) -> None:
        """Phase 1: the longest cached prefix from every tier into the pool, and pool blocks for the rest."""
        cfg, bs, request = self.config, self.config.block_size, job.request
        t = len(job.ids)
        job.counts = dict.fromkeys(job.counts, 0)  # a job put off to the next round prepares again
        keys = job.keys = block_keys(job.ids, bs, self.fingerprint, request.cache_salt)
        cap = 0 if request.no_cache else reusable_blocks(len(keys), t, bs)
        table = job.table  # extended in place, so that a failure frees what was taken
        if cfg.device_cache and cap:
            table.extend(self.device.match(keys[:cap]))
            job.pinned = list(keys[: len(table)])
            job.counts["device"] = len(table)
        t0 = time.perf_counter()
        if len(table) < cap:
            _, tiers = self._pull(self._store, keys[len(table) : cap], table)
            for tier in tiers:
                job.counts["ssd" if tier == "ssd" else "dram"] += 1
        want = min(cap, request.fetch_blocks) if request.fetch_from else cap
        if len(table) < want:
            remote = self._remote_client(request.fetch_from) if request.fetch_from else self._best_remote(keys[:cap], len(table))
            if remote is not None:
                got, _ = self._pull(remote, keys[len(table) : want], table)
                job.counts["remote"] += got
        job.transfer_ms = (time.perf_counter() - t0) * 1000.0
        job.pos = len(table) * bs
        table.extend(self._allocate(-(-t // bs) - len(table)))

    def _compute(self, jobs: list[_Job]) -> None:
        """Phase 2: batched forwards of up to chunk_size tokens a job; a job is answered once its last position is computed."""
        start = time.perf_counter()
        while True:
            step = [j for j in jobs if j.error is None and j.pos < len(j.ids)]
            if not step:
                return
            spans = [(j.pos, min(len(j.ids), j.pos + self.config.chunk_size)) for j in step]
            c0 = time.perf_counter()
            try:
                logits = self._compute_step(step, spans)
            except Exception as exc:  # noqa: BLE001 - the jobs of this forward fail; the worker keeps serving
                for j in step:
                    self._fail(j, exc)
                continue
            now = time.perf_counter()
            tokens = sum(e - s for s, e in spans)
            # One observation per forward: tokens*context summed over its sequences, as the model's feature.
            self.timing.observe((now - c0) * 1000.0, tokens, sum((e - s) * e for s, e in spans) / tokens)
            self.max_batch_seen = max(self.max_batch_seen, len(step))
            for j, (_, e), lg in zip(step, spans, logits):
                j.pos, j.logits, j.prefill_ms = e, lg, (now - start) * 1000.0
                if e == len(j.ids):
                    self._answer(j)

    def _finish(self, job: _Job, queue_ms: float) -> pb.PrefillReply:
        """Phase 3: every full block in the store, the first token, the tail block; blocks kept as the device tier."""
        cfg, bs, request = self.config, self.config.block_size, job.request
        t = len(job.ids)
        self.m_prefill.observe(job.prefill_ms / 1000.0)
        t1 = time.perf_counter()
        self._ensure_stored(job.keys, job.table)
        job.transfer_ms += (time.perf_counter() - t1) * 1000.0
        sp = sampling_params(request.sampling)
        first = int(sample(job.logits, [sp], [sp.generator()])[0])
        tail_tokens = t % bs
        tail = b""
        if tail_tokens:
            tail = encode_block(self.pool.kv[job.table[-1]][:, :, :tail_tokens].contiguous(), self.fingerprint)
        table, pinned = job.table, job.pinned
        job.table, job.pinned = [], []  # _keep owns them now
        self._keep(job.keys, table, pinned)
        counts = job.counts
        for tier, n in counts.items():
            if n:
                self.m_cached.labels(cfg.worker_id, tier).inc(n * bs)
        reused = sum(counts.values())
        computed = t - reused * bs
        self.m_computed.inc(computed)
        handle = pb.KVHandle(
            block_keys=job.keys, store_node=cfg.store_node, store_address=cfg.store_address,
            num_tokens=t, tail=tail, tail_tokens=tail_tokens,
        )
        return pb.PrefillReply(
            first_token=first, handle=handle, cached_device_tokens=counts["device"] * bs,
            cached_dram_tokens=counts["dram"] * bs, cached_ssd_tokens=counts["ssd"] * bs,
            cached_remote_tokens=counts["remote"] * bs, computed_tokens=computed,
            queue_ms=queue_ms, prefill_ms=job.prefill_ms, transfer_ms=job.transfer_ms,
        )

    def _best_remote(self, keys: Sequence[bytes], have: int) -> StoreClient | None:
        """With no hint from the conductor: the index's longest holder other than this host, if longer."""
        if self._index is None or not keys:
            return None
        matches = self._index.longest_prefix(list(keys))
        best, best_n = "", have
        for node, found in matches.items():
            n = found[0] if isinstance(found, tuple) else found.num_blocks
            if node not in (self.config.store_node, self.config.worker_id) and n > best_n:
                best, best_n = node, n
        return self._remote_client(best) if best else None

    def _compute_step(self, step: list[_Job], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One forward over each job's positions [s, e); the full blocks it completes go to the store, layer by layer."""
        writers = [w for w in (self._open_writer(j, s, e) for j, (s, e) in zip(step, spans)) if w is not None]
        pending: list[list[Future]] = [[] for _ in writers]  # per writer

        def on_layer(layer: int) -> None:
            # The gather copies this layer now; the publisher thread sends it while later layers compute.
            for (w, ids), futures in zip(writers, pending):
                futures.append(self._publisher.submit(w.write_layer, layer, self.pool.kv[ids, layer]))

        seqs = [(torch.tensor(j.ids[s:e], dtype=torch.long), j.table, s) for j, (s, e) in zip(step, spans)]
        try:
            logits = self.lm.model.prefill_batch(seqs, self.pool, on_layer_done=on_layer if writers else None)
        except BaseException:
            for w, _ in writers:
                self._publisher.submit(w.abort).result()
            raise
        for (w, _), futures in zip(writers, pending):
            futures.append(self._publisher.submit(w.commit))
        for (w, _), futures in zip(writers, pending):
            try:
                for f in futures:
                    f.result()
            except Exception:  # noqa: BLE001 - publishing is best effort: _ensure_stored retries with a plain put
                try:
                    self._publisher.submit(w.abort).result()
                except Exception:  # noqa: BLE001
                    pass
        return logits

    def _open_writer(self, job: _Job, s: int, e: int):
        """(a layer-wise store writer, its pool block ids) for the full blocks [s, e) completes; None if none or off."""
        bs = self.config.block_size
        first_block, end_block = s // bs, e // bs
        new_keys = job.keys[first_block:end_block]
        if not new_keys or not self.config.layerwise:
            return None
        parent = job.keys[first_block - 1] if first_block else None
        try:
            writer = self._publish_store.open_put(new_keys, self.pool.block_shape, self.dtype, self.fingerprint, parent=parent)
        except Exception:  # noqa: BLE001 - store full or away: compute anyway; _ensure_stored tries again
            return None
        return writer, torch.tensor(job.table[first_block:end_block], dtype=torch.long)

    def _ensure_stored(self, keys: list[bytes], table: list[int]) -> None:
        """Every full block of the prompt in the host's store, so a decode worker can pull them all."""
        if not keys:
            return
        held = self._store.lookup(keys).num_blocks
        if held < len(keys):
            idx = torch.tensor(table[held : len(keys)], dtype=torch.long)
            try:
                self._store.put(keys[held:], self.pool.kv[idx], self.fingerprint, parent=keys[held - 1] if held else None)
            except Exception:  # noqa: BLE001 - the decode worker recomputes what it cannot pull: slower, never wrong
                pass

    def _keep(self, keys: list[bytes], table: list[int], pinned: list[bytes]) -> None:
        """After a request: full blocks stay resident as the device tier; the tail block is freed."""
        n = len(keys)
        self.device.release(pinned)
        fresh_keys, fresh_ids = keys[len(pinned) : n], table[len(pinned) : n]
        rest = table[n:]
        if self.config.device_cache:
            rest = rest + self.device.insert(fresh_keys, fresh_ids)
        else:
            rest = rest + fresh_ids
        self._free(rest)

