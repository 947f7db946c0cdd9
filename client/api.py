"""The gRPC client for the conductor: Generate (streaming) and Status, sync and asyncio; TLS
and a bearer token when the cluster asks for them."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import grpc

from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50050"
GENERATE_TIMEOUT_S = 600.0  # a whole answer; every RPC carries a deadline
STATUS_TIMEOUT_S = 10.0
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


class Chunk(NamedTuple):
    """One streamed GenerateResponse, stamped with the client's clock."""

    request_id: str
    token_ids: list[int]  # new tokens carried by this message
    text: str  # detokenized text those tokens added
    token_times_ms: list[float]  # server side: ms since the conductor got the request, per token
    received_s: float  # time.monotonic() when the client received this message
    finished: bool
    finish_reason: str  # "" until finished; then stop | length | cancelled | error
    usage: pb.Usage | None  # set on the final message


class Completion(NamedTuple):
    """A whole answer, gathered from the stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: pb.Usage | None
    ttft_ms: float  # client side: request sent -> first token received
    token_times_ms: list[float]  # server side per-token times (ms since arrival at the conductor)


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[dict] | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    model: str = "",
    cache_salt: str = "",
    policy: str = "",
    ttft_slo_ms: float = 0.0,
    tbt_slo_ms: float = 0.0,
    tpot_slo_ms: float = 0.0,
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of: raw text, token ids, chat messages."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids, messages")
    req = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=list(stop),
            ignore_eos=ignore_eos,
        ),
        model=model,
        cache_salt=cache_salt,
        policy=policy,
        ttft_slo_ms=ttft_slo_ms,
        tbt_slo_ms=tbt_slo_ms,
        tpot_slo_ms=tpot_slo_ms,
    )
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(int(t) for t in token_ids)
    else:
        for m in messages:
            req.chat.messages.add(role=m["role"], content=m["content"])
    return req


def _chunk(msg: pb.GenerateResponse) -> Chunk:
    return Chunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        token_times_ms=list(msg.token_times_ms),
        received_s=time.monotonic(),
        finished=msg.finished,
        finish_reason=msg.finish_reason,
        usage=msg.usage if msg.HasField("usage") else None,
    )


class _Gather:
    """Folds chunks into a Completion."""

    def __init__(self, sent_s: float):
        self.sent_s = sent_s
        self.first_s: float | None = None
        self.request_id, self.reason, self.usage = "", "", None
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.times: list[float] = []

    def add(self, c: Chunk) -> None:
        self.request_id = c.request_id or self.request_id
        if c.token_ids and self.first_s is None:
            self.first_s = c.received_s
        self.texts.append(c.text)
        self.ids.extend(c.token_ids)
        self.times.extend(c.token_times_ms)
        if c.finished:
            self.reason, self.usage = c.finish_reason, c.usage

    def result(self) -> Completion:
        ttft = (self.first_s - self.sent_s) * 1000.0 if self.first_s is not None else float("nan")
        return Completion(
            self.request_id,
            "".join(self.texts),
            self.ids,
            self.reason,
            self.usage,
            ttft,
            self.times,
        )


class Access(NamedTuple):
    """How a client reaches a secured conductor: a bearer token and TLS files ("" = none)."""

    token: str = ""  # API token (its tenant's cache is the only one the requests reach)
    tls_ca: str = ""  # PEM CA that signed the conductor's certificate; set = TLS
    tls_cert: str = ""  # PEM client certificate and key, for a conductor that asks for one
    tls_key: str = ""
    tls_server_name: str = ""  # the name checked in the conductor's certificate ("" = the host)

    @classmethod
    def from_env(cls, token: str | None = None, tls_ca: str | None = None) -> Access:
        """Given values, else $HALFMOON_TOKEN and $HALFMOON_TLS_CA."""
        return cls(
            token=os.environ.get("HALFMOON_TOKEN", "") if token is None else token,
            tls_ca=os.environ.get("HALFMOON_TLS_CA", "") if tls_ca is None else tls_ca,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> list[tuple]:
        name = [("grpc.ssl_target_name_override", self.tls_server_name)]
        return _CHANNEL_OPTIONS + (name if self.tls_server_name else [])

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (None: plaintext); a file that cannot be read is a ValueError."""
        if not self.tls_ca:
            return None
        files = {}
        for what in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, what)
            try:
                files[what] = Path(path).read_bytes() if path else None
            except OSError as exc:
                raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror}") from None
        return grpc.ssl_channel_credentials(files["tls_ca"], files["tls_key"], files["tls_cert"])


