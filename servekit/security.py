"""Access control every server shares: TLS (optionally mutual between cluster nodes), bearer tokens
(API tokens for clients, one cluster token for internal calls), tenants' cache salts, and a helper
that makes a local CA for tests.

One `SecurityConfig` (the cluster YAML's `security:` section) reaches every server's config. With
nothing set, servers serve plaintext and every method is open, as before."""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc

from servekit.request_guard import DecodeGuard

# Health checks stay open: load balancers and launchers probe them without credentials.
_OPEN_PREFIX = "/grpc.health.v1.Health/"


@dataclass
class SecurityConfig:
    # PEM certificate and key this server presents; with mutual_tls, also what it presents as a
    # client of other nodes. Both or neither.
    tls_cert: str = ""
    tls_key: str = ""
    # PEM CA that signed the cluster's certificates: channels to cluster nodes verify servers with
    # it; with mutual_tls, internal servers verify their clients with it. Set = TLS on.
    tls_ca: str = ""
    # Internal servers (store nodes, workers) require a client certificate signed by tls_ca. The
    # conductor's client-facing port never does: clients authenticate with API tokens.
    mutual_tls: bool = False
    # the name checked in servers' certificates ("" = the host of the address dialled)
    tls_server_name: str = ""
    # Bearer token of internal calls (store, worker RPCs, Conductor.ClearCache); "" = those are
    # open (only allowed when api_tokens is empty too).
    cluster_token: str = ""
    # Bearer API token -> tenant, for the conductor's Generate and Status; {} = open (tenant "").
    api_tokens: dict[str, str] = field(default_factory=dict)
    # HMAC key of tenants' cache salts ("" = an empty key: salts still differ per tenant, but
    # anyone who knows a tenant's name can compute its salt)
    tenant_secret: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("security: tls_cert and tls_key go together (set both or neither)")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("security: tls_cert needs tls_ca (the CA that signed the cluster)")
        if self.mutual_tls and not self.tls_cert:
            raise ValueError("security.mutual_tls needs tls_cert, tls_key and tls_ca")
        if not isinstance(self.api_tokens, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in self.api_tokens.items()
        ):
            raise ValueError(
                "security.api_tokens: expected a mapping of non-empty token -> tenant name"
            )
        if self.api_tokens and not self.cluster_token:
            # else Conductor.ClearCache and every internal RPC would be open to any client
            raise ValueError("security.api_tokens needs security.cluster_token for internal calls")
        if self.cluster_token and self.cluster_token in self.api_tokens:
            raise ValueError("security: the cluster token must not also be an API token")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    @property
    def enabled(self) -> bool:
        """Any access control at all (TLS or tokens)."""
        return self.tls or bool(self.cluster_token or self.api_tokens)


def security_config(value, where: str = "security") -> SecurityConfig:
    """A SecurityConfig from a config field: one already, a YAML mapping, or None (all open)."""
    if value is None:
        return SecurityConfig()
    if isinstance(value, SecurityConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {value!r}")
    names = set(SecurityConfig.__dataclass_fields__)
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})"
        )
    return SecurityConfig(**value)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"security.{what}: cannot read {path!r}: {exc.strerror}") from None


# ---- TLS ----


def server_credentials(cfg: SecurityConfig, client_facing: bool) -> grpc.ServerCredentials:
    """A server's TLS credentials; client certificates required on internal servers under
    mutual_tls."""
    if not cfg.tls_cert:
        raise ValueError("security: a TLS server needs tls_cert and tls_key")
    pair = (_read(cfg.tls_key, "tls_key"), _read(cfg.tls_cert, "tls_cert"))
    require = cfg.mutual_tls and not client_facing
    return grpc.ssl_server_credentials(
        [pair],
        root_certificates=_read(cfg.tls_ca, "tls_ca") if require else None,
        require_client_auth=require,
    )


def channel_credentials(cfg: SecurityConfig) -> grpc.ChannelCredentials:
    """TLS credentials of a channel to a cluster node: verify it with tls_ca; present this node's
    certificate when it has one (mutual TLS)."""
    key = _read(cfg.tls_key, "tls_key") if cfg.tls_cert else None
    cert = _read(cfg.tls_cert, "tls_cert") if cfg.tls_cert else None
    return grpc.ssl_channel_credentials(_read(cfg.tls_ca, "tls_ca"), key, cert)


