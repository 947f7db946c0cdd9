"""Requests that do not decode: INVALID_ARGUMENT naming the method and what was wrong (invalid
UTF-8 in a string field, a length past the end of the message...), where grpc alone answers
INTERNAL "Exception deserializing request!" and logs a traceback, as if the server had failed."""

from __future__ import annotations

from typing import NamedTuple

import grpc


class _Undecodable(NamedTuple):
    """What the guarded decoder returns in place of a request it could not decode."""

    error: str


class DecodeGuard(grpc.ServerInterceptor):
    """Wraps each method's request decoder and behaviour: a request (or, for a client stream, a
    message) that does not decode ends the call with INVALID_ARGUMENT before the servicer runs."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, decode = handler_call_details.method, handler.request_deserializer

        def guarded_decode(data: bytes):
            try:
                return decode(data)
            except Exception as exc:  # noqa: BLE001 - any decoder failure is the caller's input
                return _Undecodable(f"{type(exc).__name__}: {exc}")

        def refuse(bad: _Undecodable, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: the request does not decode ({bad.error})",
            )

        def checked(requests, context):
            for r in requests:
                if isinstance(r, _Undecodable):
                    refuse(r, context)
                yield r

        serialize = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            inner = handler.stream_stream

            def stream_stream(requests, context):
                yield from inner(checked(requests, context), context)

            return grpc.stream_stream_rpc_method_handler(stream_stream, guarded_decode, serialize)
        if handler.request_streaming:
            inner = handler.stream_unary

            def stream_unary(requests, context):
                return inner(checked(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, guarded_decode, serialize)
        if handler.response_streaming:
            inner = handler.unary_stream

            def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    refuse(request, context)
                yield from inner(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, guarded_decode, serialize)
        inner = handler.unary_unary

        def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                refuse(request, context)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, guarded_decode, serialize)