class Client:
    """Blocking client: `with Client(addr) as c: for chunk in c.generate_stream("hi"): ...`.
    `access` (default: $HALFMOON_TOKEN, $HALFMOON_TLS_CA) carries a token and TLS files."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout_s: float = GENERATE_TIMEOUT_S,
        access: Access | None = None,
    ):
        self.address = address
        self.timeout_s = timeout_s
        access = access or Access.from_env()
        creds = access.credentials()
        self._channel = (
            grpc.secure_channel(address, creds, options=access.options())
            if creds is not None
            else grpc.insecure_channel(address, options=access.options())
        )
        self._metadata = access.metadata()
        self._stub = pb_grpc.ConductorStub(self._channel)

    def generate_stream(self, prompt: str | None = None, **kwargs) -> Iterator[Chunk]:
        """Stream the answer; closing the iterator early cancels the request downstream."""
        request = kwargs.pop("request", None) or build_request(prompt, **kwargs)
        call = self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        gather = _Gather(time.monotonic())
        for c in self.generate_stream(prompt, **kwargs):
            gather.add(c)
        return gather.result()

    def status(self) -> pb.StatusReply:
        return self._stub.Status(
            pb.StatusRequest(), timeout=STATUS_TIMEOUT_S, metadata=self._metadata
        )

    def clear_cache(self) -> pb.ClearCacheReply:
        """Empty every KV cache of the cluster (store tiers, index, prefill pools); on a secured
        cluster this takes the cluster token."""
        return self._stub.ClearCache(
            pb.ClearCacheRequest(), timeout=STATUS_TIMEOUT_S, metadata=self._metadata
        )

    def recent_trace(self, limit: int = 0) -> pb.RecentTraceReply:
        """The conductor's recent requests as a trace (the newest `limit`; 0: all it keeps); on
        a secured cluster this takes the cluster token."""
        return self._stub.RecentTrace(
            pb.RecentTraceRequest(limit=limit), timeout=STATUS_TIMEOUT_S, metadata=self._metadata
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client: `async with AsyncClient(addr) as c: async for chunk in
    c.generate_stream(...)`. `access` as for Client."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout_s: float = GENERATE_TIMEOUT_S,
        access: Access | None = None,
    ):
        self.address = address
        self.timeout_s = timeout_s
        access = access or Access.from_env()
        creds = access.credentials()
        self._channel = (
            grpc.aio.secure_channel(address, creds, options=access.options())
            if creds is not None
            else grpc.aio.insecure_channel(address, options=access.options())
        )
        self._metadata = access.metadata()
        self._stub = pb_grpc.ConductorStub(self._channel)

    async def generate_stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """`token=` sends that bearer token for this call instead of the client's own (a front
        end passing on its caller's API token)."""
        token = kwargs.pop("token", None)
        metadata = (("authorization", f"Bearer {token}"),) if token else self._metadata
        request = kwargs.pop("request", None) or build_request(prompt, **kwargs)
        call = self._stub.Generate(request, timeout=self.timeout_s, metadata=metadata)
        try:
            async for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        gather = _Gather(time.monotonic())
        async for c in self.generate_stream(prompt, **kwargs):
            gather.add(c)
        return gather.result()

    async def status(self, token: str | None = None) -> pb.StatusReply:
        """`token=` as for generate_stream."""
        metadata = (("authorization", f"Bearer {token}"),) if token else self._metadata
        return await self._stub.Status(
            pb.StatusRequest(), timeout=STATUS_TIMEOUT_S, metadata=metadata
        )

    async def clear_cache(self) -> pb.ClearCacheReply:
        return await self._stub.ClearCache(
            pb.ClearCacheRequest(), timeout=STATUS_TIMEOUT_S, metadata=self._metadata
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
