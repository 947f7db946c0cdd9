"""The registry from role name to server class: deploy, tests and benchmarks start servers by it.

It names packages rather than importing them, so that this neutral package imports no server
package; `role_classes` imports the one asked for."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, NamedTuple


class Role(NamedTuple):
    """Where one kind of server lives: its package's public config and server classes."""

    package: str  # importable package
    config_class: str  # its config dataclass (public name)
    server_class: str  # its server class: Server(config).start() -> "HOST:PORT"; .stop()


# the four kinds of server a cluster runs, by role name (also the section names of a cluster YAML)
ROLES: dict[str, Role] = {
    "store": Role("kvstore.node", "StoreConfig", "StoreNode"),
    "prefill": Role("prefill_node", "PrefillConfig", "PrefillWorker"),
    "decode": Role("decode_node", "DecodeConfig", "DecodeWorker"),
    "conductor": Role("conductor", "ConductorConfig", "Conductor"),
}


def role_classes(role: str) -> tuple[type, type]:
    """(config class, server class) of a role, from its package's public names."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    r = ROLES[role]
    mod = importlib.import_module(r.package)
    missing = [n for n in (r.config_class, r.server_class) if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"{r.package} does not export {', '.join(missing)} (needed for {role})")
    return getattr(mod, r.config_class), getattr(mod, r.server_class)


WORKER_ROLES = ("prefill", "decode")  # the roles a switchable worker moves between


@dataclass
class SwitchableConfig:
    """A worker that can switch roles (servekit.worker.SwitchableWorker): a config for each role
    (deploy.Wiring fills both with the same worker id, store and metrics port) and the role it
    starts in."""

    role: str  # prefill | decode
    prefill: Any  # prefill_node.PrefillConfig
    decode: Any  # decode_node.DecodeConfig

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"SwitchableConfig.role: prefill or decode, not {self.role!r}")

    def of(self, role: str) -> Any:
        return self.prefill if role == "prefill" else self.decode

    # what a launcher reads of a server's config (deploy.wiring.metrics_address)
    @property
    def host(self) -> str:
        return self.of(self.role).host

    @property
    def metrics_port(self) -> int:
        return self.of(self.role).metrics_port

    @property
    def worker_id(self) -> str:
        return self.of(self.role).worker_id


def work_left(load: Any) -> int:
    """Requests a worker still holds by its own load report (a halfmoon.WorkerLoad): queued,
    prefilling or decoding."""
    return load.queued_requests + load.running + (1 if load.running_tokens > 0 else 0)


def server_class(role: str, config: Any = None) -> type:
    """The class that serves `config` in `role`: the role's server, or a switchable worker."""
    if isinstance(config, SwitchableConfig):
        from servekit.worker import SwitchableWorker  # imports torch: only where workers run

        return SwitchableWorker
    return role_classes(role)[1]
