"""Open-loop trace replay: send each prompt at its arrival time, whatever the cluster's state."""

from __future__ import annotations

import asyncio
import math
import time
from typing import NamedTuple

import grpc

from client.api import AsyncClient
from client.report import ReplayRecord
from client.synth import Prompt


class ReplaySettings(NamedTuple):
    """What every request of one replay run carries."""

    policy: str = ""  # routing policy ("" = the conductor's default)
    cache_salt: str = ""  # block-key salt: a fresh salt is a cold, private cache for this run
    ttft_slo_ms: float = 0.0  # sent with each request (the conductor admits against it)
    tbt_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0
    ignore_eos: bool = True  # answers as long as the trace says
    progress: bool = True  # a tqdm bar on stderr
    desc: str = "replay"


def _gaps(server_times: list[float], client_times: list[float]) -> list[float]:
    """Token gaps, from the server's per-token times when it gave one per token, else the
    client's."""
    t = server_times if len(server_times) == len(client_times) and server_times else client_times
    return [b - a for a, b in zip(t, t[1:])]


async def _one(client: AsyncClient, p: Prompt, s: ReplaySettings, t0: float) -> ReplayRecord:
    sent = time.monotonic()
    server_t: list[float] = []
    client_t: list[float] = []
    usage = None
    reason = ""
    status, error = "ok", ""
    try:
        async for c in client.generate_stream(
            token_ids=p.token_ids,
            max_tokens=p.max_tokens,
            ignore_eos=s.ignore_eos,
            policy=s.policy,
            cache_salt=s.cache_salt,
            ttft_slo_ms=s.ttft_slo_ms,
            tbt_slo_ms=s.tbt_slo_ms,
            tpot_slo_ms=s.tpot_slo_ms,
            request_id=f"{s.cache_salt or 'replay'}-{p.index}",
        ):
            server_t.extend(c.token_times_ms)
            client_t.extend([(c.received_s - sent) * 1000.0] * len(c.token_ids))
            if c.finished:
                usage, reason = c.usage, c.finish_reason
    except grpc.aio.AioRpcError as e:
        status = "rejected" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
        error = f"{e.code().name}: {e.details()}"
    if status == "ok" and reason in ("error", "cancelled", ""):
        status, error = "error", f"stream ended with finish_reason={reason or 'none'}"
    end = time.monotonic()
    u = usage
    return ReplayRecord(
        index=p.index,
        policy=s.policy,
        arrival_s=p.arrival_s,
        sent_s=sent - t0,
        status=status,
        error=error,
        prompt_tokens=(u.prompt_tokens if u is not None and u.prompt_tokens else len(p.token_ids)),
        output_tokens=len(client_t),
        ttft_ms=client_t[0] if client_t else math.nan,
        gaps_ms=_gaps(server_t, client_t),
        e2e_ms=(end - sent) * 1000.0,
        cached_tokens={
            "device": u.cached_device_tokens if u else 0,
            "dram": u.cached_dram_tokens if u else 0,
            "ssd": u.cached_ssd_tokens if u else 0,
            "remote": u.cached_remote_tokens if u else 0,
        },
        computed_tokens=u.computed_prompt_tokens if u else 0,
        prefill_worker=u.prefill_worker if u else "",
        decode_worker=u.decode_worker if u else "",
        predicted_ttft_ms=u.predicted_ttft_ms if u else 0.0,
        predicted_tbt_ms=u.predicted_tbt_ms if u else 0.0,
        queue_ms=u.queue_ms if u else 0.0,
        prefill_ms=u.prefill_ms if u else 0.0,
        answered_ms=u.prefill_answered_ms if u else 0.0,
    )


async def replay_async(
    address: str, prompts: list[Prompt], settings: ReplaySettings
) -> list[ReplayRecord]:
    """Send every prompt at its arrival time (open loop) and gather one record each, in trace
    order."""
    from tqdm import tqdm

    bar = tqdm(
        total=len(prompts),
        desc=settings.desc,
        unit="req",
        disable=not settings.progress,
        leave=True,
    )
    counts = {"ok": 0, "rejected": 0, "error": 0}

    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            counts[task.result().status] += 1
        bar.update(1)
        bar.set_postfix(counts, refresh=False)

    async with AsyncClient(address) as client:
        t0 = time.monotonic()
        tasks = []
        for p in sorted(prompts, key=lambda p: p.arrival_s):
            delay = t0 + p.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(client, p, settings, t0))
            task.add_done_callback(done)
            tasks.append(task)
        records = await asyncio.gather(*tasks)
    bar.close()
    return sorted(records, key=lambda r: r.index)


def replay(address: str, prompts: list[Prompt], settings: ReplaySettings) -> list[ReplayRecord]:
    return asyncio.run(replay_async(address, prompts, settings))
