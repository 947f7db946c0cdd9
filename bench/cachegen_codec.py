r"""The CacheGen KV codec (kvstore/cachegen.py) on SmolLM2-135M: size, quality and speed per level.

Size: encoded bytes per token of the context's KV (every chunk of `--chunk-tokens` tokens of every
window, headers, scales and tables included) against fp16 (2 bytes a number), the store's int8
codec (1 byte a number + an fp32 scale per token and head) and kivi4 (the store's packed 16-token
block, fp16 scales and zero points included).

Quality: the method of bench/kv_quality.py (its `run_sequence` and helpers, imported): each window
of `--window-tokens` tokens of the text runs through the model's chunked prefill over a float64
KVPool, `--prefill-tokens` at a time (default: `--chunk-tokens`); after each prefill chunk is
computed, the K/V of the CacheGen chunk it belongs to, so far, is replaced by its round trip
(encode then decode of the exact K/V, as a prefix loaded from the store would arrive). So every
token attends to decoded KV for everything before its own prefill chunk and to the exact KV of
that chunk, which is what a worker holds when it extends a prefix fetched from the store. With
`--prefill-tokens` below `--chunk-tokens` a CacheGen chunk is re-encoded from its exact K/V each
time it grows (the steps of a partial chunk come from fewer tokens, so the interim copies are a
little closer than the final one; the size counts each chunk's final encoding).
Reference: the same run with the fp32 KV left alone ("full precision"; fp32 weights and compute).
Measured: perplexity of each level over all windows and its ratio to the reference's, the share of
positions whose argmax matches the reference's (teacher forced), and greedy continuations
(`--greedy-tokens` after `--greedy-prompts` prompts of `--greedy-prompt-tokens` tokens, the prompt
stored as CacheGen chunks, each level decoding its own continuation) against the reference's.

Speed: encode and decode of the first window's KV, chunk by chunk, best of `--speed-reps`, in MB/s
of the fp16-equivalent KV (2 bytes a number), with `--codec-threads` torch threads (1: the range
coder is single-threaded anyway, and a worker decodes beside its model).

Prints progress, a table, and ends with one JSON line.

    .venv/bin/python bench/cachegen_codec.py [--windows 2] [--window-tokens 2048] \
        [--chunk-tokens 1024] [--prefill-tokens 256] [--levels 1,2,3,4] [--greedy-prompts 4] \
        [--greedy-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kv_quality import (  # noqa: E402
    DEFAULT_TEXT,
    FP32,
    RATIO_TARGET,
    STORE_BLOCK,
    SimCache,
    Tally,
    greedy_agreement,
    int_list,
    run_sequence,
    say,
)
from bench.machine import cpu_flags, finish  # noqa: E402
from kvstore.client.cachegen import (  # noqa: E402
    DEFAULT_LEVEL,
    GROUP_SIZE,
    LEVELS,
    cachegen_decode,
    cachegen_encode,
)
from kvstore.client.codecs import get_codec  # noqa: E402

MB = 1e6


class Sizes(NamedTuple):
    """Bytes per token of the context's KV in each format."""

    fp16: float  # 2 bytes a number
    int8: float  # kvstore's int8 codec
    kivi4: float  # kvstore's kivi4 codec (packed 16-token blocks)


class Speed(NamedTuple):
    encode_mb_s: float  # fp16-equivalent MB of KV encoded per second
    decode_mb_s: float  # same, decoded


def baseline_sizes(block_shape: tuple[int, ...]) -> Sizes:
    """The store's formats, per token, for blocks of `block_shape` ([L, 2, 16, H, D])."""
    numbers = block_shape[0] * 2 * block_shape[3] * block_shape[4]
    return Sizes(
        fp16=2.0 * numbers,
        int8=get_codec("int8").bytes_per_token(block_shape, torch.float16),
        kivi4=get_codec("kivi4").bytes_per_token(block_shape, torch.float16),
    )


