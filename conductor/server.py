"""The conductor: validate, tokenize, look up the prefix, route with a policy, relay the answer."""

from __future__ import annotations

import threading
import time
import uuid
from typing import NamedTuple

import grpc
from prometheus_client import Counter, Histogram

from conductor.config import ConductorConfig
from conductor.detok import IncrementalText
from conductor.policy import (
    POLICIES,
    ClusterState,
    DecodeCandidate,
    Policy,
    PrefillCandidate,
    Rejected,
    RequestInfo,
    make_policy,
)
from conductor.serverkit import GrpcServer
from kvstore import Index, StoreClient, block_keys
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc

_ROLES = ("system", "user", "assistant", "tool")


class _Invalid(Exception):
    """A bad request field: INVALID_ARGUMENT with this message."""


class _Worker:
    """What the conductor knows of one worker: its last load report and whether it answers."""

    def __init__(self, address: str, kind: str):
        self.address = address
        self.kind = kind
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
        )
        self.stub = (pb_grpc.PrefillWorkerStub if kind == "prefill" else pb_grpc.DecodeWorkerStub)(self.channel)
        self.load: pb.WorkerLoad | None = None
        self.healthy = False
        self.inflight_ms = 0.0  # prefill: predicted work routed here and not yet answered (between load reports)
        self.inflight = 0  # decode: streams routed here and not yet seen in a load report

    @property
    def worker_id(self) -> str:
        return self.load.worker_id if self.load is not None else self.address


class _Retry(Exception):
    """A worker went away mid-request: route again (it is out of routing until it answers a Load)."""

    def __init__(self, what: str, worker: _Worker, error: grpc.RpcError | None):
        super().__init__(what)
        self.what, self.worker, self.error = what, worker, error


class Routed(NamedTuple):
    decision_policy: str  # the policy's registry name
    prefill: _Worker      # the chosen prefill worker
    decode: _Worker       # the chosen decode worker
    fetch_from: str       # store node to pull the prefix from ("" = the worker's own lookup)
    fetch_blocks: int     # blocks to pull from there
    use_cache: bool       # False: compute everything (cache_off)
    predicted_ttft_ms: float
    predicted_prefill_ms: float  # the compute this request adds to the prefill worker's queue


