"""Starts and stops a halfmoon cluster on Ray: the index, a store node per Ray node, workers, the
conductor, and the OpenAI-compatible HTTP server in front of it (when http_port is set)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from deploy.actor import ServerActor, wait_healthy
from deploy.config import ClusterConfig, dtype_said
from deploy.placement import Placement, node_views, place_workers
from deploy.sizing import memory_said
from deploy.wiring import ServerInfo, Wiring, metrics_address
from servekit import configure_server_logging, set_omp_spin_count


class HttpActor(ServerActor):
    """Hosts the OpenAI-compatible HTTP server (not a gRPC role: it has no registry entry)."""

    def __init__(self) -> None:
        from openai_api import HttpServer

        configure_server_logging("http")
        self.role = "http"
        self._server_cls = HttpServer
        self.server = None
        self.address = ""


class Cluster:
    """`with Cluster(cfg) as c: c.address` — everything it starts, it stops (Ray too, when it
    started Ray)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        log: Callable[[str], None] = print,
        on_ray_ready: Callable[[], None] | None = None,
    ):
        self.cfg = cfg
        self.log = log
        self.on_ray_ready = (
            on_ray_ready  # called right after ray.init (which installs its own signal handlers)
        )
        self.address = ""
        self.http_address = ""  # the HTTP server's HOST:PORT ("" = none)
        self.servers: list[ServerInfo] = []  # the gRPC servers
        self.http_server: ServerInfo | None = None  # the HTTP server, when it runs
        self.redis_url = ""
        self._actors: list[tuple[str, Any]] = []  # (name, handle), in start order
        self._redis = None  # an EmbeddedRedis we own
        self._own_ray = False

    # ------------------------------------------------------------------ start

    def start(self) -> str:
        """Start everything, wait for every health check, return the conductor's address."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        import ray

        cfg = self.cfg
        t0 = time.monotonic()
        self._init_ray(ray)
        if self.on_ray_ready is not None:
            self.on_ray_ready()
        nodes = node_views(ray.nodes())
        self.redis_url = cfg.redis_url or os.environ.get("REDIS_URL", "")
        if not self.redis_url and len(nodes) > 1:
            raise ValueError(
                f"{len(nodes)} Ray nodes need an index they can all reach: set REDIS_URL or "
                "redis_url (the embedded Redis listens on 127.0.0.1 only)"
            )
        if not self.redis_url:
            from kvstore import EmbeddedRedis

            self._redis = EmbeddedRedis()
            self.redis_url = self._redis.url
            self.log(f"index: embedded Redis at {self.redis_url}")
        else:
            self.log(f"index: Redis at {self.redis_url}")
        http = " and the HTTP server" if cfg.http_port else ""
        self.log(
            f"ray: {len(nodes)} node(s); starting {len(nodes)} store node(s), "
            f"{cfg.prefill_workers} prefill, "
            f"{cfg.decode_workers} decode worker(s), the conductor{http} ({cfg.model}, "
            f"{dtype_said(cfg)}; {memory_said(cfg)})"
        )

        # every actor process is created first, so that their imports overlap; each starts once its
        # config is known
        p = cfg.placement
        here = ray.get_runtime_context().get_node_id()
        head = next((n for n in nodes if n.node_id == here), nodes[0])
        store_actors = [
            (
                f"store-{i}",
                n,
                self._create("store", f"store-{i}", Placement(n.node_id, n.ip, 0.0, {})),
            )
            for i, n in enumerate(nodes)
        ]
        worker_actors = []
        for role, count, resource in (
            ("prefill", cfg.prefill_workers, p.prefill_resource),
            ("decode", cfg.decode_workers, p.decode_resource),
        ):
            for i, pl in enumerate(
                place_workers(nodes, count, resource, p.resource_amount, p.gpus_per_worker)
            ):
                worker_actors.append(
                    (role, f"{role}-{i}", pl, self._create(role, f"{role}-{i}", pl))
                )
        conductor_actor = self._create(
            "conductor", "conductor", Placement(head.node_id, head.ip, 0.0, {})
        )
        http_actor = (
            self._create("http", "http", Placement(head.node_id, head.ip, 0.0, {}))
            if cfg.http_port
            else None
        )

        # one store node per Ray node
        wiring = Wiring(cfg, self.redis_url)
        launches = [
            ("store", name, actor, wiring.store(name, self._host(n.ip)))
            for name, n, actor in store_actors
        ]
        stores = {info.node_id: info for info in self._gather(launches)}

        # workers, each beside its node's store node
        launches = []
        for role, name, pl, actor in worker_actors:
            wcfg = wiring.worker(role, name, stores[pl.node_id], self._host(pl.ip))
            launches.append((role, name, actor, wcfg))
        workers = self._gather(launches)

        # the conductor, on this (the driver's) node
        ccfg = wiring.conductor(workers, list(stores.values()), self._host(head.ip))
        (conductor,) = self._gather([("conductor", "conductor", conductor_actor, ccfg)])
        self.address = conductor.address
        if http_actor is not None:  # beside the conductor
            hcfg = wiring.http(conductor, self._host(head.ip))
            (self.http_server,) = self._gather([("http", "http", http_actor, hcfg)])
            self.http_address = self.http_server.address
        http = f", HTTP API at http://{self.http_address}/v1" if self.http_address else ""
        self.log(f"cluster up in {time.monotonic() - t0:.1f} s: conductor at {self.address}{http}")
        return self.address

    def _init_ray(self, ray) -> None:
        rc = self.cfg.ray
        if ray.is_initialized():
            return  # someone else's Ray (a test, a notebook): use it, leave it running
        if rc.address:
            ray.init(address=rc.address, namespace=rc.namespace, log_to_driver=False)
            self.log(f"ray: joined {rc.address}")
        else:
            # the local instance's processes inherit this environment (a joined one has its own)
            spin = set_omp_spin_count(self.cfg.omp_spin_count)
            os.environ.setdefault("RAY_worker_niceness", str(rc.worker_niceness))
            ray.init(
                num_cpus=rc.num_cpus or os.cpu_count(),
                object_store_memory=rc.object_store_mb << 20,
                include_dashboard=False,
                namespace=rc.namespace,
                log_to_driver=False,
            )
            self._own_ray = True
            self.log(
                f"ray: started a local instance (GOMP_SPINCOUNT {spin or 'libgomp default'}, "
                f"servers at nice {os.environ['RAY_worker_niceness']})"
            )

    def _host(self, node_ip: str) -> str:
        return node_ip if self.cfg.host == "auto" else self.cfg.host

    def _create(self, role: str, name: str, pl: Placement):
        """Create the actor (its process starts and imports its server's package); start comes
        later."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls, args = (HttpActor, ()) if role == "http" else (ServerActor, (role,))
        actor = (
            ray.remote(actor_cls)
            .options(
                name=f"halfmoon-{name}-{os.getpid()}",
                num_cpus=self.cfg.placement.worker_num_cpus,
                num_gpus=pl.num_gpus,
                resources=pl.resources or None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(pl.node_id, soft=False),
            )
            .remote(*args)
        )
        self._actors.append((name, actor))
        return actor

    def _gather(self, launches: list) -> list[ServerInfo]:
        """Start each (role, name, actor, config) and wait for it to answer its health check."""
        import ray

        from openai_api import wait_http_healthy

        started = [actor.start.remote(config) for _, _, actor, config in launches]
        out = []
        for (role, name, actor, config), pending in zip(launches, started):
            address = ray.get(pending, timeout=self.cfg.health_timeout_s)
            if role == "http":
                wait_http_healthy(address, self.cfg.health_timeout_s, f"{role} {name}")
            else:  # over TLS when the cluster runs it
                security = getattr(config, "security", None)
                wait_healthy(address, self.cfg.health_timeout_s, f"{role} {name}", security)
            info = ray.get(actor.info.remote(), timeout=30)
            metrics = metrics_address(role, config, address)
            out.append(ServerInfo(role, name, address, info["node_id"], info["pid"], metrics))
            self.log(f"  {name:<12} {address:<22} pid {info['pid']}")
        self.servers.extend(s for s in out if s.role != "http")
        return out

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Stop servers in reverse start order, then the embedded Redis, then Ray if this started
        it."""
        import ray

        if ray.is_initialized():
            for name, actor in reversed(self._actors):
                try:
                    ray.get(actor.stop.remote(), timeout=20)
                except Exception as e:  # noqa: BLE001 - stopping goes on whatever one server did
                    self.log(f"  {name}: stop failed ({type(e).__name__}: {e}); killing it")
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self._actors.clear()
        self.servers = []
        self.http_server = None
        self.http_address = ""
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False
        self.address = ""

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
