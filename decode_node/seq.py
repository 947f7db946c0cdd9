"""One decoding sequence from arrival to the end of its stream."""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future

from protos import halfmoon_pb2 as pb
from servekit.worker import sampling_params


class Seq:
    """A sequence's prompt, its tokens so far, its pool blocks and its stream's events."""

    def __init__(self, request: pb.DecodeRequest, budget: int, need_blocks: int):
        self.request = request
        self.prompt = list(request.prompt_ids)
        self.params = sampling_params(request.sampling)
        self.generator = self.params.generator()
        self.tbt_slo_ms = request.tbt_slo_ms  # its time-between-tokens objective; 0 = none
        self.budget = budget  # new tokens allowed (max_tokens, capped by the context window)
        self.need_blocks = need_blocks  # pool blocks reserved at admission: the whole answer
        # prefilled here (no prefill worker ran): the first token is sampled once its KV is in
        self.prefill_here = request.prefill_here
        # what a prefill worker would have answered, once prefilled here (the admitted message)
        self.prefilled: pb.PrefillReply | None = None
        # generated tokens; the last one's KV is not computed
        self.out = [] if request.prefill_here else [request.first_token]
        self.table: list[int] = []  # pool blocks (KIVI: packed blocks, the first n_packed used)
        self.window: list[int] = []  # KIVI: full-precision window blocks, oldest first
        self.n_packed = 0  # KIVI: leading tokens' blocks held packed
        # ("admitted",) | ("toks", [(id, ms, batch), ...]) | ("end", reason, note)
        self.events: queue.Queue = queue.Queue()
        # tokens not yet put in events: (id, ms since arrival, batch, its step's own compute ms)
        self.held: list[tuple[int, float, int, float]] = []
        self.arrived = time.perf_counter()
        # perf_counter when it joined the running batch (its first token released to the
        # client): where its answer's mean gap is counted from (DecodeConfig.tbt_pacing "mean")
        self.joined = 0.0
        self.cancelled = False
        self.pull: Future | None = None
        self.transfer_ms = 0.0
        self.recomputed = 0

    def send_held(self) -> None:
        """Put the held tokens in the stream's events, as one event."""
        if self.held:
            self.events.put(("toks", self.held))
            self.held = []

    @property
    def position(self) -> int:
        """Where the next fed token (the last generated one) goes."""
        return len(self.prompt) + len(self.out) - 1

    def ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000.0