class Conductor(GrpcServer, pb_grpc.ConductorServicer):
    """gRPC `Conductor`: Generate (server-streaming) and Status."""

    def __init__(self, config: ConductorConfig, lm=None):
        GrpcServer.__init__(self, config.host, config.port, config.metrics_port, config.grpc_workers)
        self.config = config
        if lm is None:
            from model import load_model

            lm = load_model(config.model, dtype="bfloat16")  # for its tokenizer and fingerprint: the smaller copy
        # Only the tokenizer and the architecture stay: the conductor never touches tensors.
        self.tokenizer = lm.tokenizer
        self.model_config = lm.config
        self.model_name = lm.name
        self.fingerprint = lm.fingerprint
        self.policies: dict[str, Policy] = {
            "mooncake": make_policy(
                "mooncake",
                kvcache_balancing_threshold=config.kvcache_balancing_threshold,
                transfer_mb_per_ms=config.transfer_mb_per_ms,
            ),
            "load_balance": make_policy("load_balance"),
            "random": make_policy("random", seed=config.random_seed),
            "cache_off": make_policy("cache_off"),
        }
        if config.policy not in self.policies:
            raise ValueError(f"ConductorConfig.policy: unknown policy {config.policy!r} (known: {', '.join(sorted(POLICIES))})")
        self._workers = [_Worker(a, "prefill") for a in config.prefill_workers] + [
            _Worker(a, "decode") for a in config.decode_workers
        ]
        self._index = Index(config.index_url) if config.index_url else None
        self._lock = threading.Lock()
        self._policy_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._quit = threading.Event()
        self.totals = {"requests": 0, "rejected": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._init_metrics()

    # ---- metrics ----

    def _init_metrics(self) -> None:
        r = self.registry
        self.m_requests = Counter("halfmoon_requests", "Generate requests by finish reason", ["reason"], registry=r)
        self.m_rejected = Counter("halfmoon_rejections", "Requests refused", ["reason"], registry=r)
        self.m_ttft = Histogram(
            "halfmoon_ttft_seconds", "Time to first token (at the conductor)", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.m_tbt = Histogram(
            "halfmoon_tbt_seconds", "Time between tokens (at the conductor)", registry=r,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
        )
        self.m_prompt = Counter("halfmoon_prompt_tokens", "Prompt tokens", registry=r)
        self.m_cached = Counter("halfmoon_cached_tokens", "Prompt tokens served from a cache, by tier", ["tier"], registry=r)
        self.m_generated = Counter("halfmoon_generated_tokens", "Tokens generated", registry=r)

    # ---- lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_ConductorServicer_to_server(self, server)
        return ["halfmoon.Conductor"]

    def _on_start(self) -> None:
        self.refresh_loads()
        self._poller = threading.Thread(target=self._poll, name="conductor-loads", daemon=True)
        self._poller.start()

    def _on_stop(self) -> None:
        self._quit.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        for w in self._workers:
            w.channel.close()
        if self._index is not None:
            self._index.close()

    def _poll(self) -> None:
        while not self._quit.wait(self.config.load_poll_s):
            self.refresh_loads()

    def refresh_loads(self) -> None:
        """Ask every worker for its load (in parallel); one that does not answer is out of routing."""
        futures = [(w, w.stub.Load.future(pb.LoadRequest(), timeout=self.config.load_timeout_s)) for w in self._workers]
        for w, f in futures:
            try:
                load = f.result()
            except grpc.RpcError:
                w.healthy = False
                continue
            if load.model_fingerprint and load.model_fingerprint != self.fingerprint:
                # A worker serving other weights would produce other answers and other block keys.
                w.healthy = False
                continue
            with self._lock:
                w.load, w.healthy = load, True
                # Routed work the report now counts (queued at the worker) is no longer in flight here.
                w.inflight, w.inflight_ms = 0, 0.0

    # ---- Generate ----

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        arrived = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex[:16]
        try:
            ids, policy_name = self._prepare(request)
        except _Invalid as exc:
            self.m_rejected.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sp, salt = request.sampling, request.cache_salt
        ms = lambda: (time.perf_counter() - arrived) * 1000.0  # noqa: E731
        text = IncrementalText(self.tokenizer.decode, sp.stop)
        out: list[int] = []     # tokens sent to the client
        times: list[float] = []
        first: pb.PrefillReply | None = None
        routed: Routed | None = None
        reason, decode_transfer_ms, max_batch, ttft_ms = "", 0.0, 0, 0.0
        failures = 0
        while not reason:
            # After a decode worker died: prefill the prompt and every token sent but the last (mostly
            # from cache), then decode on from the last one, so no token repeats and none goes missing.
            prompt = ids + out[:-1]
            keys = block_keys(prompt, self.config.block_size, self.fingerprint, salt)
            try:
                routed = self._route(request, prompt, keys, policy_name, sp.max_tokens - max(0, len(out) - 1))
            except Rejected as exc:
                if out:
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker lost and no pair left to resume on: {exc}")
                with self._lock:
                    self.totals["rejected"] += 1
                self.m_rejected.labels("slo").inc()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            if first is None:
                with self._lock:
                    self.totals["requests"] += 1
            try:
                reply = self._prefill(context, rid, prompt, sp, salt, routed)
                if reply is None:
                    self.m_requests.labels("cancelled").inc()
                    return
                if first is None:
                    first, ttft_ms = reply, ms()
                    self.m_ttft.observe(ttft_ms / 1000.0)
                    out, times = [reply.first_token], [ttft_ms]
                    yield pb.GenerateResponse(request_id=rid, token_ids=out, text=text.add(out), token_times_ms=times)
                dsp = pb.SamplingParams()
                dsp.CopyFrom(sp)
                dsp.max_tokens = sp.max_tokens - len(out) + 1  # the decode worker counts its first token too
                dreq = pb.DecodeRequest(request_id=rid, prompt_ids=prompt, first_token=out[-1], handle=reply.handle,
                                        sampling=dsp, cache_salt=salt)
                with self._lock:
                    routed.decode.inflight += 1
                call = routed.decode.stub.Decode(dreq, timeout=self._remaining(context, self.config.decode_timeout_s))
                context.add_callback(call.cancel)
                try:
                    for msg in call:
                        if msg.token_ids:
                            new_times = [max(t, times[-1]) for t in self._rebase(msg.token_times_ms, ms())]
                            for a, b in zip([times[-1], *new_times], new_times):
                                self.m_tbt.observe(max(0.0, b - a) / 1000.0)
                            out.extend(msg.token_ids)
                            times.extend(new_times)
                            max_batch = max([max_batch, *msg.batch_sizes])
                            delta = text.add(list(msg.token_ids))
                            yield pb.GenerateResponse(request_id=rid, token_ids=list(msg.token_ids), text=delta,
                                                      token_times_ms=new_times)
                            if text.stopped:
                                call.cancel()
                                reason = "stop"
                                break
                        if msg.finished:
                            reason, decode_transfer_ms = msg.finish_reason, decode_transfer_ms + msg.transfer_ms
                            break
                except grpc.RpcError as exc:
                    if not context.is_active():
                        self.m_requests.labels("cancelled").inc()
                        return
                    if not reason:
                        raise _Retry("decode", routed.decode, exc) from None
                if not reason:  # the stream ended without its final message: the worker went away
                    raise _Retry("decode", routed.decode, None)
            except _Retry as r:
                failures += 1
                if r.worker is not None:
                    r.worker.healthy = False
                if failures > len(self._workers) or not context.is_active():
                    self._downstream_failed(context, r.what, r.worker, r.error)
                continue
        rest = text.finish()
        usage = self._usage(ids, out, times, first, routed, ttft_ms, decode_transfer_ms, max_batch)
        self.m_requests.labels(reason).inc()
        self.m_generated.inc(len(out))
        yield pb.GenerateResponse(request_id=rid, text=rest, finished=True, finish_reason=reason, usage=usage)

    @staticmethod
    def _remaining(context: grpc.ServicerContext, cap: float) -> float:
        """A downstream deadline: ours (the client's) or `cap`, whichever comes first."""
        left = context.time_remaining()
        return cap if left is None else max(0.001, min(cap, left))

    def _prefill(self, context, rid, prompt, sp, salt, routed: Routed) -> pb.PrefillReply | None:
        """The prefill reply; None when the client went away; _Retry when the worker is gone."""
        preq = pb.PrefillRequest(
            request_id=rid, token_ids=prompt, sampling=sp, cache_salt=salt, fetch_from=routed.fetch_from,
            fetch_blocks=routed.fetch_blocks, no_cache=not routed.use_cache,
        )
        with self._lock:
            routed.prefill.inflight_ms += routed.predicted_prefill_ms
        try:
            fut = routed.prefill.stub.Prefill.future(preq, timeout=self._remaining(context, self.config.prefill_timeout_s))
            context.add_callback(fut.cancel)
            try:
                return fut.result()
            except grpc.FutureCancelledError:
                return None
            except grpc.RpcError as exc:
                if not context.is_active():
                    return None
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise _Retry("prefill", routed.prefill, exc) from None
                self._downstream_failed(context, "prefill", routed.prefill, exc)
        finally:
            with self._lock:
                routed.prefill.inflight_ms = max(0.0, routed.prefill.inflight_ms - routed.predicted_prefill_ms)

    @staticmethod
    def _rebase(decode_times: list[float], now: float) -> list[float]:
        """Decode-worker times (ms since it got the request) on the conductor's clock: end them at `now`."""
        if not decode_times:
            return []
        shift = now - decode_times[-1]
        return [t + shift for t in decode_times]

    def _downstream_failed(self, context, what: str, worker: _Worker, exc: grpc.RpcError | None):
        """End the request with the worker's own verdict (INVALID_ARGUMENT, RESOURCE_EXHAUSTED...), naming who said it."""
        code = exc.code() if exc is not None else grpc.StatusCode.UNAVAILABLE
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            worker.healthy = False
        self.m_requests.labels("error").inc()
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.UNAVAILABLE
        details = exc.details() if exc is not None else "stream ended early"
        context.abort(code, f"{what} worker {worker.worker_id}: {details}")

    def _usage(self, ids, out, times, reply: pb.PrefillReply, routed: Routed, ttft_ms, decode_transfer_ms, max_batch) -> pb.Usage:
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        cached = reply.cached_device_tokens + reply.cached_dram_tokens + reply.cached_ssd_tokens + reply.cached_remote_tokens
        with self._lock:
            self.totals["prompt_tokens"] += len(ids)
            self.totals["cached_tokens"] += cached
        self.m_prompt.inc(len(ids))
        for tier, n in (("device", reply.cached_device_tokens), ("dram", reply.cached_dram_tokens),
                        ("ssd", reply.cached_ssd_tokens), ("remote", reply.cached_remote_tokens)):
            if n:
                self.m_cached.labels(tier).inc(n)
        return pb.Usage(
            prompt_tokens=len(ids), completion_tokens=len(out), cached_tokens=cached,
            cached_device_tokens=reply.cached_device_tokens, cached_dram_tokens=reply.cached_dram_tokens,
            cached_ssd_tokens=reply.cached_ssd_tokens, cached_remote_tokens=reply.cached_remote_tokens,
            computed_prompt_tokens=reply.computed_tokens, ttft_ms=ttft_ms,
            tbt_mean_ms=sum(gaps) / len(gaps) if gaps else 0.0,
            tbt_p90_ms=gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))] if gaps else 0.0,
            prefill_worker=routed.prefill.worker_id, decode_worker=routed.decode.worker_id,
            queue_ms=reply.queue_ms, transfer_ms=reply.transfer_ms + decode_transfer_ms,
            max_decode_batch=max_batch, predicted_ttft_ms=routed.predicted_ttft_ms, policy=routed.decision_policy,
        )

    # ---- validation and routing ----

    def _prepare(self, r: pb.GenerateRequest) -> tuple[list[int], str]:
        """Token ids of the prompt and the policy name, or _Invalid naming the field."""
        c = self.model_config
        if r.model and r.model not in (self.model_name, self.config.model):
            raise _Invalid(f"model: unknown model {r.model!r} (this cluster serves {self.model_name!r})")
        policy = r.policy or self.config.policy
        if policy not in self.policies:
            raise _Invalid(f"policy: unknown policy {policy!r} (known: {', '.join(sorted(self.policies))})")
        sp = r.sampling
        if sp.max_tokens < 1:
            raise _Invalid(f"sampling.max_tokens: must be at least 1, got {sp.max_tokens}")
        if sp.max_tokens > self.config.max_tokens_limit:
            raise _Invalid(f"sampling.max_tokens: {sp.max_tokens} is above the limit of {self.config.max_tokens_limit}")
        if sp.temperature < 0:
            raise _Invalid(f"sampling.temperature: must be >= 0, got {sp.temperature}")
        if not 0 <= sp.top_p <= 1:
            raise _Invalid(f"sampling.top_p: must be in [0, 1], got {sp.top_p}")
        if sp.top_k < 0:
            raise _Invalid(f"sampling.top_k: must be >= 0, got {sp.top_k}")
        if r.ttft_slo_ms < 0 or r.tbt_slo_ms < 0:
            raise _Invalid("ttft_slo_ms/tbt_slo_ms: must be >= 0 (0 = the conductor's default)")
        kind = r.WhichOneof("prompt")
        if kind is None:
            raise _Invalid("prompt: one of text, token_ids or chat is required")
        if kind == "text":
            if not r.text:
                raise _Invalid("prompt.text: empty prompt")
            ids = self.tokenizer.encode(r.text)
        elif kind == "token_ids":
            ids = list(r.token_ids.ids)
            if not ids:
                raise _Invalid("prompt.token_ids: empty prompt")
            bad = [t for t in ids if not 0 <= t < c.vocab_size]
            if bad:
                raise _Invalid(f"prompt.token_ids: id {bad[0]} is outside the vocabulary [0, {c.vocab_size})")
        else:
            msgs = r.chat.messages
            if not msgs:
                raise _Invalid("prompt.chat: no messages")
            for i, m in enumerate(msgs):
                if m.role not in _ROLES:
                    raise _Invalid(f"prompt.chat.messages[{i}].role: {m.role!r} is not one of {', '.join(_ROLES)}")
            ids = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs])
        if not ids:
            raise _Invalid("prompt: empty after tokenization")
        if len(ids) >= c.max_position_embeddings:
            raise _Invalid(f"prompt: {len(ids)} tokens do not fit the context window of {c.max_position_embeddings} tokens")
        return ids, policy

    def _state(self, keys: list[bytes]) -> ClusterState:
        matches: dict[str, int] = {}
        if self._index is not None and keys:
            try:
                for node, found in self._index.longest_prefix(keys).items():
                    matches[node] = int(found[0] if isinstance(found, tuple) else found.num_blocks)
            except Exception:  # noqa: BLE001 - an unreachable index means routing without cache knowledge
                matches = {}
        prefill, decode = [], []
        block_bytes = 0
        with self._lock:
            for w in self._workers:
                ld = w.load
                if ld is None:
                    continue
                if w.kind == "prefill":
                    block_bytes = max(block_bytes, ld.block_bytes)
                    prefill.append(PrefillCandidate(
                        ld.worker_id, tuple(ld.nodes), ld.predicted_queue_ms + w.inflight_ms, tuple(ld.prefill_coef), w.healthy
                    ))
                else:
                    decode.append(DecodeCandidate(
                        ld.worker_id, ld.running + ld.waiting + w.inflight, ld.free_blocks, ld.total_blocks,
                        ld.total_context_tokens, tuple(ld.decode_coef), w.healthy,
                    ))
        return ClusterState(prefill, decode, matches, self.config.block_size, block_bytes)

    def _route(self, r: pb.GenerateRequest, ids: list[int], keys: list[bytes], policy_name: str, max_tokens: int) -> Routed:
        info = RequestInfo(
            len(ids), max_tokens, r.ttft_slo_ms or self.config.ttft_slo_ms, r.tbt_slo_ms or self.config.tbt_slo_ms
        )
        state = self._state(keys)
        with self._policy_lock:  # the random policy's generator is not thread-safe
            d = self.policies[policy_name].choose(info, state)
        with self._lock:
            by_id = {w.worker_id: w for w in self._workers}
        return Routed(policy_name, by_id[d.prefill], by_id[d.decode], d.fetch_from, d.fetch_blocks, d.use_cache, d.predicted_ttft_ms,
                      d.predicted_prefill_ms)

    # ---- Status ----

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        reply = pb.StatusReply(
            model=self.model_name,
            block_size=self.config.block_size,
            default_policy=self.config.policy,
            vocab_size=self.model_config.vocab_size,
        )
        with self._lock:
            for w in self._workers:
                ws = reply.workers.add(worker_id=w.worker_id, kind=w.kind, address=w.address, healthy=w.healthy)
                if w.load is not None:
                    ws.load.CopyFrom(w.load)
            reply.requests_total = self.totals["requests"] + self.totals["rejected"]
            reply.requests_rejected = self.totals["rejected"]
            reply.prompt_tokens_total = self.totals["prompt_tokens"]
            reply.cached_tokens_total = self.totals["cached_tokens"]
        for address in self.config.store_addresses:
            reply.stores.append(self._store_status(address))
        return reply

    def ClearCache(self, request: pb.ClearCacheRequest, context: grpc.ServicerContext) -> pb.ClearCacheReply:
        reply = pb.ClearCacheReply()
        for address in self.config.store_addresses:
            client = StoreClient(address, transport="grpc", timeout_s=self.config.load_timeout_s)
            try:
                reply.store_blocks += client.clear()
            except Exception as exc:  # noqa: BLE001 - a half-cleared cluster must say so, not pretend
                context.abort(grpc.StatusCode.UNAVAILABLE, f"store {address} could not be cleared: {exc}")
            finally:
                client.close()
        for w in [w for w in self._workers if w.kind == "prefill"]:
            try:
                reply.device_blocks += w.stub.ClearCache(pb.ClearCacheRequest(), timeout=self.config.load_timeout_s).device_blocks
            except grpc.RpcError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {w.worker_id} could not be cleared: {exc.details()}")
        return reply

    def _store_status(self, address: str) -> pb.StoreStatus:
        st = pb.StoreStatus(address=address)
        try:
            client = StoreClient(address, transport="grpc", timeout_s=self.config.load_timeout_s)
            try:
                stats = client.stats()
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - an unreachable store shows up with no tiers
            return st
        st.node_id = getattr(stats, "node_id", "")
        for t in getattr(stats, "tiers", []):
            st.tiers.add(
                tier=t.tier, used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes, blocks=t.blocks,
                hits=t.hits, misses=getattr(t, "misses", 0), evictions=t.evictions,
            )
        return st
