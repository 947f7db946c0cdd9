"""Request validation every server shares: each check returns '' or a message that names the field,
for an INVALID_ARGUMENT answer."""

from __future__ import annotations

from collections.abc import Sequence

from model import prompt_problem
from protos import halfmoon_pb2 as pb

# Stop strings are matched against the answer at every step: their number and length are bounded
# so that a request cannot make each step's check arbitrarily slow.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
# A request value quoted in an error message is cut to this many characters: a status message
# travels in a header, and a client refuses headers beyond 16 KiB (the error would be lost).
MAX_SHOWN_CHARS = 64


def shown(value: str) -> str:
    """`value` quoted for an error message, cut to MAX_SHOWN_CHARS (its length said)."""
    if len(value) <= MAX_SHOWN_CHARS:
        return repr(value)
    return f"{value[:MAX_SHOWN_CHARS]!r}... ({len(value)} characters)"


def prompt_ids_problem(field: str, ids: Sequence[int], vocab_size: int, context_window: int) -> str:
    """The model's prompt rules (model.prompt_problem), naming the request field."""
    problem = prompt_problem(ids, vocab_size, context_window)
    return f"{field}: {problem}" if problem else ""


def sampling_problem(
    sp: pb.SamplingParams, max_tokens_limit: int = 0, field: str = "sampling"
) -> str:
    """max_tokens at least 1 (and at most the limit when one is given), temperature >= 0,
    top_p in [0, 1] (0 = off), top_k >= 0, at most MAX_STOP_STRINGS stop strings of at most
    MAX_STOP_CHARS characters."""
    if sp.max_tokens < 1:
        return f"{field}.max_tokens: must be at least 1, got {sp.max_tokens}"
    if max_tokens_limit and sp.max_tokens > max_tokens_limit:
        return f"{field}.max_tokens: {sp.max_tokens} is above the limit of {max_tokens_limit}"
    if sp.temperature < 0:
        return f"{field}.temperature: must be >= 0, got {sp.temperature}"
    if not 0 <= sp.top_p <= 1:
        return f"{field}.top_p: must be in [0, 1], got {sp.top_p}"
    if sp.top_k < 0:
        return f"{field}.top_k: must be >= 0, got {sp.top_k}"
    if len(sp.stop) > MAX_STOP_STRINGS:
        return f"{field}.stop: {len(sp.stop)} stop strings, the limit is {MAX_STOP_STRINGS}"
    for i, stop in enumerate(sp.stop):
        if len(stop) > MAX_STOP_CHARS:
            return f"{field}.stop[{i}]: {len(stop)} characters, the limit is {MAX_STOP_CHARS}"
    return ""
