"""What a routing policy reads and returns: the request, each worker as the policy sees it, the
cluster's state, and the decision (policy.py). Plain records, so the live conductor and the
simulator build the same ones."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class RequestInfo(NamedTuple):
    num_tokens: int  # prompt tokens
    max_tokens: int  # new tokens the request may generate
    ttft_slo_ms: float  # time-to-first-token objective; <= 0 = none
    tbt_slo_ms: float  # time-between-tokens objective; <= 0 = none
    # resumed after a lost decode worker (its first token sent already): prefilled on a prefill
    # worker, never on the decode worker (which would sample a first token again)
    resumed: bool = False
    # time-per-output-token objective (the mean gap, as vLLM's benchmark judges); <= 0 = none
    tpot_slo_ms: float = 0.0


class Link(NamedTuple):
    """A link from a store node to a prefill worker, as the worker's fetches measured it: a fetch
    of n bytes takes fixed_ms + n / bytes_per_ms."""

    node: str  # the store node's index id
    fixed_ms: float  # round trips before the bytes flow
    bytes_per_ms: float


class PrefillCandidate(NamedTuple):
    worker_id: str
    # Index node ids local to this worker: its device pool's node and its host's store node(s).
    nodes: tuple[str, ...]
    queue_ms: float  # predicted wait before a new request starts computing
    coef: tuple[float, ...]  # fitted prefill model: ms = c0 + c1*tokens + c2*tokens*context
    healthy: bool = True
    # bytes one block moves when it fetches: a block at the store's codec, or what its last
    # CacheGen fetch moved per block (0 = unknown: the cluster's block_bytes)
    fetch_block_bytes: float = 0.0
    # Prompt tokens ahead of a new request there (queued, and left in the round computing), for
    # reports; `queue_ms` is what the policy adds.
    queued_tokens: int = 0
    # the links from the store nodes it has fetched from, as measured (others: the default)
    links: tuple[Link, ...] = ()
    # its model's predictions have been checked against requests served (its correction holds):
    # False = its model alone, which may be far off (fitted on a loaded machine, say)
    checked: bool = True
    # Decode workers that take turns with it at the same CPUs (one host, servekit.CpuTurns):
    # while their batches run, its forwards get what their steps leave of each paced period
    cpu_peers: tuple[str, ...] = ()


class DecodeCandidate(NamedTuple):
    worker_id: str
    running: int  # sequences in its running batch (and admitted, waiting for KV)
    free_blocks: int  # KV pool blocks free now
    total_blocks: int  # KV pool size
    context_tokens: int  # KV tokens its running sequences hold
    coef: tuple[float, ...]  # fitted decode-step model: ms = c0 + c1*batch + c2*context_tokens
    healthy: bool = True
    # Each running sequence as (KV position, tokens it may still generate, pool blocks it holds):
    # what the batch a new sequence joins looks like as it goes on, and when blocks free up. Empty:
    # only the totals above are known (the batch and context stay as they are now).
    seqs: tuple[tuple[int, int, int], ...] = ()
    # Sequences admitted before a new one (waiting for pool room, or routed and not yet reported),
    # as (prompt tokens, tokens to generate, blocks needed); they take the pool's room first.
    waiting: tuple[tuple[int, int, int], ...] = ()
    max_batch: int = 0  # sequences one step carries at most (0 = no bound)
    # what pulling one prompt block into its pool took lately (0 = unknown: taken as instant)
    pull_ms_per_block: float = 0.0
    # Index node ids of its host's store node(s): the prefix it can load itself, were it to
    # prefill a prompt (a prefill on the decode worker)
    nodes: tuple[str, ...] = ()
    # predicted compute of the prefills routed to it and not done yet (ms, at its full speed)
    local_queue_ms: float = 0.0
    checked: bool = True  # as PrefillCandidate's
    # Wall-clock time of one of its steps over the step's compute (>= 1): a sequence waiting for
    # a slot waits out whole steps, the token streaming, the scheduling and the CPU turns given
    # to a prefill included, which the compute model (and TBT's correction) leaves out.
    wait_scale: float = 1.0
    # The ms a prefill on its CPUs may keep them before its next step (what it offers now: its
    # streams' slack, more where they banked some ahead of their objective); -1 = none offered
    offered_slack_ms: float = -1.0
    # Its streams' slowest 10% of step times over what its (mean-calibrated) model gives them
    # (>= 1): the tail the model's mean leaves out, which Mooncake's TBT judges
    tbt_scale: float = 1.0
    # A prompt it prefills itself: its measured TTFT over the policy's estimate (DecodeWorker's
    # `local` correction; 1.0 until it holds)
    local_scale: float = 1.0



class ClusterState(NamedTuple):
    prefill: Sequence[PrefillCandidate]
    decode: Sequence[DecodeCandidate]
    matches: dict[str, int]  # index answer: node id -> leading blocks of this prompt it holds
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block's KV (all layers)
    # Index node ids that are a prefill worker's own device pool: they count toward that worker's
    # own match (it lists them in its nodes) but are never a fetch source, since no other worker
    # can read another's device memory.
    device_nodes: frozenset[str] = frozenset()
    # tokens of each sequence a decode worker keeps outside its pool (KIVI's full-precision
    # window, kivi_residual): its pool holds blocks for the rest only (servekit.blocks_needed)
    window_tokens: int = 0


class Decision(NamedTuple):
    """What runs: the prefill worker loads the prefix this names and fetches nothing on its own."""

    prefill: str  # prefill worker id
    decode: str  # decode worker id
    use_cache: bool  # False: the prefill worker computes everything (cache_off)
    # Remote store node to pull the prefix from; "" = the worker uses its own tiers only (its
    # device pool, its host's DRAM/SSD) and fetches nothing remote. Never a device node.
    fetch_from: str
    # Exactly what to pull from `fetch_from`: the prompt's leading `fetch_blocks` blocks, less those
    # its own tiers already hold, never more; 0 when `fetch_from` is "".
    fetch_blocks: int
    reuse_blocks: int  # prefix blocks the policy expects to be reused
    predicted_ttft_ms: float  # the policy's estimate (0 when it does not estimate)
    predicted_tbt_ms: float  # the chosen decode worker's predicted TBT
    # The compute part of the TTFT estimate (the work this request adds to the worker's queue).
    predicted_prefill_ms: float = 0.0
    # A store node the chosen worker was weighed fetching from over a link none of its fetches
    # has measured yet (the estimate took the policy's default speed); "" = none.
    assumed_link: str = ""
    # The part of the TTFT estimate after the prefill's answer: the decode admission wait, the KV
    # pull and the step boundary it joins at (what a correction of the prefill leaves out).
    predicted_admission_ms: float = 0.0
    # The prompt is prefilled on the decode worker itself, between its steps (its host's stored
    # prefix loaded, the rest computed there): `prefill` is "" and no prefill worker runs.
    prefill_on_decode: bool = False
    predicted_tpot_ms: float = 0.0  # the chosen decode worker's predicted TPOT (its mean step)


class Rejected(Exception):
    """No worker pair can serve the request (the conductor answers RESOURCE_EXHAUSTED)."""


class MissesObjectives(Rejected):
    """Pairs can serve the request, but none is predicted to meet its objectives: refused at
    once with a time to retry after, or (the conductor's `admission: best_effort`) served
    without being counted as good."""

    def __init__(self, message: str, over_ms: float, idle: bool = False):
        super().__init__(message)
        self.over_ms = over_ms  # how far the best prediction is past its objective
        # the worker it was predicted on had nothing to do and an unchecked model: the prediction
        # is its model alone, which only requests served there correct (conductor.admit admits
        # it as a probe)
        self.idle = idle

    @property
    def retry_after_s(self) -> int:
        """Whole seconds to wait before trying again (HTTP's Retry-After): the excess, at least
        one second (the queue ahead drains at about the rate it was predicted)."""
        return max(1, math.ceil(self.over_ms / 1000.0))
