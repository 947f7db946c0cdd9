"""The decode worker's gRPC face: validation, the token stream, load reports, lifecycle."""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from decode_node.config import DecodeConfig
from decode_node.kivi_runner import KiviDecodeRunner
from decode_node.metrics import DecodeMetrics
from decode_node.runner import DecodeRunner
from decode_node.scheduler import DecodeScheduler
from decode_node.seq import Seq
from kvstore import Index, block_keys
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import is_kivi
from servekit.validation import prompt_ids_problem
from servekit.worker import WorkerServer, sampling_params

log = logging.getLogger(__name__)


def make_runner(config: DecodeConfig, metrics: DecodeMetrics, registry, lm=None) -> DecodeRunner:
    """The runner for the config's KV cache type: full precision, or KIVI-packed."""
    cls = KiviDecodeRunner if is_kivi(config.kv_cache_dtype) else DecodeRunner
    return cls(config, metrics, registry, lm)


class DecodeWorker(WorkerServer, pb_grpc.DecodeWorkerServicer):
    """gRPC `DecodeWorker`: a step-loop thread (DecodeScheduler) runs one decode forward per step
    for all running sequences; the runner owns the model, the pool and the KV connector."""

    metrics_class = DecodeMetrics
    runner_class = staticmethod(make_runner)
    scheduler_class = DecodeScheduler
    store_use = "prompts' KV arrives through the store"
    data_methods = frozenset({"/halfmoon.DecodeWorker/Decode"})  # a stream holds a thread

    def __init__(self, config: DecodeConfig, lm=None):
        super().__init__(config, lm)
        # store addresses the index named (handles may name them), and its client
        self._known_stores: set[str] = set()
        self._index: Index | None = None
        self._index_lock = threading.Lock()

    # ---- lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_DecodeWorkerServicer_to_server(self, server)
        return ["halfmoon.DecodeWorker"]

    # ---- RPCs ----

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext):
        """Stream the tokens after `first_token` (which the caller already has), then a final
        message."""
        wid = self.config.worker_id
        problem = self._validate(request)
        if problem:
            self.metrics.rejected.labels(wid, "invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        foreign = self._foreign_store(request.handle.store_address)
        if foreign:
            self.metrics.rejected.labels(wid, "foreign_store").inc()
            context.abort(grpc.StatusCode.PERMISSION_DENIED, foreign)
        window = self.lm.config.max_position_embeddings
        budget = min(request.sampling.max_tokens, window - len(request.prompt_ids))
        need = self.runner.blocks_to_reserve(len(request.prompt_ids) + budget)
        if need > self.pool.num_blocks:
            self.metrics.rejected.labels(wid, "too_long").inc()
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequence needs {need} KV blocks, the decode pool holds {self.pool.num_blocks}",
            )
        seq = Seq(request, budget, need)
        context.add_callback(lambda: setattr(seq, "cancelled", True))
        reason = "" if seq.prefill_here else self.runner.finish_reason(seq)
        if reason:  # the first token (the caller has it already) ends it: no KV needed
            self.scheduler.end_early(seq, reason)
            yield pb.DecodeResponse(finished=True, finish_reason=reason)
            return
        if not self.scheduler.submit(seq):
            self.metrics.rejected.labels(wid, "queue_full").inc()
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode admission queue full ({self.config.max_waiting})",
            )
        yield from self._stream(seq, context)

    def _stream(self, seq: Seq, context: grpc.ServicerContext):
        """The sequence's events as messages, coalescing what is already there into one."""
        while True:
            try:
                ev = seq.events.get(timeout=0.1)
            except queue.Empty:
                if not context.is_active():
                    seq.cancelled = True
                    self.scheduler.poke()
                    return
                continue
            evs = [ev]
            while not seq.events.empty():
                evs.append(seq.events.get_nowait())
            msg = pb.DecodeResponse()
            for kind, *payload in evs:
                if kind == "admitted":
                    yield pb.DecodeResponse(admitted=True, prefilled=seq.prefilled)
                elif kind == "toks":
                    for tok, t_ms, batch, own_ms in payload[0]:
                        msg.token_ids.append(tok)
                        msg.token_times_ms.append(t_ms)
                        msg.batch_sizes.append(batch)
                        msg.step_ms.append(own_ms)
                else:
                    msg.finished, msg.finish_reason = True, payload[0]
                    msg.transfer_ms, msg.recomputed_tokens = seq.transfer_ms, seq.recomputed
            yield msg
            if msg.finished:
                return

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.WorkerLoad:
        load = self.load()
        if request.memory:
            self.memory_report(load.memory)
        return load

    def load(self) -> pb.WorkerLoad:
        running, waiting, context_tokens = self.scheduler.counts()
        cfg, pool = self.config, self.pool
        return pb.WorkerLoad(
            worker_id=cfg.worker_id,
            kind="decode",
            queued_requests=waiting,
            running=running,
            waiting=waiting,
            free_blocks=pool.num_free,
            total_blocks=pool.num_blocks,
            decode_coef=self.scheduler.timing.coef,
            total_context_tokens=context_tokens,
            nodes=[n for n in (cfg.store_node,) if n],
            block_bytes=pool.block_bytes,
            block_size=pool.block_size,
            model_fingerprint=self.fingerprint,
            max_batch_seen=self.scheduler.max_batch_seen,
            requests_done=self.scheduler.requests_done,
            device=str(self.runner.device),
            kv_cache_dtype=cfg.kv_cache_dtype,
            capacity_tokens=self.runner.capacity_tokens,
            cpu_turns=self.runner.turns.path,
            offered_slack_ms=self.scheduler.offered_slack_ms if self.runner.turns.path else -1.0,
            **self.scheduler.admission_figures(),
        )

    def _validate(self, r: pb.DecodeRequest) -> str:
        c = self.lm.config
        problem = prompt_ids_problem(
            "prompt_ids", r.prompt_ids, c.vocab_size, c.max_position_embeddings
        )
        if problem:
            return problem
        if not 0 <= r.first_token < c.vocab_size:
            return f"first_token: id {r.first_token} is outside the vocabulary [0, {c.vocab_size})"
        if r.sampling.max_tokens < 1:
            return f"sampling.max_tokens: must be >= 1, got {r.sampling.max_tokens}"
        if r.prefill_here:
            return self._prefill_here_problem(r)
        if r.handle.num_tokens != len(r.prompt_ids):
            return (
                f"handle.num_tokens: {r.handle.num_tokens} but the prompt has "
                f"{len(r.prompt_ids)} tokens"
            )
        bs, h = self.config.block_size, r.handle
        if not 0 <= h.window_blocks <= len(h.block_keys):
            return f"handle.window_blocks: {h.window_blocks} of {len(h.block_keys)} blocks"
        if (
            len(h.block_keys) != len(r.prompt_ids) // bs
            or h.tail_tokens != h.window_blocks * bs + len(r.prompt_ids) % bs
        ):
            return (
                f"handle: {len(h.block_keys)} blocks + {h.tail_tokens} tail "
                f"tokens ({h.window_blocks} window blocks) do not cover {len(r.prompt_ids)} "
                "prompt tokens"
            )
        # The blocks pulled must be this prompt's, under this model and salt: a handle naming
        # other keys would read another prompt's (or tenant's) KV into this answer.
        if list(h.block_keys) != block_keys(r.prompt_ids, bs, self.fingerprint, r.cache_salt):
            return "handle.block_keys: not the keys of this prompt, model and cache salt"
        try:
            sampling_params(r.sampling)
        except ValueError as exc:
            return f"sampling: {exc}"
        return ""

    def _prefill_here_problem(self, r: pb.DecodeRequest) -> str:
        """'' when this worker can prefill `r` itself: its handle names only a prefix of the
        prompt's own block keys (what to load from this host's store), with no tail."""
        if is_kivi(self.config.kv_cache_dtype):
            return "prefill_here: a KIVI decode worker does not prefill (route it to a prefill)"
        h, bs = r.handle, self.config.block_size
        if h.num_tokens != len(r.prompt_ids):
            return f"handle.num_tokens: {h.num_tokens} but the prompt has {len(r.prompt_ids)}"
        if h.tail or h.tail_tokens or h.window_blocks or h.store_address:
            return "handle: a prefill_here handle names blocks of this host's store, no tail"
        keys = block_keys(r.prompt_ids, bs, self.fingerprint, r.cache_salt)
        if list(h.block_keys) != keys[: len(h.block_keys)] or len(h.block_keys) > len(keys):
            return "handle.block_keys: not a prefix of this prompt's keys under this model and salt"
        try:
            sampling_params(r.sampling)
        except ValueError as exc:
            return f"sampling: {exc}"
        return ""

    def _foreign_store(self, address: str) -> str:
        """'' when a handle's store may be pulled from; else why not. With security on, only
        store nodes of this cluster: this worker's own, `trusted_stores`, or a node registered in
        the global index (asked again on a miss)."""
        cfg = self.config
        if not address or not cfg.security.enabled:
            return ""
        if address == cfg.store_address or address in cfg.trusted_stores:
            return ""
        if address in self._known_stores:
            return ""
        if not cfg.index_url:
            return f"handle.store_address: {address} is not a store node of this cluster"
        try:
            with self._index_lock:
                if self._index is None:
                    self._index = Index(cfg.index_url)
                nodes = self._index.nodes()
        except Exception as exc:  # noqa: BLE001 - unverifiable: refused (logged, counted)
            log.warning("cannot check store %s against the index: %r", address, exc)
            return f"handle.store_address: {address} could not be checked (index: {exc})"
        self._known_stores = {n.address for n in nodes.values() if n.address}
        if address in self._known_stores:
            return ""
        return f"handle.store_address: {address} is not a store node of this cluster"

    def _on_stop(self) -> None:
        super()._on_stop()
        if self._index is not None:
            self._index.close()
