"""The decode worker: background KV pull, continuous batching over one paged pool, token streaming, publish at the end."""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from conductor import DecodeTimeModel, GrpcServer
from decode_node.config import DecodeConfig
from kvstore import StoreClient, block_keys, decode_block
from model import KVPool, load_model, sample
from prefill_node import sampling_params, torch_dtype
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc


class _Seq:
    """One sequence from arrival to the end of its stream."""

    def __init__(self, request: pb.DecodeRequest, budget: int, need_blocks: int):
        self.request = request
        self.prompt = list(request.prompt_ids)
        self.params = sampling_params(request.sampling)
        self.generator = self.params.generator()
        self.budget = budget                    # new tokens allowed (max_tokens, capped by the context window)
        self.need_blocks = need_blocks          # pool blocks reserved at admission: enough for the whole answer
        self.out = [request.first_token]        # generated tokens; the last one's KV is not computed yet
        self.table: list[int] = []
        self.events: queue.Queue = queue.Queue()
        self.arrived = time.perf_counter()
        self.cancelled = False
        self.pull: Future | None = None
        self.transfer_ms = 0.0
        self.recomputed = 0

    @property
    def position(self) -> int:
        """Where the next fed token (the last generated one) goes."""
        return len(self.prompt) + len(self.out) - 1

    def ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000.0


