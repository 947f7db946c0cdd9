"""The prefill worker's gRPC face: validation, the RPCs, load reports, lifecycle."""

from __future__ import annotations

import grpc

from prefill_node.job import Failure, PrefillJob
from prefill_node.metrics import PrefillMetrics
from prefill_node.runner import PrefillRunner
from prefill_node.scheduler import PrefillScheduler, reply_or_raise
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit.validation import prompt_ids_problem
from servekit.worker import WorkerServer


class PrefillWorker(WorkerServer, pb_grpc.PrefillWorkerServicer):
    """gRPC `PrefillWorker`: a scheduler thread computes (see PrefillScheduler); the runner owns
    the model, the pool and the KV connector."""

    metrics_class = PrefillMetrics
    runner_class = PrefillRunner
    scheduler_class = PrefillScheduler
    store_use = "the KV cache travels to decode workers through the store"
    data_methods = frozenset({"/halfmoon.PrefillWorker/Prefill"})  # waits queued and computing

    # ---- lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)
        return ["halfmoon.PrefillWorker"]

    # ---- RPCs ----

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext):
        problem = self._validate(request)
        if problem:
            self.metrics.rejected.labels(self.config.worker_id, "invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.stopped:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.config.worker_id} is stopping"
            )
        job = PrefillJob(request)
        try:
            self.scheduler.submit(job)
            while not job.done.wait(0.05):
                if not context.is_active():
                    job.cancelled = True
                    return pb.PrefillReply()
            return reply_or_raise(job)
        except Failure as exc:
            context.abort(exc.code, str(exc))

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.WorkerLoad:
        load = self.load()
        if request.memory:
            self.memory_report(load.memory)
        return load

    def ClearCache(self, request: pb.ClearCacheRequest, context) -> pb.ClearCacheReply:
        """Drop the device tier's blocks (those a running request holds stay until it ends)."""
        return pb.ClearCacheReply(device_blocks=self.runner.clear_device())

    def load(self) -> pb.WorkerLoad:
        """The load report the conductor routes by."""
        cfg, pool = self.config, self.pool
        waiting, predicted = self.scheduler.waiting()
        device_node = cfg.worker_id if cfg.device_cache else ""
        nodes = [n for n in (cfg.store_node, device_node) if n]
        return pb.WorkerLoad(
            worker_id=cfg.worker_id,
            kind="prefill",
            queued_requests=len(waiting),
            queued_tokens=sum(waiting),
            predicted_queue_ms=predicted,
            free_blocks=pool.num_free,
            total_blocks=pool.num_blocks,
            prefill_coef=self.scheduler.timing.coef,
            nodes=nodes,
            block_bytes=pool.block_bytes,
            block_size=pool.block_size,
            model_fingerprint=self.fingerprint,
            requests_done=self.scheduler.requests_done,
            max_batch_seen=self.scheduler.max_batch_seen,
            device=str(self.runner.device),
            device_node=device_node,
            kv_cache_dtype=cfg.kv_cache_dtype,
            capacity_tokens=pool.num_blocks * pool.block_size,
            fetch_block_bytes=self.runner.fetch_block_bytes,
            # what its fetches measured of each link: the policy weighs fetch against recompute
            links=[
                pb.LinkSpeed(
                    node=n, fixed_ms=s.fixed_ms, bytes_per_ms=s.bytes_per_ms, fetches=s.fetches
                )
                for n, s in self.runner.kv.links().items()
            ],
            running_tokens=self.scheduler.running_tokens(),
            cpu_turns=self.runner.turns.path,
        )

    def _validate(self, request: pb.PrefillRequest) -> str:
        c = self.lm.config
        problem = prompt_ids_problem(
            "token_ids", request.token_ids, c.vocab_size, c.max_position_embeddings
        )
        if problem:
            return problem
        if request.fetch_blocks < 0:
            return f"fetch_blocks: must be >= 0, got {request.fetch_blocks}"
        if request.sampling.max_tokens < 0:
            return f"sampling.max_tokens: must be >= 0, got {request.sampling.max_tokens}"
        return ""
