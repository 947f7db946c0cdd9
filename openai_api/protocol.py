"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions: a request
body checked field by field into a GenerationSpec (or an ApiError naming the field), and the
bodies and stream chunks of the answer."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

COMPLETIONS = "completions"
CHAT = "chat"

INT64_MAX = (1 << 63) - 1

# The finish reasons OpenAI defines, from the conductor's (cancelled and error never reach here:
# they end the call with a gRPC status).
FINISH_REASONS = {"stop": "stop", "length": "length"}


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP status, message, the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )
        self.headers = headers  # HTTP headers the answer carries (a 429's Retry-After)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    """A 400 naming `param`; the message starts with the field, as the gRPC API's do."""
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


class GenerationSpec(NamedTuple):
    """One OpenAI request, checked, in the terms of halfmoon's GenerateRequest."""

    endpoint: str  # completions | chat
    model: str  # the name the client asked for ("" = not given)
    prompt: str | None  # completions: raw text
    token_ids: list[int] | None  # completions: token ids
    messages: list[dict] | None  # chat: [{"role", "content"}], content as plain text
    max_tokens: int
    max_tokens_param: str  # the field max_tokens came from (errors name it)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None  # None = none given (a sampled answer then varies between requests)
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage
    # halfmoon's extension `slo`: this request's objectives in ms (0 = the cluster's defaults)
    ttft_slo_ms: float = 0.0
    tbt_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0


