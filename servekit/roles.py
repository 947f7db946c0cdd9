"""The registry from role name to server class: deploy, tests and benchmarks start servers by it.

It names packages rather than importing them, so that this neutral package imports no server
package; `role_classes` imports the one asked for."""

from __future__ import annotations

import importlib
from typing import NamedTuple


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
