"""The OpenAI-compatible HTTP API end to end, through the real `openai` client, in front of a local
cluster on tiny-random: answers equal to Engine's greedy ones (streamed and whole, completions and
chat), cached tokens on a repeated prefix, a disconnect that frees the decode worker's blocks,
400s naming the bad field, bearer keys mapped to tenants, and 16 concurrent streams."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from deploy import LocalCluster, cluster_config_from_dict
from model import Engine, SamplingParams, load_model
from openai_api import HttpConfig, HttpServer

BS = 16
MODEL = "tiny-random"


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def engine(lm):
    return Engine(lm, block_size=BS)


@pytest.fixture(scope="module")
def cluster(lm):
    cfg = cluster_config_from_dict(
        {
            "model": MODEL,
            "dtype": "float32",
            "store": {"dram_bytes": 64 << 20, "heartbeat_s": 0.5},
            "prefill": {"num_blocks": 256},
            "decode": {"num_blocks": 256},
            "conductor": {"load_poll_s": 0.05},
        }
    )
    with LocalCluster(cfg, lm=lm, http=True) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster):
    """The openai client on the cluster's HTTP server (no auth configured: any key passes)."""
    with openai.OpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def greedy(engine, ids, max_tokens, ignore_eos=True) -> list[int]:
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def rand_ids(rng, n, vocab=259) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def wait_idle(decode, timeout_s: float = 10.0) -> float:
    """Seconds until the decode worker runs nothing and every pool block is free again."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        ld = decode.load()
        if ld.running == 0 and ld.waiting == 0 and ld.free_blocks == ld.total_blocks:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise TimeoutError(f"decode worker still holds blocks after {timeout_s} s: {decode.load()}")


def get(url: str, headers: dict | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


# ---------------------------------------------------------------- answers


def test_completions_equal_engine_streamed_and_whole(api, engine, lm):
    prompts = ["Hello", "The capital of France is", "a b c d e f g", "x" * 40]
    for p in prompts:
        want_ids = greedy(engine, lm.tokenizer.encode(p), 12)
        want = lm.tokenizer.decode(want_ids)
        kw = dict(
            model=MODEL, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        whole = api.completions.create(**kw)
        assert whole.object == "text_completion" and whole.model == MODEL
        assert whole.choices[0].text == want, p
        assert whole.choices[0].finish_reason == "length"
        u = whole.usage
        assert u.prompt_tokens == len(lm.tokenizer.encode(p)) and u.completion_tokens == 12
        assert u.total_tokens == u.prompt_tokens + 12
        chunks = list(api.completions.create(**kw, stream=True))
        assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
        assert "".join(c.choices[0].text for c in chunks) == want
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # token ids as the prompt, bare or in a batch of one
    ids = lm.tokenizer.encode("1 2 3 4 5 6 7 8 9 10")
    want = lm.tokenizer.decode(greedy(engine, ids, 8))
    for prompt in (ids, [ids]):
        got = api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want


def test_chat_equals_engine_streamed_and_whole(api, engine, lm):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi there"},
    ]
    want = lm.tokenizer.decode(greedy(engine, lm.tokenizer.apply_chat_template(msgs), 10))
    kw = dict(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = api.chat.completions.create(**kw)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    stream = api.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # max_completion_tokens, text parts and the developer role (a system message) as OpenAI has
    parts = [
        {"role": "developer", "content": "You are terse."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    got = api.chat.completions.create(
        model=MODEL,
        messages=parts,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.content == want


def test_eos_stop_strings_and_seeded_sampling(api, engine, lm):
    p = "Once upon a time, in a land far away, there lived"
    ids = lm.tokenizer.encode(p)
    want = greedy(engine, ids, 40, ignore_eos=False)
    got = api.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
    assert got.choices[0].text == lm.tokenizer.decode(want)
    assert got.choices[0].finish_reason == ("length" if len(want) == 40 else "stop")
    # a stop string ends the text before it, with finish_reason stop, streamed or whole
    full = lm.tokenizer.decode(greedy(engine, ids, 30))
    stop = full[10:13]
    kw = dict(model=MODEL, prompt=p, max_tokens=30, temperature=0, stop=[stop])
    kw["extra_body"] = {"ignore_eos": True}
    whole = api.completions.create(**kw)
    assert whole.choices[0].text == full[: full.find(stop)]
    assert whole.choices[0].finish_reason == "stop"
    streamed = list(api.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    # the same seed, the same sampled answer; another seed or none (OpenAI: a fresh draw each
    # time), another answer (12 tokens at temperature 0.9 of a 259-token vocabulary)
    kw = dict(model=MODEL, prompt=p, max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    kw["extra_body"] = {"ignore_eos": True}
    a, b = api.completions.create(**kw), api.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert api.completions.create(**{**kw, "seed": 4321}).choices[0].text != a.choices[0].text
    del kw["seed"]
    unseeded = {api.completions.create(**kw).choices[0].text for _ in range(2)}
    assert len(unseeded) == 2


def test_cached_tokens_on_a_repeated_prefix(api, lm):
    rng = random.Random(7)
    prefix = rand_ids(rng, 4 * BS)
    first = api.completions.create(model=MODEL, prompt=prefix + rand_ids(rng, 5), max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = api.completions.create(model=MODEL, prompt=prefix + rand_ids(rng, 9), max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens == 4 * BS
    # streamed: the usage chunk carries it too
    chunks = list(
        api.completions.create(
            model=MODEL,
            prompt=prefix + rand_ids(rng, 3),
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4 * BS


# ---------------------------------------------------------------- cancellation


def _samples(registry, name: str, labels: dict | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


def _wait_until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not so after {timeout_s} s"
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_the_decode_workers_blocks(api, cluster):
    decode = cluster.objects["decode"][0]
    http = cluster.objects["http"][0]
    wait_idle(decode)
    # the decode worker's own count of sequences cut short (not finished) by a cancelled stream
    cancelled_labels = {"worker": "decode-0", "reason": "cancelled"}
    cancelled = _samples(decode.registry, "halfmoon_decode_requests_total", cancelled_labels)
    gone = _samples(http.metrics.registry, "halfmoon_http_disconnects_total")
    # far more tokens than the test waits for: only the disconnect can end it in time
    stream = api.completions.create(
        model=MODEL,
        prompt=list(range(3, 40)),
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for _chunk in stream:
        got += 1
        if got >= 5:
            break
    held = decode.load()
    assert held.running == 1 and held.free_blocks < held.total_blocks
    stream.close()  # the connection goes away mid-stream
    wait_idle(decode, timeout_s=5.0)
    _wait_until(
        lambda: (
            _samples(decode.registry, "halfmoon_decode_requests_total", cancelled_labels)
            == cancelled + 1
        )
    )
    _wait_until(
        lambda: _samples(http.metrics.registry, "halfmoon_http_disconnects_total") == gone + 1
    )
    # a whole-answer request whose client leaves while it decodes is cancelled as well
    body = json.dumps(
        {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 1500, "ignore_eos": True}
    ).encode()
    host, port = cluster.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _wait_until(lambda: decode.load().running == 1)
    _wait_until(
        lambda: (
            _samples(decode.registry, "halfmoon_decode_requests_total", cancelled_labels)
            == cancelled + 2
        )
    )
    wait_idle(decode, timeout_s=5.0)
    _wait_until(
        lambda: _samples(http.metrics.registry, "halfmoon_http_disconnects_total") == gone + 2
    )
    # and the server goes on serving
    assert api.completions.create(model=MODEL, prompt="still here", max_tokens=2).usage


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "endpoint, fields, param",
    [
        ("completions", {"n": 2}, "n"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"logprobs": 2}, "logprobs"),
        ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("completions", {"frequency_penalty": -1}, "frequency_penalty"),
        ("completions", {"temperature": 2.5}, "temperature"),
        ("completions", {"top_p": 0}, "top_p"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"max_tokens": 100_000}, "max_tokens"),  # the conductor's limit
        ("completions", {"stop": ""}, "stop"),
        ("completions", {"seed": "x"}, "seed"),
        ("completions", {"prompt": ["a", "b"]}, "prompt"),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": [5, 100_000]}, "prompt"),  # out of the vocabulary
        ("completions", {"prompt": [7] * 2048}, "prompt"),  # past the context window
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("completions", {"frobnicate": 1}, "frobnicate"),
        ("completions", {"slo": {"ttft_ms": -5}}, "slo.ttft_ms"),
        ("completions", {"slo": {"ttft_ms": True}}, "slo.ttft_ms"),
        ("completions", {"slo": 2000}, "slo"),
        ("chat", {"slo": {"tpot_ms": -50}}, "slo.tpot_ms"),
        ("chat", {"slo": {"tpot_ms": "fast"}}, "slo.tpot_ms"),
        ("chat", {"slo": {"itl_ms": 50}}, "slo.itl_ms"),
        ("chat", {"n": 3}, "n"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"max_tokens": 4, "max_completion_tokens": 4}, "max_tokens"),
        ("chat", {"max_completion_tokens": 100_000}, "max_completion_tokens"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_parameters_give_400_naming_the_field(api, endpoint, fields, param, stream):
    body = {"model": MODEL}
    if not {"max_tokens", "max_completion_tokens"} & set(fields):
        body["max_tokens"] = 4
    body.update(
        {"prompt": "hi"}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body.update(fields)
    if stream and "stream_options" not in fields:
        body["stream"] = True
    with pytest.raises(openai.BadRequestError) as err:
        api.post(
            f"/{'completions' if endpoint == 'completions' else 'chat/completions'}",
            body=body,
            cast_to=object,
        )
    e = err.value
    assert e.status_code == 400
    assert e.body["param"] == param and e.body["type"] == "invalid_request_error"
    assert param.split("[")[0] in e.body["message"]


def test_other_errors_in_openais_shape(api, cluster):
    with pytest.raises(openai.NotFoundError) as err:
        api.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=[7] * 2048, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded"
    status, body = get(f"http://{cluster.http_address}/v1/nowhere")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    # values that ask for nothing pass (benchmark tools spell their defaults out)
    ok = api.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=2,
        n=1,
        presence_penalty=0,
        best_of=1,
        echo=False,
        extra_body={"repetition_penalty": 1.0, "top_k": -1, "logprobs": None},
    )
    assert ok.usage.completion_tokens >= 1
    # the request's own objectives (halfmoon's `slo` extension) reach the conductor's admission:
    # generous ones are served, one no prefill can meet is refused at once with a 429
    kw = dict(model=MODEL, prompt=list(range(3, 200)), max_tokens=2)
    for _ in range(5):  # and the workers' models checked by served requests (else it is a probe)
        # (EOS ignored: a cached prefix's logits may pick it first, which is not what this checks)
        slo = {"ttft_ms": 60_000, "tbt_ms": 60_000, "tpot_ms": 60_000}
        ok = api.completions.create(**kw, extra_body={"slo": slo, "ignore_eos": True})
        assert ok.usage.completion_tokens == 2
    with pytest.raises(openai.RateLimitError) as err:
        api.completions.create(**kw, extra_body={"slo": {"tpot_ms": 1e-6}})
    assert "time per output token" in err.value.body["message"]
    with pytest.raises(openai.RateLimitError) as err:
        api.completions.create(**kw, extra_body={"slo": {"ttft_ms": 1e-6}})
    assert "TTFT" in err.value.body["message"]
    # with when to come back: the predicted excess, in whole seconds, at least one
    assert int(err.value.response.headers["retry-after"]) >= 1
    # a conductor that does not answer: 503 (and /health says so)
    dead = HttpServer(HttpConfig(conductor="127.0.0.1:1", model_name=MODEL, health_timeout_s=0.5))
    address = dead.start()
    try:
        status, body = get(f"http://{address}/health")
        assert status == 503 and body["error"]["type"] == "server_error"
        with openai.OpenAI(base_url=f"http://{address}/v1", api_key="k", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as err:
                c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert err.value.status_code == 503
    finally:
        dead.stop()


# ---------------------------------------------------------------- endpoints, auth, tenants


def test_models_health_and_metrics(api, cluster):
    assert [m.id for m in api.models.list()] == [MODEL]
    assert api.models.retrieve(MODEL).owned_by == "halfmoon"
    status, body = get(f"http://{cluster.http_address}/health")
    assert status == 200 and body["conductor"] == cluster.address
    api.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    # TTFT is a streamed answer's (its first chunk out): one here, so this test does not lean
    # on an earlier test having streamed
    for _ in api.completions.create(model=MODEL, prompt="time me", max_tokens=2, stream=True):
        pass
    status, text = get(f"http://{cluster.http_address}/metrics")
    assert status == 200
    assert 'halfmoon_http_requests_total{route="/v1/completions",status="200"}' in text
    assert 'halfmoon_http_ttft_seconds_count{route="/v1/completions"}' in text


def test_api_keys_authenticate_and_map_to_tenants(cluster, lm):
    http = cluster.objects["http"][0]
    keys = {"key-a": "tenant-a", "key-a2": "tenant-a", "key-b": "tenant-b"}
    server = HttpServer(dataclasses.replace(http.config, port=0, api_keys=keys))
    base = f"http://{server.start()}/v1"
    try:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)

        with pytest.raises(openai.AuthenticationError) as err:
            client("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.body["code"] == "invalid_api_key"
        status, body = get(f"{base}/models")  # no Authorization header at all
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert get(f"{base}/models", {"Authorization": "Bearer key-b"})[0] == 200
        assert get(base.removesuffix("/v1") + "/health")[0] == 200  # open, as probes need

        rng = random.Random(11)
        prefix = rand_ids(rng, 3 * BS)

        def cached(key: str, open_api: bool = False) -> int:
            c = (
                openai.OpenAI(
                    base_url=f"http://{cluster.http_address}/v1", api_key="-", max_retries=0
                )
                if open_api
                else client(key)
            )
            r = c.completions.create(model=MODEL, prompt=prefix + rand_ids(rng, 4), max_tokens=2)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("key-a") == 0
        assert cached("key-a2") == 3 * BS  # the same tenant shares its blocks
        assert cached("key-b") == 0  # another tenant never does
        assert cached("", open_api=True) == 0  # nor the server without keys (salt "")
        assert cached("", open_api=True) == 3 * BS
    finally:
        server.stop()


# ---------------------------------------------------------------- concurrency


def test_sixteen_concurrent_streams(cluster, engine):
    rng = random.Random(3)
    prompts = [rand_ids(rng, rng.randrange(5, 60)) for _ in range(16)]
    wants = [greedy(engine, p, 16) for p in prompts]

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"http://{cluster.http_address}/v1", api_key="-", max_retries=0, timeout=120
        ) as client:

            async def one(p):
                stream = await client.completions.create(
                    model=MODEL,
                    prompt=p,
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                text, tokens = [], 0
                async for chunk in stream:
                    if chunk.choices:
                        text.append(chunk.choices[0].text)
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                return "".join(text), tokens

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run())
    tok = cluster.objects["conductor"][0].tokenizer
    for (text, tokens), want in zip(results, wants):
        assert text == tok.decode(want) and tokens == 16
    http = cluster.objects["http"][0]
    _wait_until(lambda: _samples(http.metrics.registry, "halfmoon_http_open_streams") == 0)


# ---------------------------------------------------------------- configuration


def test_cluster_config_http_section_and_serve_flags():
    from client.cli import build_parser
    from deploy import load_cluster_config

    cfg = load_cluster_config(None, ["http.api_keys.sk-one=team-a", "http_port=0"])
    assert cfg.http_port == 0 and cfg.http.api_keys == {"sk-one": "team-a"}
    assert load_cluster_config(None).http_port == 8000  # local.yaml: `halfmoon serve` has one
    for bad, what in (
        ({"http_port": 70_000}, "http_port"),
        ({"http": {"port": 8001}}, "http_port"),
        ({"http": {"api_keys": {"": "t"}}}, "api_keys"),
        ({"http": {"api_keys": ["k"]}}, "api_keys"),
        ({"http": {"chat_max_tokens": 0}}, "chat_max_tokens"),
        ({"http": {"bogus": 1}}, "bogus"),
    ):
        with pytest.raises(ValueError, match=what):
            cluster_config_from_dict(bad)
    args = build_parser().parse_args(["serve", "--http-port", "0", "--metrics"])
    assert args.http_port == 0 and args.metrics == ""
    args = build_parser().parse_args(["serve", "--metrics", "/tmp/t.json"])
    assert args.http_port is None and args.metrics == "/tmp/t.json"
