"""One Generate call's progress, kept across a failover: the tokens sent, their times, the text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conductor.detok import IncrementalText
from conductor.estimates import tbt_of_times, tpot_of_times
from conductor.routing import Routed
from protos import halfmoon_pb2 as pb


@dataclass
class RequestStream:
    """What the conductor keeps of one request while it runs. The tokens already sent survive a
    lost decode worker, so the request resumes elsewhere without a repeated or missing token."""

    rid: str  # request id: the client's, or a fresh one
    ids: list[int]  # the prompt's token ids
    policy: str  # the routing policy's registry name
    sampling: pb.SamplingParams  # the client's sampling parameters
    salt: str  # the cache salt (keeps tenants' blocks apart)
    text: IncrementalText  # the answer's text so far, stop strings cut out
    arrived: float = field(default_factory=time.perf_counter)  # perf_counter() at arrival
    keys: list[bytes] = field(default_factory=list)  # its block keys, from its first routing
    out: list[int] = field(default_factory=list)  # tokens sent to the client
    times: list[float] = field(default_factory=list)  # per token sent: ms since arrival
    first: pb.PrefillReply | None = None  # the first prefill's reply (its hits are the usage)
    routed: Routed | None = None  # the pair serving it now
    reason: str = ""  # finish reason; "" while it goes on
    ttft_ms: float = 0.0  # time to the first token, at the conductor
    answered_ms: float = 0.0  # time to the first prefill's answer, at the conductor
    decode_transfer_ms: float = 0.0  # KV pull time the decode workers reported
    max_batch: int = 0  # the largest decode batch its tokens came from
    failures: int = 0  # workers lost under it so far
    # its objectives: the request's own, else the conductor's defaults (0 = none)
    ttft_slo_ms: float = 0.0
    tbt_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0
    # admitted although predicted to miss them (admission: best_effort): never counted as good
    best_effort: bool = False
    # per token from the decode workers: its step's own compute (ms), the pacing wait left out
    step_ms: list[float] = field(default_factory=list)

    def met_slos(self) -> bool:
        """Whether the answer met every objective it has (0 = not judged): TTFT at the
        conductor, TBT as Mooncake defines it (the mean of the slowest 10% of its token gaps) and
        TPOT as vLLM's benchmark does (the mean gap). A best-effort answer never counts, however
        it came out: admitting it was a bet against the objectives."""
        if self.best_effort:
            return False
        ttft_ok = not self.ttft_slo_ms or self.ttft_ms <= self.ttft_slo_ms
        tbt_ok = not self.tbt_slo_ms or tbt_of_times(self.times) <= self.tbt_slo_ms
        return ttft_ok and tbt_ok and (
            not self.tpot_slo_ms or tpot_of_times(self.times) <= self.tpot_slo_ms
        )

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000.0

    def prompt(self) -> list[int]:
        """What to prefill: the prompt, and after a lost decode worker every token sent but the
        last (mostly from cache), so decoding goes on from the last one."""
        return self.ids + self.out[:-1]

    def tokens_left(self) -> int:
        """New tokens the pair routed now may produce, the already sent first one included."""
        return self.sampling.max_tokens - max(0, len(self.out) - 1)

    def decode_sampling(self) -> pb.SamplingParams:
        """The client's sampling parameters, max_tokens cut to what is left (the decode worker
        counts its first token too: the last one sent, or the prefill's, sent once it is
        admitted)."""
        sp = pb.SamplingParams()
        sp.CopyFrom(self.sampling)
        sp.max_tokens = self.sampling.max_tokens - max(1, len(self.out)) + 1
        return sp

    def start(self, reply: pb.PrefillReply) -> pb.GenerateResponse:
        """The first prefill's token: the first message to the client."""
        self.first, self.ttft_ms = reply, self.elapsed_ms()
        self.out, self.times = [reply.first_token], [self.ttft_ms]
        return pb.GenerateResponse(
            request_id=self.rid,
            token_ids=self.out,
            text=self.text.add(self.out),
            token_times_ms=self.times,
        )

    def add(self, msg: pb.DecodeResponse) -> tuple[pb.GenerateResponse, list[float]]:
        """Tokens from the decode worker: the message to the client (times on the conductor's
        clock, never before the previous token) and the gaps between tokens in ms."""
        now = self.elapsed_ms()
        new_times = [max(t, self.times[-1]) for t in rebase(list(msg.token_times_ms), now)]
        gaps = [max(0.0, b - a) for a, b in zip([self.times[-1], *new_times], new_times)]
        ids = list(msg.token_ids)
        self.out.extend(ids)
        self.times.extend(new_times)
        self.step_ms.extend(msg.step_ms)
        self.max_batch = max([self.max_batch, *msg.batch_sizes])
        reply = pb.GenerateResponse(
            request_id=self.rid, token_ids=ids, text=self.text.add(ids), token_times_ms=new_times
        )
        return reply, gaps

    def usage(self) -> pb.Usage:
        """The final message's usage: cache hits of the first prefill, timings of every token."""
        r, routed = self.first, self.routed
        if r is None or routed is None:
            raise RuntimeError(f"request {self.rid}: usage asked before its first token")
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        return pb.Usage(
            prompt_tokens=len(self.ids),
            completion_tokens=len(self.out),
            cached_tokens=cached_tokens(r),
            cached_device_tokens=r.cached_device_tokens,
            cached_dram_tokens=r.cached_dram_tokens,
            cached_ssd_tokens=r.cached_ssd_tokens,
            cached_remote_tokens=r.cached_remote_tokens,
            computed_prompt_tokens=r.computed_tokens,
            ttft_ms=self.ttft_ms,
            tbt_mean_ms=sum(gaps) / len(gaps) if gaps else 0.0,
            tbt_p90_ms=gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))] if gaps else 0.0,
            prefill_worker=(routed.prefill or routed.decode).worker_id,
            prefill_on_decode=routed.prefill_on_decode,
            decode_worker=routed.decode.worker_id,
            queue_ms=r.queue_ms,
            transfer_ms=r.transfer_ms + self.decode_transfer_ms,
            max_decode_batch=self.max_batch,
            predicted_ttft_ms=routed.predicted_ttft_ms,
            predicted_admission_ms=routed.predicted_admission_ms,
            predicted_tbt_ms=routed.predicted_tbt_ms,
            prefill_ms=r.prefill_ms,
            prefill_answered_ms=self.answered_ms,
            policy=routed.decision_policy,
            worker_failures=self.failures,
        )


def cached_tokens(r: pb.PrefillReply) -> int:
    """Prompt tokens whose KV came from any cache tier."""
    return (
        r.cached_device_tokens + r.cached_dram_tokens + r.cached_ssd_tokens + r.cached_remote_tokens
    )


def rebase(worker_times: list[float], now: float) -> list[float]:
    """A decode worker's times (ms since it got the request) on the conductor's clock: the last
    one at `now`, as the worker's and the conductor's clocks do not share an origin."""
    if not worker_times:
        return []
    shift = now - worker_times[-1]
    return [t + shift for t in worker_times]
