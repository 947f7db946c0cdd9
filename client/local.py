"""`halfmoon generate --local`: the single-process reference (load, tokenize, prefill, decode) in
this process."""

from __future__ import annotations

import argparse
import json
import sys
import time

from model import Engine, SamplingParams, load_model


def generate_local(args: argparse.Namespace) -> int:
    """Print the completion of args.prompt (or one JSON record with --json); errors raise
    ValueError/FileNotFoundError."""
    if not args.prompt or not args.prompt.strip():
        raise ValueError("empty prompt: give the text to complete")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    lm = load_model(args.model, dtype=args.dtype)
    tok = lm.tokenizer
    if args.chat:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
    else:
        prompt_ids = tok.encode(args.prompt)
    engine = Engine(lm)
    engine.check_prompt(prompt_ids)
    start = time.perf_counter()
    out = engine.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    text = tok.decode(out)
    if args.json:
        record = {
            "model": lm.name,
            "text": text,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(out),
            "token_ids": out,
            "seconds": round(elapsed, 4),
        }
        print(json.dumps(record))
    else:
        print(text if args.chat else args.prompt + text)
    sys.stdout.flush()
    return 0
