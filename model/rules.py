"""The request rules every generator shares (the engine here, the cluster's workers and conductor):
what makes a prompt acceptable, and when a sequence stops."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.sampling import SamplingParams


def prompt_problem(ids: Sequence[int], vocab_size: int, context_window: int) -> str:
    """'' for a usable prompt; else what is wrong with it (empty, out-of-vocabulary id, too
    long)."""
    if len(ids) == 0:
        return "empty prompt: nothing to generate from"
    if len(ids) >= context_window:
        return (
            f"prompt of {len(ids)} tokens does not fit the context window of "
            f"{context_window} tokens"
        )
    for t in ids:
        if not 0 <= int(t) < vocab_size:
            return f"token id {t} is outside the vocabulary [0, {vocab_size})"
    return ""


def finish_reason(
    out: Sequence[int],
    params: SamplingParams,
    eos_ids: Collection[int],
    budget: int,
    decode: Callable[[list[int]], str],
) -> str:
    """'' while a sequence goes on; 'stop' when its last token is a stop or EOS token or its text
    holds a stop string; 'length' when it has `budget` tokens."""
    tok = out[-1]
    if tok in params.stop_token_ids or (not params.ignore_eos and tok in eos_ids):
        return "stop"
    if params.stop:
        # Checked after every token, so only a stop string ending in the newest token is new:
        # decode the tail that can hold one (up to 4 tokens a character for byte-level pieces),
        # not the whole answer again at every step.
        tail = 4 * max(len(s) for s in params.stop) + 4
        text = decode(list(out[-tail:]))
        if any(s in text for s in params.stop):
            return "stop"
    if len(out) >= budget:
        return "length"
    return ""
