"""A cluster without Ray, for tests, benchmarks and notebooks: the same wiring as the Ray launcher
(deploy.wiring), every server either in this process (threads; a loaded model may be shared) or in
a process of its own (one interpreter each, as a deployment runs them). On request, the
OpenAI-compatible HTTP server starts in front of the conductor."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Collection
from typing import Any

from deploy.config import ClusterConfig
from deploy.wiring import ServerInfo, Wiring, metrics_address
from servekit import (
    configure_server_logging,
    freeze_startup_objects,
    server_class,
    set_omp_spin_count,
)


def _server_class(role: str, cfg: Any) -> type:
    """The server class of a role: the registry's, a worker that can switch roles (its config
    says), or the HTTP server (no gRPC role of its own)."""
    if role == "http":
        from openai_api import HttpServer

        return HttpServer
    return server_class(role, cfg)


def _serve(role: str, cfg, conn) -> None:
    """Child process: build one server from its config, send its address, serve until told to
    stop."""
    configure_server_logging(role)
    server = _server_class(role, cfg)(cfg)
    address = server.start()
    freeze_startup_objects()  # this process is the server's for its life
    conn.send(address)
    conn.recv()
    server.stop()


def _process_context():
    """Where server processes come from: forks of a forkserver that has imported what servers
    import and nothing else (deploy/preload.py), so that they share those pages; spawned where
    there is no forkserver. Either way no state of the caller's is inherited. The forkserver
    starts with the first server and serves every later one: its environment is the caller's
    at that first start."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["deploy.preload"])  # read when the forkserver starts
    return ctx


class ServerProcess:
    """A server in a process of its own (_process_context: no state of this one is inherited):
    its `address` once started, `proc` the process (to kill, as a fault test or a soak does),
    `stop()` to end it. Started again with the same config (and port), it stands in for a server
    that was lost."""

    def __init__(self, role: str, cfg, start_timeout_s: float):
        ctx = _process_context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(role, cfg, child), daemon=True, name=f"halfmoon-{role}"
        )
        self.proc.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._conn.poll(0.2):  # a child that dies starting is not waited for
            if not self.proc.is_alive():
                raise RuntimeError(f"{role} exited with {self.proc.exitcode} while starting")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{role} did not start in {start_timeout_s:.0f} s")
        self.address = self._conn.recv()

    def stop(self) -> None:
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()


class LocalCluster:
    """`with LocalCluster(cfg) as c: c.address`. `hosts` store nodes stand for hosts (workers are
    spread over them in turn); `lm` (a LoadedModel) is shared by in-process workers and the
    conductor instead of each loading it; `processes=True` runs every server in its own
    process, a set of names (e.g. {"decode-0", "store-1"}) only those (a process that can be
    killed, as a fault test needs); `http=True` starts the OpenAI-compatible HTTP server in
    front of the conductor (on cfg.http_port, or a free port when that is 0), at `http_address`.
    Everything it starts, it stops."""

    def __init__(
        self,
        cfg: ClusterConfig,
        lm=None,
        hosts: int = 1,
        processes: bool | Collection[str] = False,
        http: bool = False,
    ):
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if processes is True and lm is not None:
            raise ValueError("a loaded model cannot be shared with server processes")
        self.cfg, self.lm, self.hosts, self.processes, self.http = cfg, lm, hosts, processes, http
        self.redis = None  # the EmbeddedRedis this cluster owns, if any
        self.redis_url = ""
        self.address = ""
        self.http_address = ""  # the HTTP server's HOST:PORT ("" = none)
        self.servers: list[ServerInfo] = []  # the gRPC servers
        self.http_server: ServerInfo | None = None  # the HTTP server, when it runs
        self.objects: dict[str, list[Any]] = {
            "store": [],
            "prefill": [],
            "decode": [],
            "conductor": [],
            "http": [],
        }  # in-process servers by role
        self._stack: list[Any] = []  # what to stop, in start order

    def start(self) -> str:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        cfg = self.cfg
        if self.processes:  # their forkserver inherits this environment; in-process ones cannot
            set_omp_spin_count(cfg.omp_spin_count)
        self.redis_url = cfg.redis_url or os.environ.get("REDIS_URL", "")
        if not self.redis_url:
            from kvstore import EmbeddedRedis

            self.redis = EmbeddedRedis()
            self._stack.append(self.redis)
            self.redis_url = self.redis.url
        wiring = Wiring(cfg, self.redis_url)
        host = "127.0.0.1" if cfg.host == "auto" else cfg.host
        stores = [
            self._run("store", f"store-{h}", wiring.store(f"store-{h}", host))
            for h in range(self.hosts)
        ]
        workers = []
        for role, count in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
            for i in range(count):
                name = f"{role}-{i}"
                wcfg = wiring.worker(role, name, stores[i % self.hosts], host)
                workers.append(self._run(role, name, wcfg))
        conductor = self._run("conductor", "conductor", wiring.conductor(workers, stores, host))
        self.address = conductor.address
        if self.http:
            self.http_server = self._run("http", "http", wiring.http(conductor, host))
            self.http_address = self.http_server.address
        return self.address

    def _own_process(self, name: str) -> bool:
        return self.processes is True or (bool(self.processes) and name in self.processes)

    def _run(self, role: str, name: str, config) -> ServerInfo:
        own_process = self._own_process(name)
        if own_process:
            server = ServerProcess(role, config, self.cfg.health_timeout_s)
            address, pid = server.address, server.proc.pid
        else:
            server_cls = _server_class(role, config)
            shares_model = role not in ("store", "http") and self.lm is not None
            server = server_cls(config, lm=self.lm) if shares_model else server_cls(config)
            self._stack.append(server)
            address, pid = server.start(), os.getpid()
            self.objects[role].append(server)
        if own_process:
            self._stack.append(server)
        info = ServerInfo(role, name, address, "local", pid, metrics_address(role, config, address))
        if role != "http":
            self.servers.append(info)
        return info

    def stop(self) -> None:
        """Stop servers in reverse start order, then the embedded Redis."""
        while self._stack:
            self._stack.pop().stop()
        self.redis = None
        self.address = ""
        self.http_server = None
        self.http_address = ""

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
