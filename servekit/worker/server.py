"""The gRPC shell both workers share: a config, metrics, a runner (model, pool, KV connector) and
a scheduler (the thread that computes), started and stopped together."""

from __future__ import annotations

from typing import ClassVar

from kernels import release_threads
from servekit.cpus import pin_process
from servekit.grpc_server import GrpcServer
from servekit.memory import memory_usage, release_freed_heap, tensor_bytes


class WorkerServer(GrpcServer):
    """Subclasses name their parts and add their servicer (`_add_services`) and RPCs."""

    metrics_class: ClassVar[type]  # (registry, worker_id) -> metrics
    runner_class: ClassVar[type]  # (config, metrics, registry, lm) -> runner
    scheduler_class: ClassVar[type]  # (config, runner, metrics) -> scheduler
    store_use: ClassVar[str]  # why the worker needs its host's store (for the config error)

    def __init__(self, config, lm=None):
        GrpcServer.__init__(
            self, config.host, config.port, config.metrics_port, config.grpc_workers
        )
        if not config.store_address:
            raise ValueError(f"{type(config).__name__}.store_address is required: {self.store_use}")
        self.config = config
        threads = pin_process(f"{type(config).__name__}.cpus", config.cpus, config.torch_threads)
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.metrics = self.metrics_class(self.registry, config.worker_id)
        self.runner = self.runner_class(config, self.metrics, self.registry, lm)
        self.scheduler = self.scheduler_class(config, self.runner, self.metrics)
        self.lm, self.pool = self.runner.lm, self.runner.pool
        self.fingerprint = self.runner.fingerprint
        self.metrics.free.set(self.pool.num_free)
        # what this worker is configured to hold: its weights and its pool
        model = self.lm.model
        self.configured_bytes = (
            tensor_bytes(*model.parameters(), *model.buffers()) + self.pool.bytes()
        )
        release_freed_heap()  # the load's freed buffers go back to the system

    def memory_report(self, report) -> None:
        """Fill a halfmoon.MemoryReport with this process's memory."""
        m = memory_usage()
        report.rss_bytes, report.uss_bytes, report.pss_bytes = m.rss, m.uss, m.pss
        report.configured_bytes = self.configured_bytes

    @property
    def max_batch_seen(self) -> int:
        """The most sequences one forward has carried."""
        return self.scheduler.max_batch_seen

    def _on_start(self) -> None:
        self.scheduler.start()
        # The scheduler's thread runs every forward from now on; this one loaded and calibrated
        # the model: its OpenMP workers go, or the scheduler's parallel regions would sleep at
        # their barriers (kernels/csrc/threads.c).
        release_threads()

    def _on_stop(self) -> None:
        self.scheduler.stop()
        self.runner.close()
