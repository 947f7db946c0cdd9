"""The OpenAI-compatible app: routes, bearer authentication, and the relay from the conductor's
Generate stream (over gRPC, through client.AsyncClient) to OpenAI's bodies and server-sent events.
A client that goes away cancels its Generate call, and so the work downstream."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress

import anyio
import grpc
from fastapi import FastAPI, Request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from client import Access, AsyncClient, Chunk, build_request
from openai_api.config import HttpConfig
from openai_api.metrics import HttpMetrics
from openai_api.protocol import (
    CHAT,
    COMPLETIONS,
    FINISH_REASONS,
    Answer,
    ApiError,
    GenerationSpec,
    parse_request,
)
from servekit import RETRY_AFTER_KEY

log = logging.getLogger(__name__)

# The conductor's verdicts as HTTP statuses (anything else is a 500).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_CLIENT_GONE = 499  # nginx's "client closed request": counted, never seen by anyone
_DONE = b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer began."""


class _EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects, also while no token is on
    its way (Starlette's own StreamingResponse notices only at its next write under ASGI 2.4):
    the events' generator is closed then, which cancels the Generate call."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        finished = False
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                nonlocal finished
                with suppress(OSError):  # a write after the client left
                    await self.stream_response(send)
                    finished = True
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        if not finished:
            self._on_disconnect()
        await self.body_iterator.aclose()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or _ClientGone (with `work` cancelled) when the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task
    if task.cancelled():
        raise _ClientGone()
    return task.result()


async def _first(chunks: AsyncIterator[Chunk]) -> Chunk | None:
    return await anext(chunks, None)


async def _gather(chunks: AsyncIterator[Chunk]) -> tuple[str, Chunk | None]:
    """The whole answer's text and its final chunk (None when the stream ended without one)."""
    texts, last = [], None
    async with aclosing(chunks):
        async for c in chunks:
            texts.append(c.text)
            if c.finished:
                last = c
    return "".join(texts), last


class _Api:
    """The routes and what they share: the config, the conductor client, the metrics."""

    def __init__(self, config: HttpConfig, metrics: HttpMetrics):
        self.config = config
        self.metrics = metrics
        self.client: AsyncClient | None = None
        self.health_channel: grpc.aio.Channel | None = None
        self.model = config.model_name  # the served name; asked of the conductor when not set
        self.created = int(time.time())

    # ---- lifecycle (inside the server's event loop: grpc.aio channels belong to one) ----

    async def open(self) -> None:
        access = self._access()
        self.client = AsyncClient(
            self.config.conductor, timeout_s=self.config.request_timeout_s, access=access
        )
        creds = access.credentials()
        self.health_channel = (
            grpc.aio.secure_channel(self.config.conductor, creds, options=access.options())
            if creds is not None
            else grpc.aio.insecure_channel(self.config.conductor, options=access.options())
        )

    def _access(self) -> Access:
        """How this server reaches the conductor: over TLS when the cluster has it (with the node
        certificate under mutual TLS); no token of its own (each call carries its caller's)."""
        sec = self.config.security
        mutual = sec.mutual_tls and sec.tls_cert
        return Access(
            tls_ca=sec.tls_ca,
            tls_cert=sec.tls_cert if mutual else "",
            tls_key=sec.tls_key if mutual else "",
            tls_server_name=sec.tls_server_name,
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.health_channel is not None:
            await self.health_channel.close()

    # ---- routes ----

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def models(self, request: Request) -> Response:
        _, token = self._caller(request)
        served = await self._served(token)
        return JSONResponse({"object": "list", "data": [self._model_card(served)]})

    async def one_model(self, request: Request, model: str) -> Response:
        _, token = self._caller(request)
        served = await self._served(token)
        if model != served:
            raise self._unknown_model(model, served)
        return JSONResponse(self._model_card(served))

    async def health(self, request: Request) -> Response:
        """200 while the conductor answers its health check SERVING; 503 otherwise."""
        stub = health_pb2_grpc.HealthStub(self.health_channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(), timeout=self.config.health_timeout_s
            )
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            status = f"{exc.code().name}: {exc.details()}"
        if status == "SERVING":
            return JSONResponse({"status": "ok", "conductor": self.config.conductor})
        err = ApiError(503, f"conductor at {self.config.conductor}: {status}", kind="server_error")
        return JSONResponse(err.body(), status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- generation ----

    async def _generate(self, request: Request, endpoint: str) -> Response:
        arrived = time.perf_counter()
        salt, token = self._caller(request)
        default_max = (
            self.config.completion_max_tokens
            if endpoint == COMPLETIONS
            else self.config.chat_max_tokens
        )
        spec = parse_request(endpoint, await self._json(request), default_max)
        served = await self._served(token)
        if spec.model and spec.model != served:
            raise self._unknown_model(spec.model, served)
        rid = uuid.uuid4().hex
        prefix = "cmpl-" if endpoint == COMPLETIONS else "chatcmpl-"
        answer = Answer(endpoint, prefix + rid, int(time.time()), served)
        chunks = self.client.generate_stream(request=_grpc_request(spec, rid, salt), token=token)
        try:
            if not spec.stream:
                text, last = await _until_disconnected(request, _gather(chunks))
                reason = self._finish_reason(last)
                return JSONResponse(answer.body(text, reason, last.usage))
            first = await _until_disconnected(request, _first(chunks))
        except _ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=_CLIENT_GONE)
        except grpc.RpcError as exc:
            raise self._from_grpc(exc, spec) from None
        if first is None:
            raise self._ended_early()
        route = request.url.path
        events = self._events(answer, spec, first, chunks, arrived, route)
        return _EventStream(events, self.metrics.disconnects.inc)

    async def _events(
        self,
        answer: Answer,
        spec: GenerationSpec,
        first: Chunk,
        chunks: AsyncIterator[Chunk],
        arrived: float,
        route: str,
    ) -> AsyncIterator[bytes]:
        """The answer as OpenAI's chunks: text as it comes, then the finish reason, the usage
        (stream_options.include_usage) and [DONE]. An error after the first byte is a chunk in
        OpenAI's error shape, as OpenAI sends it."""
        self.metrics.open_streams.inc()
        started = False  # a chunk went out (the first one opens the assistant's message)
        try:
            c = first
            while c is not None:
                if c.text:
                    yield _sse(answer.chunk(c.text, first=not started))
                if c.finished:
                    reason = self._finish_reason(c)
                    yield _sse(answer.chunk("", reason, first=not started and not c.text))
                if not started and (c.text or c.finished):
                    started = True  # time to the first chunk, text or (textless answer) the end
                    self.metrics.ttft.labels(route).observe(time.perf_counter() - arrived)
                if c.finished:
                    if spec.include_usage and c.usage is not None:
                        yield _sse(answer.usage_chunk(c.usage))
                    yield _DONE
                    return
                c = await anext(chunks, None)
            raise self._ended_early()
        except grpc.RpcError as exc:
            yield _sse(self._from_grpc(exc, spec).body())
            yield _DONE
        except ApiError as err:
            yield _sse(err.body())
            yield _DONE
        finally:
            await chunks.aclose()  # cancels the Generate call when it is still going
            self.metrics.open_streams.dec()

    def _finish_reason(self, last: Chunk | None) -> str:
        if last is None:
            raise self._ended_early()
        reason = FINISH_REASONS.get(last.finish_reason)
        if reason is None:
            message = f"the conductor ended the answer with {last.finish_reason!r}"
            raise ApiError(502, message, kind="server_error")
        return reason

    @staticmethod
    def _ended_early() -> ApiError:
        return ApiError(502, "the conductor's stream ended before the answer", kind="server_error")

    # ---- request parts ----

    def _caller(self, request: Request) -> tuple[str, str]:
        """(cache salt, token to pass on). With the cluster's API tokens (security.api_tokens)
        the caller's token goes on to the conductor, which authenticates it and derives the
        tenant's salt; else the tenant of http.api_keys is the salt and no token goes on."""
        if self.config.security.api_tokens:
            return "", self._bearer(request, self.config.security.api_tokens)
        return self._tenant(request), ""

    def _tenant(self, request: Request) -> str:
        """The request's tenant (its cache salt): "" without api_keys; else the tenant of the
        bearer key it carries, or a 401."""
        keys = self.config.api_keys
        if not keys:
            return ""
        token = self._bearer(request, keys)
        return keys[token]

    @staticmethod
    def _bearer(request: Request, keys: dict[str, str]) -> str:
        """The bearer key the request carries, when it is one of `keys`; else a 401."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "You didn't provide an API key: pass it as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        found = None
        given = token.encode()
        for key in keys:  # every key compared, in constant time
            if hmac.compare_digest(key.encode(), given):
                found = key
        if found is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
        return found

    @staticmethod
    async def _json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    async def _served(self, token: str = "") -> str:
        """The served model's name, asked of the conductor once (with the caller's token)."""
        if not self.model:
            try:
                self.model = (await self.client.status(token=token)).model
            except grpc.RpcError as exc:
                raise self._from_grpc(exc, None) from None
        return self.model

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "halfmoon"}

    @staticmethod
    def _unknown_model(model: str, served: str) -> ApiError:
        return ApiError(
            404,
            f"The model `{model}` does not exist (this server serves `{served}`)",
            "model",
            "model_not_found",
        )

    def _from_grpc(self, exc: grpc.RpcError, spec: GenerationSpec | None) -> ApiError:
        """The conductor's status as OpenAI's error; INVALID_ARGUMENT's field (the message's
        first word) named as the OpenAI request spells it."""
        code = exc.code()
        details = exc.details() or code.name
        self.metrics.conductor_errors.labels(code.name).inc()
        status = _HTTP_STATUS.get(code, 500)
        if status == 400:
            field, sep, rest = details.partition(":")
            param = _openai_param(field, spec) if sep and " " not in field else None
            message = f"{param}:{rest}" if param else details
            overflow = "context_length_exceeded" if "context window" in details else None
            return ApiError(400, message, param, overflow)
        kind = "rate_limit_error" if status == 429 else "server_error"
        if status < 500 and status != 429:
            kind = "invalid_request_error"
        retry_after = _retry_after(exc) if status == 429 else None
        headers = {"Retry-After": retry_after} if retry_after else None
        return ApiError(status, details, kind=kind, headers=headers)


def _retry_after(exc: grpc.RpcError) -> str | None:
    """The conductor's hint of when to try again (whole seconds), from the refusal's trailers."""
    trailers = getattr(exc, "trailing_metadata", None)
    for key, value in (trailers() if callable(trailers) else None) or ():
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return str(value)
    return None


def _openai_param(field: str, spec: GenerationSpec | None) -> str:
    """A GenerateRequest field as the OpenAI request's: prompt.chat.messages[0].role ->
    messages[0].role, sampling.max_tokens -> max_tokens (or max_completion_tokens)."""
    chat = spec is not None and spec.endpoint == CHAT
    if field.startswith("prompt.chat."):
        return field.removeprefix("prompt.chat.")
    if field.startswith("prompt"):
        return "messages" if chat else "prompt"
    if field.startswith("sampling."):
        name = field.removeprefix("sampling.")
        return spec.max_tokens_param if name == "max_tokens" and spec is not None else name
    return field


def _grpc_request(spec: GenerationSpec, request_id: str, salt: str):
    seed = spec.seed
    if seed is None:
        # OpenAI: without a seed, sampled answers vary; halfmoon seeds every request (0 too)
        seed = uuid.uuid4().int >> 65
    return build_request(
        spec.prompt,
        token_ids=spec.token_ids,
        messages=spec.messages,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=seed,
        stop=spec.stop,
        ignore_eos=spec.ignore_eos,
        request_id=request_id,
        cache_salt=salt,
        ttft_slo_ms=spec.ttft_slo_ms,
        tbt_slo_ms=spec.tbt_slo_ms,
        tpot_slo_ms=spec.tpot_slo_ms,
    )


class _CountAnswers:
    """ASGI middleware: every answer counted by route and status as its head goes out."""

    def __init__(self, app, metrics: HttpMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self.metrics.route(scope["path"])

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(config: HttpConfig, metrics: HttpMetrics | None = None):
    """The ASGI app for `config` (a FastAPI app inside the counting middleware)."""
    metrics = metrics or HttpMetrics()
    api = _Api(config, metrics)

    @asynccontextmanager
    async def lifespan(app):
        await api.open()
        try:
            yield
        finally:
            await api.close()

    app = FastAPI(
        title="halfmoon", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.one_model, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])

    async def api_error(request: Request, err: ApiError) -> Response:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        err = ApiError(exc.status_code, str(exc.detail), kind="invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    return _CountAnswers(app, metrics)
