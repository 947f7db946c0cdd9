"""Bounded data calls: the calls that hold a server thread while they wait (a Generate or Decode
stream, a queued Prefill) take a slot, and a call that finds none is refused at once with
RESOURCE_EXHAUSTED.

Why a bound and not a bigger pool: grpc's sync server gives each call a thread for its whole life
and queues the rest behind them, health checks and `Load` included, so a burst of long calls made
a healthy worker look dead (the conductor's 2 s Load deadline) while the burst waited for
timeouts. Serving stacks answer overload with an immediate "busy" (vLLM's and Dynamo's 503 / 429,
Triton's max queue size): the caller can go elsewhere or back off. With data calls bounded below
the pool size, a few threads always stay free for control calls (health, Load, Status) and for
the refusals themselves."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable

import grpc

# Threads kept beside the data calls' for health checks, load reports, status and refusals.
CONTROL_THREADS = 8
# The trailing-metadata key of a refusal's hint: whole seconds to wait before trying again (the
# HTTP API answers it as Retry-After)
RETRY_AFTER_KEY = "retry-after"


class CallLimit(grpc.ServerInterceptor):
    """At most `limit` calls of `methods` ("/pkg.Service/Method") in flight; the next one gets
    RESOURCE_EXHAUSTED naming `server` and the limit, and `on_refuse` is called (a metric).
    `in_flight` and `refused` are for reports and tests."""

    def __init__(
        self,
        methods: Iterable[str],
        limit: int,
        server: str,
        on_refuse: Callable[[], object] | None = None,
    ):
        if limit < 1:
            raise ValueError(f"{server}: the data-call limit must be >= 1, got {limit}")
        self._methods = frozenset(methods)
        self.limit, self._server, self._on_refuse = limit, server, on_refuse
        self._lock = threading.Lock()
        self.in_flight = 0
        self.refused = 0

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext):
        """Holds one slot for the body of the call, or refuses the call (aborts) when none is
        free; the slot goes back however the body ends."""
        with self._lock:
            taken = self.in_flight < self.limit
            if taken:
                self.in_flight += 1
            else:
                self.refused += 1
        if not taken:
            if self._on_refuse is not None:
                self._on_refuse()
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._server} busy: {self.limit} calls in flight (its limit); retry later or "
                "elsewhere",
            )
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        if handler.request_streaming and handler.response_streaming:
            raise TypeError(f"{handler_call_details.method}: bidirectional streams are not limited")
        if handler.request_streaming:  # a client stream (a store's Put) holds its thread too
            return grpc.stream_unary_rpc_method_handler(
                self._held(handler.stream_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.response_streaming:
            behaviour = handler.unary_stream

            def stream(request, context):
                # The slot goes back when the stream ends, fails, or is dropped by grpc after a
                # cancel (the generator is closed then).
                with self._slot(context):
                    yield from behaviour(request, context)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            self._held(handler.unary_unary),
            handler.request_deserializer,
            handler.response_serializer,
        )

    def _held(self, behaviour):
        """`behaviour` (a call that returns one reply) run holding a slot."""

        def call(request_or_iterator, context):
            with self._slot(context):
                return behaviour(request_or_iterator, context)

        return call
