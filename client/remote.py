"""`halfmoon generate` against a running cluster: stream the answer to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time

from client.api import Client


def usage_dict(usage) -> dict:
    """The Usage message as a plain dict (every field, zeros included)."""
    if usage is None:
        return {}
    return {f.name: getattr(usage, f.name) for f in usage.DESCRIPTOR.fields}


def generate_remote(args: argparse.Namespace) -> int:
    kwargs = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    out = sys.stdout
    sent = time.monotonic()
    with Client(args.address) as client:
        last = None
        for chunk in client.generate_stream(**kwargs):
            last = chunk
            if args.json:
                record = {
                    "request_id": chunk.request_id,
                    "token_ids": chunk.token_ids,
                    "text": chunk.text,
                    "token_times_ms": chunk.token_times_ms,
                    "client_ms": round((chunk.received_s - sent) * 1000, 3),
                    "finished": chunk.finished,
                }
                if chunk.finished:
                    record["finish_reason"] = chunk.finish_reason
                    record["usage"] = usage_dict(chunk.usage)
                out.write(json.dumps(record) + "\n")
            else:
                out.write(chunk.text)
            out.flush()
    if not args.json:
        out.write("\n")
        if last is not None and last.usage is not None:
            u = last.usage
            where = (
                f"prefilled on {u.decode_worker}"
                if u.prefill_on_decode
                else f"{u.prefill_worker} -> {u.decode_worker}"
            )
            print(
                f"[{u.completion_tokens} tokens, {last.finish_reason}; TTFT {u.ttft_ms:.0f} ms, "
                f"TBT {u.tbt_mean_ms:.1f} ms; prompt {u.prompt_tokens} tokens, "
                f"{u.cached_tokens} cached; {where}]",
                file=sys.stderr,
            )
    return 0