def write_kv(cache: SimCache, start: int, kv: torch.Tensor) -> None:
    """Positions [start, start + T) of the cache's pool := kv [L, 2, T, H, D]."""
    blk, off = cache.slots(start, start + kv.shape[2])
    cache.pool.kv[blk, :, :, off] = kv.permute(2, 0, 1, 3, 4).to(cache.pool.kv.dtype)


class RoundTrip:
    """on_chunk hook of run_sequence: after each prefill chunk, the open CacheGen chunk (up to
    `chunk_tokens` tokens) is encoded at `level` from its exact K/V and the pool gets the decoded
    copy. Counts the bytes of each CacheGen chunk's final encoding; call close() after each
    sequence."""

    def __init__(self, level: int, chunk_tokens: int) -> None:
        self.level = level
        self.chunk_tokens = chunk_tokens
        self.closed_bytes = 0  # final encodings of the chunks closed so far
        self.closed_tokens = 0
        self.span_start = 0  # first position of the open chunk
        self.exact: list[torch.Tensor] = []  # its exact K/V, prefill chunk by prefill chunk
        self.open_bytes = 0  # its latest encoding

    def __call__(self, cache: SimCache, start: int, end: int) -> None:
        if start == 0:
            self.close()
        self.exact.append(cache.read(start, end).float())
        data = cachegen_encode(torch.cat(self.exact, dim=2), self.level)
        write_kv(cache, self.span_start, cachegen_decode(data, torch.float32))
        self.open_bytes = len(data)
        if end - self.span_start >= self.chunk_tokens:
            self.close()
            self.span_start = end

    def close(self) -> None:
        """Count the open chunk as it stands and start a new one."""
        if self.exact:
            self.closed_bytes += self.open_bytes
            self.closed_tokens += sum(x.shape[2] for x in self.exact)
        self.exact, self.open_bytes, self.span_start = [], 0, 0

    @property
    def bytes_per_token(self) -> float:
        return self.closed_bytes / max(1, self.closed_tokens)


