"""HttpConfig: the OpenAI-compatible HTTP server's settings (a dataclass the deploy package loads
from the cluster config's `http` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servekit import SecurityConfig


@dataclass
class HttpConfig:
    host: str = "127.0.0.1"  # address the HTTP server binds and advertises
    port: int = 0  # 0 = a free port
    conductor: str = ""  # the conductor's gRPC address (the launcher fills it)
    # Bearer API key -> tenant. Empty: no authentication, and every request's cache salt is "".
    # Set: a request must carry one of the keys, and its tenant becomes the cache salt, so
    # tenants never share KV blocks (keys of one tenant do).
    api_keys: dict[str, str] = field(default_factory=dict)
    # The cluster's TLS and tokens (deploy gives it the cluster's `security`): with TLS it dials
    # the conductor over TLS (presenting the node certificate under mutual TLS); with API tokens
    # (security.api_tokens) it accepts those as the gRPC front door does and passes the caller's
    # token on, so the conductor authenticates the call and derives the tenant's cache salt.
    security: SecurityConfig = field(default_factory=SecurityConfig)
    model_name: str = ""  # the name /v1/models lists and requests use; "" = the cluster's model
    completion_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 1024  # /v1/chat/completions without max_tokens/max_completion_tokens
    request_timeout_s: float = 600.0  # deadline of one Generate call to the conductor
    health_timeout_s: float = 2.0  # deadline of the conductor health check behind /health
    shutdown_grace_s: float = 2.0  # open streams get this long to end when the server stops

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"HttpConfig.port: must be in [0, 65535], got {self.port}")
        if not isinstance(self.api_keys, dict):
            raise ValueError(
                f"HttpConfig.api_keys: expected a mapping of key -> tenant, got {self.api_keys!r}"
            )
        for key, tenant in self.api_keys.items():
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"HttpConfig.api_keys: a key must be a non-empty string: {key!r}")
            if not isinstance(tenant, str):
                raise ValueError(
                    f"HttpConfig.api_keys[...]: the tenant must be a string, got {tenant!r}"
                )
        if self.api_keys and self.security.api_tokens:
            raise ValueError(
                "HttpConfig: http.api_keys and security.api_tokens both set: with the cluster's "
                "tokens configured, the HTTP server uses those (drop http.api_keys)"
            )
        if self.completion_max_tokens < 1 or self.chat_max_tokens < 1:
            raise ValueError("HttpConfig: completion_max_tokens and chat_max_tokens must be >= 1")
        if self.request_timeout_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("HttpConfig: request_timeout_s and health_timeout_s must be positive")