# Fields of OpenAI's (and vLLM's, which the benchmark tools send) requests for features halfmoon
# does not have: accepted only at a value that asks for nothing (null always is), so a client that
# spells its defaults out still works; any other value is a 400 naming the field.
_NEUTRAL: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),  # vLLM's
    "min_tokens": (0,),  # vLLM's
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}
# completions: logprobs is a count (0 still asks for the chosen token's); chat: a flag
_NEUTRAL_LOGPROBS = {COMPLETIONS: (), CHAT: (False,)}
_UNSUPPORTED = {
    COMPLETIONS: (
        "n best_of echo suffix logprobs logit_bias presence_penalty frequency_penalty "
        "repetition_penalty min_tokens"
    ).split(),
    CHAT: (
        "n logprobs top_logprobs logit_bias presence_penalty frequency_penalty repetition_penalty "
        "min_tokens tools tool_choice parallel_tool_calls functions function_call "
        "response_format modalities store service_tier audio prediction reasoning_effort "
        "web_search_options"
    ).split(),
}
_COMMON = "model max_tokens temperature top_p seed stop stream stream_options user".split()
# vLLM's top_k and ignore_eos; metadata unused; halfmoon's slo: {"ttft_ms", "tbt_ms", "tpot_ms"}
_EXTENSIONS = ["top_k", "ignore_eos", "metadata", "slo"]
_KNOWN = {
    COMPLETIONS: {"prompt", *_COMMON, *_EXTENSIONS, *_UNSUPPORTED[COMPLETIONS]},
    CHAT: {"messages", "max_completion_tokens", *_COMMON, *_EXTENSIONS, *_UNSUPPORTED[CHAT]},
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_KEYS = {"role", "content", "name"}


def parse_request(endpoint: str, body: Any, default_max_tokens: int) -> GenerationSpec:
    """The request body as a GenerationSpec; ApiError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name in body:
        if name not in _KNOWN[endpoint]:
            raise bad(name, f"Unrecognized request argument supplied: {name}")
    for name in _UNSUPPORTED[endpoint]:
        _check_neutral(endpoint, body, name)
    model = _string(body, "model", "")
    _string(body, "user", "")
    if endpoint == COMPLETIONS:
        prompt, token_ids = _prompt(body.get("prompt"))
        messages = None
        max_param = "max_tokens"
    else:
        prompt, token_ids = None, None
        messages = _messages(body.get("messages"))
        given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
        if len(given) == 2:
            raise bad("max_tokens", "give max_tokens or max_completion_tokens, not both")
        max_param = given[0] if given else "max_completion_tokens"
    max_tokens = _integer(body, max_param, default_max_tokens, lo=1)
    stream = _boolean(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad("stream_options", f"expected an object, got {options!r}")
        for key in options:
            if key not in ("include_usage", "continuous_usage_stats"):
                raise bad(f"stream_options.{key}", "Unrecognized stream option")
        include_usage = _boolean(options, "include_usage", False, "stream_options.")
        if _boolean(options, "continuous_usage_stats", False, "stream_options."):
            raise bad("stream_options.continuous_usage_stats", "not supported by halfmoon")
    top_k = _integer(body, "top_k", 0, lo=-1)
    ttft_slo_ms, tbt_slo_ms, tpot_slo_ms = _objectives(body.get("slo"))
    return GenerationSpec(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        token_ids=token_ids,
        messages=messages,
        max_tokens=max_tokens,
        max_tokens_param=max_param,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_top_p(body),
        top_k=max(0, top_k),  # vLLM's -1 and halfmoon's 0 both mean off
        seed=_integer(body, "seed", None, lo=-INT64_MAX - 1, hi=INT64_MAX),
        stop=_stop(body.get("stop")),
        ignore_eos=_boolean(body, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        ttft_slo_ms=ttft_slo_ms,
        tbt_slo_ms=tbt_slo_ms,
        tpot_slo_ms=tpot_slo_ms,
    )


# ---------------------------------------------------------------- fields


def _check_neutral(endpoint: str, body: dict, name: str) -> None:
    if name not in body or body[name] is None:
        return
    value = body[name]
    allowed = _NEUTRAL_LOGPROBS[endpoint] if name == "logprobs" else _NEUTRAL[name]
    # bool is an int in Python: False must not pass for 0, nor True for 1
    if any(type(value) is type(a) or _both_numbers(value, a) for a in allowed) and value in allowed:
        return
    if name == "n":
        raise bad("n", f"halfmoon answers one choice per request (n = 1), got {value!r}")
    shown = " or ".join(repr(a) for a in allowed) if allowed else "null"
    raise bad(name, f"not supported by halfmoon (only {shown} is accepted), got {value!r}")


def _both_numbers(a: Any, b: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))


def _string(body: dict, name: str, default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(name, f"expected a string, got {value!r}")
    return value


def _boolean(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(prefix + name, f"expected true or false, got {value!r}")
    return value


def _integer(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(name, f"expected an integer, got {value!r}")
    if lo is not None and value < lo:
        raise bad(name, f"must be at least {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(name, f"must be at most {hi}, got {value}")
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad(name, f"expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise bad(name, f"must be in [{lo:g}, {hi:g}], got {value}")
    return float(value)


_OBJECTIVES = ("ttft_ms", "tbt_ms", "tpot_ms")


def _objectives(slo: Any) -> tuple[float, float, float]:
    """The extension `slo: {"ttft_ms": .., "tbt_ms": .., "tpot_ms": ..}`: this request's TTFT,
    TBT and TPOT objectives (any may be left out: the cluster's default then holds); 400 naming
    a bad one."""
    if slo is None:
        return 0.0, 0.0, 0.0
    if not isinstance(slo, dict):
        raise bad("slo", f"expected an object with any of {', '.join(_OBJECTIVES)}, got {slo!r}")
    for key in slo:
        if key not in _OBJECTIVES:
            raise bad(f"slo.{key}", f"unknown objective (known: {', '.join(_OBJECTIVES)})")
    out = []
    for key in _OBJECTIVES:
        value = slo.get(key)
        if value is None:
            out.append(0.0)
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise bad(f"slo.{key}", f"must be a positive number of milliseconds, got {value!r}")
        out.append(float(value))
    return out[0], out[1], out[2]


def _top_p(body: dict) -> float:
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0)
    if top_p == 0.0:  # halfmoon's 0 means off; OpenAI's 0 would mean the top token alone
        raise bad("top_p", "must be in (0, 1], got 0")
    return top_p


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"expected a string or a list of strings, got {value!r}")
    if any(s == "" for s in stops):
        raise bad("stop", "a stop string must not be empty")
    return list(stops)


def _prompt(value: Any) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids); one prompt per request, as a string or token ids,
    bare or in a list of one."""
    if value is None:
        raise bad("prompt", "required")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "empty prompt")
        return value, None
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return None, list(value)
        if all(isinstance(t, (str, list)) for t in value):
            raise bad("prompt", f"halfmoon answers one prompt per request, got {len(value)}")
    raise bad("prompt", "expected a non-empty string or a non-empty list of token ids")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"expected an object, got {m!r}")
        for key in m:
            if key not in _MESSAGE_KEYS:
                raise bad(f"{where}.{key}", "not supported by halfmoon (no tools)")
        role = m.get("role")
        if role not in _ROLES:
            known = ", ".join(_ROLES)
            raise bad(f"{where}.role", f"{role!r} is not one of {known}")
        out.append({"role": _ROLES[role], "content": _content(m.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or text parts joined (other kinds of part are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{j}]", f"only text parts are supported, got {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{where}.content[{j}].text", f"expected a string, got {text!r}")
            texts.append(text)
        return "".join(texts)
    raise bad(f"{where}.content", f"expected a string or a list of text parts, got {content!r}")


# ---------------------------------------------------------------- answers


def usage_body(usage) -> dict:
    """OpenAI's usage from halfmoon's (pb.Usage): the KV cache hits are the cached tokens."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class Answer(NamedTuple):
    """What every body and chunk of one answer shares."""

    endpoint: str
    id: str
    created: int
    model: str

    def _head(self, chunk: bool) -> dict:
        if self.endpoint == COMPLETIONS:
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, finish_reason: str, usage) -> dict:
        """The whole answer (stream false)."""
        if self.endpoint == COMPLETIONS:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        return {**self._head(False), "choices": [choice], "usage": usage_body(usage)}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed chunk: new text, or (with finish_reason) the end of the choice."""
        if self.endpoint == COMPLETIONS:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        else:
            delta: dict = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage) -> dict:
        """stream_options.include_usage: the last chunk, no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage_body(usage)}
