"""StoreConfig: one store node's settings (a dataclass the deploy package loads from YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servekit.security import SecurityConfig, security_config


@dataclass
class StoreConfig:
    node_id: str = "store-0"
    host: str = "127.0.0.1"  # address the gRPC server binds and advertises
    port: int = 0  # 0 = a free port
    dram_bytes: int = 256 << 20  # shared-memory slab size (the dram tier)
    ssd_dir: str = ""  # LMDB directory; "" = no ssd tier
    ssd_bytes: int = 0  # ssd tier capacity (encoded block bytes)
    redis_url: str = ""  # global index; "" = no index (a standalone node)
    model_fingerprint: str = ""  # puts with another fingerprint are refused; "" = accept any
    heartbeat_s: float = 2.0  # index heartbeat period; the node's entry lives 3 periods
    index_timeout_s: float = 1.0  # each index call gives up after this (the index is advisory)
    lease_s: float = 30.0  # a lease not released within this is dropped (its holder died)
    metrics_port: int = 0  # Prometheus exporter on this port; 0 = off
    max_message_bytes: int = 64 << 20  # gRPC message size limit, both ways
    chunk_bytes: int = 1 << 20  # gRPC Get/Put payload per message (1 MiB measured best here)
    # Get and Put calls at once (each holds a server thread while it streams); the next is
    # refused with RESOURCE_EXHAUSTED, and a few more threads keep Lookup, Lease, Stats and
    # health answering under a burst
    grpc_workers: int = 16
    # The bulk port: Get and Put of block bytes over a plain TCP socket (TLS and the cluster token
    # as the gRPC port), what clients on other hosts use; 0 = a free port, -1 = off (gRPC only)
    bulk_port: int = 0
    bulk_connections: int = 64  # connections open at once; the next is refused (busy)
    shm_dir: str = "/dev/shm"  # where the dram slab's file lives
    # Pace each gRPC Get stream to this many Gbit/s (a token bucket per stream; 0 = unlimited): a
    # thin cross-host link on one machine, for tests and benchmarks. StoreNode.set_link_gbps
    # changes it while transfers run.
    link_gbps: float = 0.0
    # TLS and tokens (the cluster's `security` section); every store method is internal
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        self.security = security_config(self.security, "StoreConfig.security")
        if self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("dram_bytes and ssd_bytes must be >= 0")
        if self.ssd_bytes and not self.ssd_dir:
            raise ValueError("ssd_bytes > 0 needs ssd_dir")
        if self.link_gbps < 0:
            raise ValueError(f"link_gbps must be >= 0, got {self.link_gbps}")
        if self.heartbeat_s <= 0 or self.lease_s <= 0 or self.index_timeout_s <= 0:
            raise ValueError("heartbeat_s, lease_s and index_timeout_s must be positive")
        if self.bulk_port < -1 or self.bulk_connections < 1:
            raise ValueError("bulk_port must be >= -1 and bulk_connections >= 1")
        if self.chunk_bytes <= 0 or self.chunk_bytes > self.max_message_bytes - (1 << 16):
            raise ValueError("chunk_bytes must be positive and below max_message_bytes - 64 KiB")

    @classmethod
    def from_dict(cls, d: dict) -> StoreConfig:
        """Build from a YAML mapping; unknown keys are an error naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown StoreConfig keys: {', '.join(unknown)}")
        return cls(**d)
