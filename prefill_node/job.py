"""One prefill request from arrival to its answer."""

from __future__ import annotations

import threading
import time

import grpc
import torch

from protos import halfmoon_pb2 as pb


class Failure(Exception):
    """A request that cannot be served, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class PrefillJob:
    """A queued request and, once its round starts, its prefix, pool blocks and progress."""

    def __init__(self, request: pb.PrefillRequest):
        self.request = request
        self.ids = list(request.token_ids)
        self.arrived = time.perf_counter()
        self.started = 0.0  # when its round took it
        self.done = threading.Event()
        self.cancelled = False
        self.reply: pb.PrefillReply | None = None
        self.error: Failure | None = None
        self.keys: list[bytes] = []  # block keys of the prompt's full blocks
        self.table: list[int] = []  # pool blocks: the reused prefix, then the new ones
        self.pinned: list[bytes] = []  # device-tier keys held while the job runs
        self.counts = {"device": 0, "dram": 0, "ssd": 0, "remote": 0}  # reused blocks by tier
        self.transfer_ms = 0.0
        self.stored = False  # its full blocks are known to be in this host's store
        self.stored_blocks = 0  # its leading full blocks the store confirmed at a publish
        self.cachegen_levels: list[int] = []  # level of each CacheGen chunk fetched
        self.fetched_bytes = 0  # bytes the fetch from fetch_from moved (blocks or chunks)
        self.fetch_ms = 0.0  # time that fetch took
        self.pos = 0  # next position to compute
        self.logits: torch.Tensor | None = None  # the last computed position's logits
        self.prefill_ms = 0.0  # from the round's first forward to this job's last

    @property
    def queue_ms(self) -> float:
        return (self.started - self.arrived) * 1000.0