def codec_speed(kv: torch.Tensor, chunk: int, level: int, reps: int) -> Speed:
    """Best-of-`reps` encode and decode MB/s of kv [L, 2, T, H, D], `chunk` tokens at a time."""
    chunks = [kv[:, :, s : s + chunk].contiguous() for s in range(0, kv.shape[2], chunk)]
    fp16_mb = 2 * kv.numel() / MB
    enc_best = dec_best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        streams = [cachegen_encode(c, level) for c in chunks]
        t1 = time.perf_counter()
        for s in streams:
            cachegen_decode(s, torch.float16)
        t2 = time.perf_counter()
        enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
    return Speed(fp16_mb / enc_best, fp16_mb / dec_best)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window-tokens", type=int, default=2048)
    # 1024: CacheGen's chunks are 1-1.5K tokens; at 256 the scales and tables cost ~10% more
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per CacheGen chunk")
    ap.add_argument(
        "--prefill-tokens", type=int, default=256, help="prefill chunk (0: --chunk-tokens)"
    )
    ap.add_argument("--levels", default=",".join(str(n) for n in sorted(LEVELS)))
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-prompt-tokens", type=int, default=512)
    ap.add_argument("--greedy-tokens", type=int, default=32, help="0 skips the greedy runs")
    ap.add_argument("--speed-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--codec-threads", type=int, default=1, help="torch threads while timing the codec"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = int_list(args.levels)
    for n in levels:
        if n not in LEVELS:
            raise SystemExit(f"--levels: no level {n}; known: {sorted(LEVELS)}")
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    wt, chunk = args.window_tokens, args.chunk_tokens
    step = args.prefill_tokens or chunk
    if chunk % step:
        raise SystemExit(f"--chunk-tokens {chunk} must be a multiple of --prefill-tokens {step}")

    from model import load_model

    say(
        f"loading {args.model} (fp32 weights and compute); {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, load average {load_start:.2f}, "
        f"cpu flags {cpu_flags()}"
    )
    lm = load_model(args.model, torch.float32)
    model, config = lm.model, lm.config
    tokens = lm.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"), add_bos=False)
    if args.windows * wt > len(tokens):
        raise SystemExit(f"{args.windows} x {wt} tokens asked, the text has {len(tokens)}")
    block_shape = (config.num_layers, 2, STORE_BLOCK, config.num_kv_heads, config.head_dim)
    base = baseline_sizes(block_shape)
    say(
        f"{len(tokens)} tokens of {Path(args.text).name}; {args.windows} windows x {wt} tokens, "
        f"CacheGen chunks of {chunk} tokens (groups of {GROUP_SIZE}), prefill chunks of {step}; "
        f"levels {levels}; "
        f"bytes/token: fp16 {base.fp16:.0f}, int8 {base.int8:.0f}, kivi4 {base.kivi4:.0f}"
    )

    ref = Tally()
    tally = {n: Tally() for n in levels}
    trips = {n: RoundTrip(n, chunk) for n in levels}
    first_kv = None
    for w in range(args.windows):
        ids = tokens[w * wt : (w + 1) * wt]
        t0 = time.perf_counter()
        run = run_sequence(model, ids, FP32, step)
        ref.add(run, None)
        ref_argmax = run.argmax
        if first_kv is None:
            first_kv = run.cache.read(0, len(ids)).float()
        say(
            f"window {w + 1}/{args.windows} fp32 KV   ppl {ref.window_ppl[-1]:8.3f}"
            f"  {time.perf_counter() - t0:6.1f} s"
        )
        for n in levels:
            t0 = time.perf_counter()
            tally[n].add(run_sequence(model, ids, FP32, step, on_chunk=trips[n]), ref_argmax)
            trips[n].close()
            t = tally[n]
            say(
                f"window {w + 1}/{args.windows} level {n}    ppl {t.window_ppl[-1]:8.3f}"
                f"  (all windows so far: x{t.ppl / ref.ppl:.4f} of fp32 KV)"
                f"  {trips[n].bytes_per_token:7.0f} B/token"
                f"  {time.perf_counter() - t0:6.1f} s"
            )
        say(f"elapsed {time.perf_counter() - t_start:.0f} s, load average {os.getloadavg()[0]:.2f}")

    greedy: dict[int, dict[str, float]] = {}
    if args.greedy_tokens > 0 and args.greedy_prompts > 0:
        p, n_prompts = args.greedy_prompt_tokens, args.greedy_prompts
        span = max(0, len(tokens) - p)
        starts = [i * span // max(1, n_prompts - 1) for i in range(n_prompts)]
        outs: dict[int | None, list[list[int]]] = {None: [], **{n: [] for n in levels}}
        for i, st in enumerate(starts):
            t0 = time.perf_counter()
            prompt = tokens[st : st + p]
            outs[None].append(run_sequence(model, prompt, FP32, step, args.greedy_tokens).generated)
            for n in levels:
                hook = RoundTrip(n, chunk)
                run = run_sequence(model, prompt, FP32, step, args.greedy_tokens, on_chunk=hook)
                outs[n].append(run.generated)
            say(
                f"greedy {i + 1}/{n_prompts}: prompt at token {st}"
                f"  {time.perf_counter() - t0:.0f} s"
            )
        greedy = {n: greedy_agreement(outs[None], outs[n]) for n in levels}

    say(f"timing encode/decode with {args.codec_threads} torch thread(s)")
    model_threads = torch.get_num_threads()
    torch.set_num_threads(args.codec_threads)
    speed = {n: codec_speed(first_kv, chunk, n, args.speed_reps) for n in levels}
    torch.set_num_threads(model_threads)

    scored = ref.count
    size = {n: trips[n].bytes_per_token for n in levels}
    ratio = {n: tally[n].ppl / ref.ppl for n in levels}
    top1 = {n: tally[n].top1 / scored for n in levels}
    say("")
    say(
        f"{'level':<7}{'K bins':>17}{'V bins':>17}{'B/token':>9}{'vs fp16':>10}{'vs int8':>9}"
        f"{'vs kivi4':>10}{'ppl':>9}{'vs fp32':>9}{'top-1':>8}{'greedy':>8}{'enc MB/s':>10}"
        f"{'dec MB/s':>10}"
    )
    say(f"{'fp32 KV':<7}{'':>72}{ref.ppl:>9.3f}{1.0:>9.4f}")
    for n in levels:
        spec = LEVELS[n]
        g = greedy.get(n, {}).get("prefix", float("nan"))
        say(
            f"{n:<7}{str(spec.key_bins):>17}{str(spec.value_bins):>17}{size[n]:>9.0f}"
            f"{base.fp16 / size[n]:>9.2f}x{base.int8 / size[n]:>8.2f}x{base.kivi4 / size[n]:>9.2f}x"
            f"{tally[n].ppl:>9.3f}{ratio[n]:>9.4f}{top1[n]:>8.4f}{g:>8.3f}"
            f"{speed[n].encode_mb_s:>10.1f}{speed[n].decode_mb_s:>10.1f}"
        )

    d = DEFAULT_LEVEL if DEFAULT_LEVEL in levels else levels[len(levels) // 2]
    result: dict = {"bench": "cachegen_codec", "model": args.model, "default_level": d}
    result["cachegen_size_vs_int8"] = round(base.int8 / size[d], 4)
    result["cachegen_ppl_vs_fp"] = round(ratio[d], 5)
    result["cachegen_decode_mb_s"] = round(speed[d].decode_mb_s, 1)
    result["cachegen_encode_mb_s"] = round(speed[d].encode_mb_s, 1)
    result["cachegen_ppl_within_target"] = ratio[d] <= RATIO_TARGET
    for n in levels:
        result[f"level{n}_size_vs_int8"] = round(base.int8 / size[n], 4)
        result[f"level{n}_size_vs_fp16"] = round(base.fp16 / size[n], 4)
        result[f"level{n}_size_vs_kivi4"] = round(base.kivi4 / size[n], 4)
        result[f"level{n}_ppl_vs_fp"] = round(ratio[n], 5)
        result[f"level{n}_top1_vs_fp"] = round(top1[n], 5)
        result[f"level{n}_bytes_per_token"] = round(size[n], 1)
        result[f"level{n}_decode_mb_s"] = round(speed[n].decode_mb_s, 1)
        result[f"level{n}_encode_mb_s"] = round(speed[n].encode_mb_s, 1)
    result.update(
        {
            "levels": {str(n): LEVELS[n]._asdict() for n in levels},
            "greedy_agreement": {str(n): a for n, a in greedy.items()},
            "bytes_per_token_fp16": base.fp16,
            "bytes_per_token_int8": base.int8,
            "bytes_per_token_kivi4": base.kivi4,
            "reference": "fp32 KV cache, fp32 weights and compute",
            "ppl_fp32_kv": round(ref.ppl, 4),
            **{f"ppl_level{n}": round(tally[n].ppl, 4) for n in levels},
            "group_size": GROUP_SIZE,
            "chunk_tokens": chunk,
            "prefill_tokens": step,
            "windows": args.windows,
            "window_tokens": wt,
            "tokens_scored": scored,
            "greedy": {
                "prompts": args.greedy_prompts if greedy else 0,
                "prompt_tokens": args.greedy_prompt_tokens,
                "new_tokens": args.greedy_tokens,
            },
            "text": os.path.relpath(args.text, ROOT),
            "torch_threads": torch.get_num_threads(),
            "codec_torch_threads": args.codec_threads,
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
    )
    return finish(result, load_start)


if __name__ == "__main__":
    sys.exit(main())