def add_port(server: grpc.Server, address: str, cfg: SecurityConfig, client_facing: bool) -> int:
    """Open `address` on `server`: TLS when configured, plaintext otherwise; the port (0 =
    failed)."""
    if cfg.tls:
        return server.add_secure_port(address, server_credentials(cfg, client_facing))
    return server.add_insecure_port(address)


def _check_readable(cfg: SecurityConfig) -> None:
    """ValueError naming the field whose file cannot be read (ssl's own error names neither)."""
    for path, what in ((cfg.tls_cert, "tls_cert"), (cfg.tls_key, "tls_key")):
        _read(path, what)


def ssl_server_context(cfg: SecurityConfig, client_facing: bool = False) -> ssl.SSLContext:
    """The TLS side of a plain socket server (a store node's bulk port), as server_credentials
    sets up gRPC's: this node's certificate; client certificates signed by tls_ca required on
    internal servers under mutual_tls."""
    if not cfg.tls_cert:
        raise ValueError("security: a TLS server needs tls_cert and tls_key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _check_readable(cfg)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.mutual_tls and not client_facing:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=_read(cfg.tls_ca, "tls_ca").decode())
    return ctx


def ssl_client_context(cfg: SecurityConfig) -> ssl.SSLContext:
    """The TLS side of a plain socket to a cluster node, as channel_credentials: verify it with
    tls_ca; present this node's certificate when it has one (mutual TLS)."""
    ctx = ssl.create_default_context(cadata=_read(cfg.tls_ca, "tls_ca").decode())
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.tls_cert:
        _check_readable(cfg)
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


def token_matches(cfg: SecurityConfig, token: str) -> bool:
    """Whether `token` is the cluster token (always, when none is configured): for internal calls
    outside gRPC, which the AuthInterceptor does not see."""
    if not cfg.cluster_token:
        return True
    return hmac.compare_digest(_digest(token), _digest(cfg.cluster_token))


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel (TLS or not: gRPC's call
    credentials refuse plaintext channels, and a cluster may run tokens without TLS)."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        # grpc hands interceptors its own namedtuple of call details
        return details._replace(metadata=list(details.metadata or []) + [self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def open_channel(
    address: str, cfg: SecurityConfig | None, options: Sequence[tuple] = ()
) -> grpc.Channel:
    """The one way a server opens a channel to another cluster node: TLS (with this node's
    certificate under mutual TLS) when configured, the cluster token on every call when set."""
    cfg = cfg or SecurityConfig()
    opts = list(options)
    if cfg.tls:
        if cfg.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
        channel = grpc.secure_channel(address, channel_credentials(cfg), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    if cfg.cluster_token:
        channel = grpc.intercept_channel(channel, _Bearer(cfg.cluster_token))
    return channel


# ---- tokens ----


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def bearer_token(metadata: Iterable | None) -> str:
    """The token of an `authorization: Bearer <token>` header ("" = none)."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


class Caller(NamedTuple):
    """Who made a call, by its token."""

    tenant: str  # the API token's tenant ("" for internal callers and open servers)
    internal: bool  # it holds the cluster token
    known: bool  # its token is one of the configured ones


class Tokens:
    """The configured tokens, looked up by digest (no token compared character by character)."""

    def __init__(self, cfg: SecurityConfig):
        self._cluster = _digest(cfg.cluster_token) if cfg.cluster_token else b""
        self._tenants = {_digest(t): tenant for t, tenant in cfg.api_tokens.items()}

    def caller(self, token: str) -> Caller:
        if not token:
            return Caller("", False, False)
        d = _digest(token)
        if self._cluster and hmac.compare_digest(d, self._cluster):
            return Caller("", True, True)
        tenant = self._tenants.get(d)
        return Caller(tenant or "", False, tenant is not None)


def caller_of(context: grpc.ServicerContext, tokens: Tokens) -> Caller:
    """Who called, from the call's metadata (the interceptor has already let it in)."""
    return tokens.caller(bearer_token(context.invocation_metadata()))


class AuthInterceptor(grpc.ServerInterceptor):
    """Lets a call in by its bearer token: `client_methods` (full names, "/pkg.Service/Method")
    take an API token or the cluster token; every other method needs the cluster token. Missing
    or unknown token: UNAUTHENTICATED; an API token on an internal method: PERMISSION_DENIED.
    Health checks stay open."""

    def __init__(self, cfg: SecurityConfig, client_methods: Iterable[str] = ()):
        self._cfg = cfg
        self._tokens = Tokens(cfg)
        self._client_methods = frozenset(client_methods)

    def refusal(self, method: str, token: str) -> tuple[grpc.StatusCode, str] | None:
        """(code, message) when `token` may not call `method`; None when it may."""
        if method.startswith(_OPEN_PREFIX):
            return None
        client = method in self._client_methods
        if client and not self._cfg.api_tokens:
            return None
        if not client and not self._cfg.cluster_token:
            return None
        who = self._tokens.caller(token)
        if not token:
            return grpc.StatusCode.UNAUTHENTICATED, f"{method}: no bearer token (authorization)"
        if not who.known:
            return grpc.StatusCode.UNAUTHENTICATED, f"{method}: bearer token not recognized"
        if not client and not who.internal:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is internal to the cluster: an API token may not call it",
            )
        return None

    def intercept_service(self, continuation, handler_call_details):
        refused = self.refusal(
            handler_call_details.method, bearer_token(handler_call_details.invocation_metadata)
        )
        handler = continuation(handler_call_details)
        if refused is None or handler is None:
            return handler
        code, message = refused

        def deny(_request, context):
            context.abort(code, message)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(cfg: SecurityConfig, client_methods: Iterable[str] = ()) -> list:
    """The interceptors a server takes: access (only when a token is configured), then the guard
    that answers an undecodable request INVALID_ARGUMENT."""
    guard = DecodeGuard()
    if not (cfg.cluster_token or cfg.api_tokens):
        return [guard]
    return [AuthInterceptor(cfg, client_methods), guard]


# ---- tenants ----


def tenant_salt(cfg: SecurityConfig, tenant: str, requested: str = "") -> str:
    """A tenant's cache salt: an HMAC of its name under tenant_secret, with the salt the client
    asked for scoped under it (so a client partitions its own tenant's cache, never reaches
    another's). Fixed-length digest first, so no two (tenant, requested) pairs collide."""
    mac = hmac.new(cfg.tenant_secret.encode(), tenant.encode(), hashlib.sha256).hexdigest()[:32]
    return f"tenant:{mac}:{requested}"


# ---- a local CA for tests ----


class CertPaths(NamedTuple):
    """What make_certs wrote: the CA, and one node certificate (server and client use) with its
    key."""

    ca: str
    cert: str
    key: str


def make_certs(
    directory: str | os.PathLike, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30
) -> CertPaths:
    """A throwaway CA and one certificate for every node, valid for `hosts` (IPs and DNS names),
    made with the `openssl` command. For tests and local trials: a deployment brings its own."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = out / "ca.pem", out / "ca.key"
    cert, key = out / "node.pem", out / "node.key"
    sans = ",".join(
        f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "node.csr", Path(tmp) / "node.ext"
        ext.write_text(
            f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
        )
        steps = [
            ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", days,
             "-subj", "/CN=halfmoon local CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=halfmoon node"],
            ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-days", days,
             "-set_serial", int.from_bytes(os.urandom(8), "big"), "-extfile", ext, "-out", cert],
        ]  # fmt: skip
        for step in steps:
            try:
                subprocess.run(
                    ["openssl", *map(str, step)], check=True, capture_output=True, text=True
                )
            except FileNotFoundError:
                raise RuntimeError("make_certs needs the openssl command") from None
            except subprocess.CalledProcessError as exc:
                raise RuntimeError(f"openssl {step[0]} failed: {exc.stderr.strip()}") from None
    for k in (ca_key, key):
        k.chmod(0o600)
    return CertPaths(str(ca), str(cert), str(key))
