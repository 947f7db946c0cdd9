"""An OpenAI-compatible HTTP API in front of the conductor: /v1/completions and
/v1/chat/completions (streamed as server-sent events or whole), /v1/models, /health, /metrics.

A client of the conductor over gRPC (through `client`); it imports no server package."""

from openai_api.config import HttpConfig
from openai_api.http_server import HttpServer, wait_http_healthy
from openai_api.metrics import HttpMetrics
from openai_api.protocol import ApiError, GenerationSpec, parse_request
from openai_api.server import build_app

__all__ = [
    "ApiError",
    "GenerationSpec",
    "HttpConfig",
    "HttpMetrics",
    "HttpServer",
    "build_app",
    "parse_request",
    "wait_http_healthy",
]