class DecodeWorker(GrpcServer, pb_grpc.DecodeWorkerServicer):
    """gRPC `DecodeWorker`: a step-loop thread runs one decode forward per step for all running sequences."""

    def __init__(self, config: DecodeConfig, lm=None):
        GrpcServer.__init__(self, config.host, config.port, config.metrics_port, config.grpc_workers)
        if not config.store_address:
            raise ValueError("DecodeConfig.store_address is required: prompts' KV arrives through the store")
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.dtype = torch_dtype(config.dtype)
        self.lm = lm if lm is not None else load_model(config.model, dtype=self.dtype)
        self.pool = KVPool(self.lm.config, config.num_blocks, config.block_size, self.dtype)
        self.fingerprint = self.lm.fingerprint
        self.eos = set(self.lm.tokenizer.eos_token_ids)
        self.timing = DecodeTimeModel()
        self._pool_lock = threading.Lock()
        self._wake = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._pulling: list[_Seq] = []
        self._running: list[_Seq] = []
        self._io = ThreadPoolExecutor(max_workers=config.pull_threads, thread_name_prefix=f"{config.worker_id}-io")
        self._clients: dict[str, StoreClient] = {}
        self._clients_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._quit = False
        self.max_batch_seen = 0
        self._requests_done = 0
        self._init_metrics()

    # ---- metrics ----

    def _init_metrics(self) -> None:
        r, wid = self.registry, self.config.worker_id
        lab = {"worker": wid}
        self.m_requests = Counter("halfmoon_decode_requests", "Decode requests by finish reason", ["worker", "reason"], registry=r)
        self.m_rejected = Counter("halfmoon_decode_rejections", "Decode requests refused", ["worker", "reason"], registry=r)
        self.m_tokens = Counter("halfmoon_decode_tokens", "Tokens generated", ["worker"], registry=r).labels(**lab)
        self.m_step = Histogram(
            "halfmoon_decode_step_seconds", "One decode step (the time between tokens of every running sequence)",
            ["worker"], registry=r, buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
        ).labels(**lab)
        self.m_batch = Histogram(
            "halfmoon_decode_batch_size", "Sequences per decode step", ["worker"], registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        ).labels(**lab)
        self.m_running = Gauge("halfmoon_decode_running", "Sequences in the running batch", ["worker"], registry=r).labels(**lab)
        self.m_free = Gauge("halfmoon_decode_free_blocks", "KV pool blocks free", ["worker"], registry=r).labels(**lab)
        self.m_pull = Histogram("halfmoon_decode_pull_seconds", "KV pull time per sequence", ["worker"], registry=r).labels(**lab)

    # ---- server lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_DecodeWorkerServicer_to_server(self, server)
        return ["halfmoon.DecodeWorker"]

    def _on_start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"{self.config.worker_id}-step", daemon=True)
        self._thread.start()

    def _on_stop(self) -> None:
        with self._wake:
            self._quit = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._io.shutdown(wait=True)
        for c in self._clients.values():
            c.close()

    # ---- RPCs ----

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext):
        """Stream the tokens after `first_token` (which the caller already has), then a final message."""
        problem = self._validate(request)
        if problem:
            self.m_rejected.labels(self.config.worker_id, "invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        window = self.lm.config.max_position_embeddings
        budget = min(request.sampling.max_tokens, window - len(request.prompt_ids))
        need = -(-(len(request.prompt_ids) + budget) // self.config.block_size)
        if need > self.pool.num_blocks:
            self.m_rejected.labels(self.config.worker_id, "too_long").inc()
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequence needs {need} KV blocks, the decode pool holds {self.pool.num_blocks}",
            )
        seq = _Seq(request, budget, need)
        context.add_callback(lambda: setattr(seq, "cancelled", True))
        reason = self._finish_reason(seq)
        if reason:  # the first token (the prefill worker's, which the caller already has) ends it: no KV needed
            yield pb.DecodeResponse(finished=True, finish_reason=reason)
            self.m_requests.labels(self.config.worker_id, reason).inc()
            return
        with self._wake:
            if len(self._waiting) >= self.config.max_waiting:
                self.m_rejected.labels(self.config.worker_id, "queue_full").inc()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode admission queue full ({self.config.max_waiting})")
            self._waiting.append(seq)
            self._wake.notify_all()
        while True:
            try:
                ev = seq.events.get(timeout=0.1)
            except queue.Empty:
                if not context.is_active():
                    seq.cancelled = True
                    self._poke()
                    return
                continue
            # Coalesce whatever else is already there into one message.
            evs = [ev]
            while not seq.events.empty():
                evs.append(seq.events.get_nowait())
            msg = pb.DecodeResponse()
            for kind, *payload in evs:
                if kind == "tok":
                    tok, t_ms, batch = payload
                    msg.token_ids.append(tok)
                    msg.token_times_ms.append(t_ms)
                    msg.batch_sizes.append(batch)
                else:
                    msg.finished, msg.finish_reason = True, payload[0]
                    msg.transfer_ms, msg.recomputed_tokens = seq.transfer_ms, seq.recomputed
            yield msg
            if msg.finished:
                return

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.WorkerLoad:
        return self.load()

    def load(self) -> pb.WorkerLoad:
        with self._wake:
            running = list(self._running) + list(self._pulling)
            waiting = len(self._waiting)
        nodes = [n for n in (self.config.store_node,) if n]
        return pb.WorkerLoad(
            worker_id=self.config.worker_id, kind="decode", queued_requests=waiting, running=len(running),
            waiting=waiting, free_blocks=self.pool.num_free, total_blocks=self.pool.num_blocks,
            decode_coef=self.timing.coef, total_context_tokens=sum(s.position for s in running), nodes=nodes,
            block_bytes=self.pool.block_bytes, block_size=self.pool.block_size, model_fingerprint=self.fingerprint,
            max_batch_seen=self.max_batch_seen, requests_done=self._requests_done,
        )

    def _validate(self, r: pb.DecodeRequest) -> str:
        c = self.lm.config
        if not r.prompt_ids:
            return "prompt_ids: empty prompt"
        if len(r.prompt_ids) >= c.max_position_embeddings:
            return f"prompt_ids: {len(r.prompt_ids)} tokens leave no room in the context window of {c.max_position_embeddings}"
        bad = [t for t in list(r.prompt_ids) + [r.first_token] if not 0 <= t < c.vocab_size]
        if bad:
            return f"prompt_ids/first_token: id {bad[0]} outside the vocabulary [0, {c.vocab_size})"
        if r.sampling.max_tokens < 1:
            return f"sampling.max_tokens: must be >= 1, got {r.sampling.max_tokens}"
        if r.handle.num_tokens != len(r.prompt_ids):
            return f"handle.num_tokens: {r.handle.num_tokens} but the prompt has {len(r.prompt_ids)} tokens"
        bs = self.config.block_size
        if len(r.handle.block_keys) != len(r.prompt_ids) // bs or r.handle.tail_tokens != len(r.prompt_ids) % bs:
            return f"handle: {len(r.handle.block_keys)} blocks + {r.handle.tail_tokens} tail tokens do not cover {len(r.prompt_ids)} prompt tokens"
        try:
            sampling_params(r.sampling)
        except ValueError as exc:
            return f"sampling: {exc}"
        return ""

    # ---- the step loop ----

    def _poke(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._admit()
                self._collect_pulled()
                self._drop_cancelled()
                while not self._running and not self._quit:
                    self._wake.wait(timeout=0.05 if (self._pulling or self._waiting) else 0.5)
                    self._admit()
                    self._collect_pulled()
                    self._drop_cancelled()
                if self._quit:
                    return
                batch = list(self._running)
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - end these streams with an error; the worker keeps serving
                for s in batch:
                    self._finish(s, "error", publish=False, note=str(exc))

    def _admit(self) -> None:
        """Move waiting sequences to pulling while the batch has room and the pool holds their whole answer."""
        while self._waiting and len(self._running) + len(self._pulling) < self.config.max_batch:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                self._end_stream(seq, "cancelled")
                continue
            with self._pool_lock:
                if self.pool.num_free < seq.need_blocks:
                    return  # first come, first served: later ones wait too
                seq.table = self.pool.allocate(seq.need_blocks)
            self._waiting.popleft()
            self._pulling.append(seq)
            seq.pull = self._io.submit(self._pull, seq)
        self.m_free.set(self.pool.num_free)

    def _collect_pulled(self) -> None:
        for seq in [s for s in self._pulling if s.pull.done()]:
            self._pulling.remove(seq)
            exc = seq.pull.exception()
            if exc is not None:
                self._release(seq)
                self._end_stream(seq, "error", note=f"KV pull failed: {exc}")
            else:
                self._running.append(seq)
        self.m_running.set(len(self._running))

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancelled]:
            self._running.remove(seq)
            self._release(seq)
            self._end_stream(seq, "cancelled")

    @torch.inference_mode()
    def _step(self, batch: list[_Seq]) -> None:
        t0 = time.perf_counter()
        b = len(batch)
        width = max(len(s.table) for s in batch)
        tables = torch.zeros(b, width, dtype=torch.int32)
        for i, s in enumerate(batch):
            tables[i, : len(s.table)] = torch.tensor(s.table, dtype=torch.int32)
        tokens = torch.tensor([s.out[-1] for s in batch], dtype=torch.long)
        positions = torch.tensor([s.position for s in batch], dtype=torch.long)
        logits = self.lm.model.decode(tokens, self.pool, tables, positions)
        new = sample(logits, [s.params for s in batch], [s.generator for s in batch]).tolist()
        step_ms = (time.perf_counter() - t0) * 1000.0
        self.timing.observe(step_ms, b, int(positions.sum()) + b)
        self.m_step.observe(step_ms / 1000.0)
        self.m_batch.observe(b)
        self.m_tokens.inc(b)
        self.max_batch_seen = max(self.max_batch_seen, b)
        for s, tok in zip(batch, new):
            s.out.append(tok)
            s.events.put(("tok", tok, s.ms(), b))
            reason = self._finish_reason(s)
            if reason:
                self._finish(s, reason, publish=True)

    def _finish_reason(self, s: _Seq) -> str:
        """'' while the sequence goes on; else why it ends (the same rules as model.Engine)."""
        tok, p = s.out[-1], s.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            return "stop"
        if p.stop and any(x in self.lm.tokenizer.decode(s.out) for x in p.stop):
            return "stop"
        if len(s.out) >= s.budget:
            return "length"
        return ""

    def _finish(self, s: _Seq, reason: str, publish: bool, note: str = "") -> None:
        with self._wake:
            if s in self._running:
                self._running.remove(s)
            self.m_running.set(len(self._running))
        if publish and self.config.publish and not s.cancelled:
            self._io.submit(self._publish_and_release, s)
        else:
            self._release(s)
        self._end_stream(s, reason, note)

    def _end_stream(self, s: _Seq, reason: str, note: str = "") -> None:
        self._requests_done += 1
        self.m_requests.labels(self.config.worker_id, reason).inc()
        s.events.put(("end", reason, note))

    def _release(self, s: _Seq) -> None:
        with self._pool_lock:
            if s.table:
                self.pool.free(s.table)
                s.table = []
        self.m_free.set(self.pool.num_free)
        self._poke()

    # ---- KV in and out (io threads) ----

    def _client(self, address: str) -> StoreClient:
        with self._clients_lock:
            if address not in self._clients:
                # Outside inference mode: the client maps its shm slab as a tensor that later writes update.
                with torch.inference_mode(False):
                    self._clients[address] = StoreClient(address)
            return self._clients[address]

    @torch.inference_mode()
    def _pull(self, s: _Seq) -> None:
        """Fill the sequence's blocks with its prompt's KV: full blocks from the store, the tail from the handle.

        Whatever cannot be pulled (evicted, corrupt, unreachable) is recomputed here: slower, never wrong.
        """
        t0 = time.perf_counter()
        h, bs = s.request.handle, self.config.block_size
        keys = list(h.block_keys)
        got = 0
        if keys:
            staging = torch.empty((len(keys), *self.pool.block_shape), dtype=self.dtype)
            try:
                got = self._client(h.store_address or self.config.store_address).get_into(keys, staging)
            except Exception:  # noqa: BLE001 - a failed transfer is a miss
                got = 0
            if got:
                self.pool.kv[torch.tensor(s.table[:got], dtype=torch.long)] = staging[:got]
        have = got * bs
        if got == len(keys) and h.tail_tokens:
            try:
                tail = decode_block(h.tail, model_fingerprint=self.fingerprint)
                if tuple(tail.shape) != (*self.pool.block_shape[:2], h.tail_tokens, *self.pool.block_shape[3:]):
                    raise ValueError("tail block of the wrong shape")
                self.pool.kv[s.table[got], :, :, : h.tail_tokens] = tail.to(self.dtype)
                have += h.tail_tokens
            except Exception:  # noqa: BLE001 - recomputed below
                pass
        s.transfer_ms = (time.perf_counter() - t0) * 1000.0
        self.m_pull.observe(s.transfer_ms / 1000.0)
        if have < len(s.prompt):
            s.recomputed = len(s.prompt) - have
            ids = torch.tensor(s.prompt[have:], dtype=torch.long)
            self.lm.model.prefill(ids, self.pool, s.table, have, last_only=True)
        self._poke()

    def _publish_and_release(self, s: _Seq) -> None:
        """Publish the full blocks the answer added (prompt tail + answer), then free the sequence's blocks."""
        try:
            bs = self.config.block_size
            done = s.position  # tokens whose KV is in the pool
            tokens = s.prompt + s.out[:-1]
            keys = block_keys(tokens[: done // bs * bs], bs, self.fingerprint, s.request.cache_salt)
            start = len(s.request.handle.block_keys)
            if len(keys) > start:
                idx = torch.tensor(s.table[start : len(keys)], dtype=torch.long)
                parent = keys[start - 1] if start else None
                self._client(self.config.store_address).put(keys[start:], self.pool.kv[idx], self.fingerprint, parent=parent)
        except Exception:  # noqa: BLE001 - publishing is an optimisation; the answer was already streamed
            pass
        finally:
            self._release(s)
