"""How a cluster's servers are wired together: each instance's config from the cluster config's
templates and the addresses of the servers started before it. The Ray launcher and the local
(in-process or one-process-per-server) cluster both start servers in this order and with these
configs: store nodes, then the workers beside their host's store node, then the conductor, then
(when asked) the OpenAI-compatible HTTP server in front of it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

from deploy.config import ClusterConfig
from servekit import SwitchableConfig, field_names


class ServerInfo(NamedTuple):
    """One server a launcher started."""

    role: str  # store | prefill | decode | conductor | http
    name: str  # its node_id / worker_id
    address: str  # its gRPC address (the HTTP server's HOST:PORT)
    node_id: str  # the (Ray) node it runs on
    pid: int  # its process
    metrics: str = ""  # HOST:PORT of its Prometheus endpoint (/metrics); "" = none


def metrics_address(role: str, config: Any, address: str) -> str:
    """Where Prometheus scrapes a server started with `config`: its metrics_port on its host (the
    HTTP server serves /metrics on its own port); "" when it exports none."""
    if role == "http":
        return address
    port = getattr(config, "metrics_port", 0)
    return f"{config.host}:{port}" if port else ""


def prometheus_targets(servers: list[ServerInfo]) -> list[dict]:
    """The servers' Prometheus endpoints as a file_sd target list (one group per server, labelled
    with its role and name); servers without one are left out."""
    return [
        {"targets": [s.metrics], "labels": {"role": s.role, "server": s.name}}
        for s in servers
        if s.metrics
    ]


def write_prometheus_targets(servers: list[ServerInfo], path: str | Path) -> Path:
    """Write prometheus_targets to `path` (Prometheus re-reads a file_sd file when it changes);
    written whole, then renamed, so Prometheus never reads half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(prometheus_targets(servers), indent=2) + "\n")
    tmp.replace(path)
    return path


def fill(template: Any, required: dict, optional: dict | None = None) -> Any:
    """A copy of a server config with per-instance values; a required field the class lacks is
    an error, an optional one is set only where the class has it."""
    names = field_names(template)
    missing = sorted(k for k in required if k not in names)
    if missing:
        raise TypeError(
            f"{type(template).__name__} has no field(s) {', '.join(missing)}; "
            "the launcher needs them"
        )
    values = dict(required)
    values.update({k: v for k, v in (optional or {}).items() if k in names})
    return dataclasses.replace(template, **values)


class Wiring:
    """Per-instance configs for one cluster: `cfg`'s templates plus ids, addresses and ports."""

    def __init__(self, cfg: ClusterConfig, redis_url: str):
        self.cfg, self.redis_url = cfg, redis_url
        self._next_metrics_port = cfg.metrics_base_port

    def metrics(self) -> dict:
        """{"metrics_port": the next of consecutive ports from metrics_base_port}; {} when that
        is 0 (each section's own metrics_port stands)."""
        if not self.cfg.metrics_base_port:
            return {}
        port = self._next_metrics_port
        self._next_metrics_port += 1
        return {"metrics_port": port}

    def store(self, name: str, host: str):
        ssd = self.cfg.store.ssd_dir
        return fill(
            self.cfg.store,
            {"node_id": name, "redis_url": self.redis_url, "host": host},
            {**self.metrics(), "ssd_dir": ssd.format(node_id=name) if ssd else ""},
        )

    def worker(self, role: str, name: str, store: ServerInfo, host: str):
        """A prefill or decode worker's config, beside its host's store node. With the
        conductor's role switching on, a servekit.SwitchableConfig: both roles' configs
        (same id, store and metrics port), starting as `role`."""
        required = {"worker_id": name, "store_address": store.address, "store_node": store.name,
                    "host": host}  # fmt: skip
        optional = {"index_url": self.redis_url, **self.metrics()}
        if not self.cfg.conductor.role_switching:
            return fill(getattr(self.cfg, role), required, optional)
        configs = {r: fill(getattr(self.cfg, r), required, optional) for r in ("prefill", "decode")}
        return SwitchableConfig(role, **configs)

    def conductor(self, workers: list[ServerInfo], stores: list[ServerInfo], host: str):
        return fill(
            self.cfg.conductor,
            {
                "prefill_workers": [w.address for w in workers if w.role == "prefill"],
                "decode_workers": [w.address for w in workers if w.role == "decode"],
                "store_addresses": [s.address for s in stores],
                "index_url": self.redis_url,
                "host": host,
            },
            self.metrics(),
        )

    def http(self, conductor: ServerInfo, host: str, port: int | None = None):
        """The HTTP server's config, in front of `conductor`, on `port` (default: http_port)."""
        return fill(
            self.cfg.http,
            {
                "conductor": conductor.address,
                "host": host,
                "port": self.cfg.http_port if port is None else port,
            },
        )
