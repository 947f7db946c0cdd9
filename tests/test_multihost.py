"""A Ray cluster across hosts that the kernel keeps apart (deploy.netns: a network namespace, a
hostname and a /dev/shm each), started as on real machines (`ray start` per host, then
`halfmoon serve --config deploy/configs/multinode.yaml --ray-address HEAD` from the head):
placement by resources, KV pulled across hosts over gRPC only, a conversation's answer blocks
reused by its next turn on another host, a prefix on one host fetched by a prefill worker on
another exactly when the policy's threshold says so and only when the link as measured makes
fetching faster than recomputing (a link `tc` shapes: a tbf rate; this kernel may lack netem, in
which case no delay is added and that is logged), outputs equal to Engine's, and a decode host lost
mid-stream. The cluster runs with TLS (mutual between nodes) and tokens, the OpenAI-compatible
HTTP API in front of it included, so every one of those cross-host calls is encrypted and
authenticated. Needs root and `ip netns`."""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from deploy.netns import netns_problem

_PROBLEM = netns_problem()
if _PROBLEM:
    pytest.skip(f"cannot make network namespaces here: {_PROBLEM}", allow_module_level=True)

from serving_cluster import request, wait_for  # noqa: E402

from client.api import Access  # noqa: E402
from deploy.hosts import HostCluster, HostSpec, Secured  # noqa: E402
from kvstore import Index, block_keys  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from model import Engine, SamplingParams, load_model  # noqa: E402
from protos import halfmoon_pb2 as pb  # noqa: E402
from protos import halfmoon_pb2_grpc as pb_grpc  # noqa: E402
from protos import kvstore_pb2 as kv_pb  # noqa: E402
from protos import kvstore_pb2_grpc as kv_grpc  # noqa: E402
from servekit import SecurityConfig, open_channel, tenant_salt  # noqa: E402

BS = 16
# multinode.yaml's layout, with a second decode host so that losing one is survivable
SPECS = (
    HostSpec("head"),
    HostSpec("prefillhost", {"prefill": 1.0}),
    HostSpec("decodehost", {"decode": 1.0}),
    HostSpec("decodehost2", {"decode": 1.0}),
)


def _overrides(work: str) -> list[str]:
    return [
        "model=tiny-random",
        "dtype=float32",
        "prefill_workers=1",
        "decode_workers=2",
        "health_timeout_s=240",  # http_port stays multinode.yaml's: the HTTP API on the head
        "metrics_base_port=9100",  # ports are per host: no clash with this machine's
        "placement.worker_num_cpus=0",
        "placement.gpus_per_worker=0",
        "store.dram_bytes=67108864",
        f"store.ssd_dir={work}/ssd/{{node_id}}",
        "store.ssd_bytes=268435456",
        "prefill.num_blocks=256",
        "prefill.device_cache=false",  # a prefix's own-host hits show as DRAM hits
        "decode.num_blocks=256",
        "conductor.port=0",
        "conductor.load_poll_s=0.05",
    ]


class Multi:
    """The running cluster as the tests see it."""

    def __init__(self, hc: HostCluster, served, targets: str, secured: Secured):
        self.hc, self.address, self.secured = hc, served.address, secured
        self.http_url = served.http_url
        self._prefill_channel, self._prefill_stub = None, None
        self.access = Access(token=secured.api_token, tls_ca=secured.tls_ca)
        # what a node presents to another: its certificate and the cluster token
        self.node = SecurityConfig(
            tls_ca=secured.tls_ca,
            tls_cert=secured.tls_cert,
            tls_key=secured.tls_key,
            mutual_tls=True,
            cluster_token=secured.cluster_token,
        )
        self.md = self.access.metadata()
        self.channel = grpc.secure_channel(self.address, self.access.credentials())
        self.stub = pb_grpc.ConductorStub(self.channel)
        # the conductor salts a tenant's block keys: the index holds them under this salt
        self.salt = tenant_salt(SecurityConfig(tenant_secret=secured.tenant_secret), secured.tenant)
        status = self.status()
        self.fingerprint = status.model_fingerprint
        self.host_of_ip = {h.ip: h for h in hc.hosts.hosts.values()}
        with open(targets) as f:
            self.metrics = {t["labels"]["server"]: t["targets"][0] for t in json.load(f)}
        self.store_of_host = {
            self.host_of(s.address).name: s.node_id for s in status.stores
        }  # host name -> its store node id

    def status(self) -> pb.StatusReply:
        return self.stub.Status(pb.StatusRequest(), timeout=10, metadata=self.md)

    def host_of(self, address: str):
        return self.host_of_ip[address.rsplit(":", 1)[0]]

    def generate(self, timeout: float = 120.0, **fields):
        ids, last = [], None
        for msg in self.stub.Generate(request(**fields), timeout=timeout, metadata=self.md):
            ids.extend(msg.token_ids)
            last = msg
        return ids, last

    def store_bytes(self, node_id: str, op: str, path: str) -> float:
        """halfmoon_store_transfer_bytes{op, path} of a store node, from its /metrics."""
        url = f"http://{self.metrics[node_id]}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        want = f'halfmoon_store_transfer_bytes_total{{node="{node_id}",op="{op}",path="{path}"}}'
        for line in body.splitlines():
            if line.startswith(want):
                return float(line.split()[-1])
        return 0.0

    def prefill(self, prompt: list[int], **fields) -> tuple[float, pb.PrefillReply]:
        """One Prefill call straight to the prefill worker, as the conductor makes it (the
        tenant's salt), to fetch exactly what a test says whatever the policy would choose: its
        wall time (ms, over a channel already open) and its reply."""
        if self._prefill_stub is None:
            address = next(w.address for w in self.status().workers if w.kind == "prefill")
            self._prefill_channel = open_channel(address, self.node)
            self._prefill_stub = pb_grpc.PrefillWorkerStub(self._prefill_channel)
            self._prefill_stub.Load(pb.LoadRequest(), timeout=30)  # TLS handshake done here
        req = pb.PrefillRequest(
            token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1), cache_salt=self.salt
        )
        for name, value in fields.items():
            setattr(req, name, value)
        t0 = time.perf_counter()
        reply = self._prefill_stub.Prefill(req, timeout=120)
        return (time.perf_counter() - t0) * 1000.0, reply

    def close(self) -> None:
        self.channel.close()
        if self._prefill_channel is not None:
            self._prefill_channel.close()

    def link(self, node_id: str, fetches: int = 0):
        """The link from store node `node_id` as the prefill worker reports it, once it has
        measured at least `fetches` fetches over it (None: never measured)."""
        deadline = time.monotonic() + 10
        while True:
            load = next(w.load for w in self.status().workers if w.kind == "prefill")
            link = next((x for x in load.links if x.node == node_id), None)
            if link is not None and link.fetches >= fetches or fetches == 0:
                return link
            assert time.monotonic() < deadline, f"no link to {node_id} with {fetches} fetches"
            time.sleep(0.05)

    def clear_store(self, host: str) -> None:
        """Drop every block of `host`'s store node (the index hears of it before this returns)."""
        address = next(
            s.address for s in self.status().stores if self.host_of(s.address).name == host
        )
        client = StoreClient(address, transport="grpc", security=self.node)
        try:
            client.clear()
        finally:
            client.close()

    def wait_held(self, node_id: str, tokens: list[int], n_blocks: int) -> None:
        """Until the index says `node_id` holds the leading `n_blocks` blocks of `tokens` (a
        decode worker publishes after it answers)."""
        keys = block_keys(tokens[: n_blocks * BS], BS, self.fingerprint, self.salt)
        index = Index(self.hc.redis_url)
        try:
            deadline = time.monotonic() + 30
            while True:
                found = index.longest_prefix(keys).get(node_id)
                if found is not None and found.num_blocks >= n_blocks:
                    return
                assert time.monotonic() < deadline, f"{node_id} never held {n_blocks} blocks"
                time.sleep(0.05)
        finally:
            index.close()


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    hc = HostCluster(SPECS, log=say)
    try:
        hc.start()
        work = str(tmp_path_factory.mktemp("multihost"))
        targets = f"{work}/targets.json"
        secured = hc.secured()
        served = hc.serve(_overrides(work) + secured.overrides, extra_args=["--metrics", targets])
        m = Multi(hc, served, targets, secured)
        yield m
        m.close()
    finally:
        hc.stop()


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("tiny-random"))


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def turn(multi: Multi, engine: Engine, prompt: list[int], **extra) -> pb.Usage:
    """A 3-token turn through the conductor; fetched or computed, Engine's tokens."""
    ids, last = multi.generate(token_ids=prompt, max_tokens=3, **extra)
    assert ids == greedy(engine, prompt, 3)
    return last.usage


def test_servers_run_on_their_hosts_and_hosts_share_no_memory(multi):
    status = multi.status()
    hosts = {w.kind: multi.host_of(w.address).name for w in status.workers if w.kind == "prefill"}
    assert hosts == {"prefill": "prefillhost"}
    decode_hosts = sorted(
        multi.host_of(w.address).name for w in status.workers if w.kind != "prefill"
    )
    assert decode_hosts == ["decodehost", "decodehost2"]
    assert multi.host_of(multi.address).name == "head"  # the conductor
    assert sorted(multi.store_of_host) == sorted(s.name for s in SPECS)  # one store per host
    assert multi.hc.redis_url.startswith(f"redis://{multi.hc.head.ip}:")
    # each host has its own hostname and its own /dev/shm, holding its own store's slab only
    for spec in SPECS:
        host = multi.hc.hosts[spec.name]
        assert multi.hc.hosts.run(host, ["hostname"]).strip() == spec.name
        shm = multi.hc.hosts.run(host, ["ls", "/dev/shm"]).split()
        mine = multi.store_of_host[spec.name]
        # (the CPU-turn files, halfmoon-cpus-*, are this host's workers' own: its CPUs')
        slabs = [f for f in shm if f.startswith("halfmoon-") and not f.startswith("halfmoon-cpus-")]
        assert slabs and all(f.startswith(f"halfmoon-{mine}-") for f in slabs), (spec.name, shm)


def test_decode_pulls_kv_across_hosts_over_the_bulk_port_and_outputs_equal_engine(multi, engine):
    rng = random.Random(1)
    store = multi.store_of_host["prefillhost"]
    paths = ("tcp", "grpc", "shm")
    before = {p: multi.store_bytes(store, "get", p) for p in paths}
    for n in (3 * BS + 5, 2 * BS, 7):
        prompt = rand_ids(rng, n)
        ids, last = multi.generate(token_ids=prompt, max_tokens=8)
        assert ids == greedy(engine, prompt, 8)
        assert last.usage.prefill_worker == "prefill-0" and last.usage.decode_worker
    after = {p: multi.store_bytes(store, "get", p) for p in paths}
    # 3 + 2 full blocks of 8 KiB crossed from the prefill host's store to a decode host, over
    # its bulk port (TLS, the cluster token), not gRPC's stream nor shared memory
    assert after["tcp"] - before["tcp"] >= 5 * 8192
    assert after["grpc"] == before["grpc"] and after["shm"] == before["shm"]


def _published(multi: Multi, engine: Engine, prompt: list[int], n_new: int):
    """A turn decoded on a decode host, which then publishes every full block of prompt +
    answer on its own host's store: (those tokens, that store node), once the index holds them
    all from block 0."""
    ids, last = multi.generate(token_ids=prompt, max_tokens=n_new)
    assert ids == greedy(engine, prompt, n_new)
    held = (prompt + ids)[: (len(prompt) + n_new - 1) // BS * BS]
    decode = next(w for w in multi.status().workers if w.worker_id == last.usage.decode_worker)
    node = multi.store_of_host[multi.host_of(decode.address).name]
    multi.wait_held(node, held, len(held) // BS)
    return held, node


def _on_a_decode_host_only(multi: Multi, engine: Engine, rng, n_blocks: int):
    """`n_blocks` blocks that only a decode host's store holds: a long prompt computed on the
    prefill host and decoded on a decode host (which publishes it all), then the prefill host's
    store cleared."""
    held, node = _published(multi, engine, rand_ids(rng, n_blocks * BS - 8), 9)
    assert len(held) == n_blocks * BS
    multi.clear_store("prefillhost")
    return held, node


def test_a_second_turn_on_another_host_hits_the_blocks_the_decode_host_published(multi, engine):
    """The prompt is computed on the prefill host and answered on a decode host: the decode
    host publishes the prompt's blocks with the answer's (the index counts a node's prefix from
    block 0), so the next turn reuses both, its own host's prompt blocks and the answer's across
    the link."""
    rng = random.Random(6)
    first = rand_ids(rng, 30 * BS + 5)
    held, node = _published(multi, engine, first, 60 * BS)
    assert len(held) == 90 * BS and node != multi.store_of_host["prefillhost"]
    u = turn(multi, engine, held + rand_ids(rng, 6))
    assert u.cached_dram_tokens == 30 * BS and u.cached_remote_tokens == 60 * BS
    assert u.computed_prompt_tokens == 6


def test_a_prefix_on_a_decode_host_is_fetched_exactly_when_the_threshold_says(multi, engine):
    """Prefixes long enough that moving them beats computing them on an unshaped link: what
    decides is Mooncake's kvcache_balancing_threshold (1.5). They are 1,920 tokens (120 blocks),
    so that whatever this machine's speeds the fetch wins by a wide margin: prefill time grows
    with the square of the prompt, a transfer only with its bytes (at 768 tokens tiny-random's
    prefill and a fetch over a busy 2-core host's TLS link were within 20% of each other, and the
    policy rightly computed)."""
    rng = random.Random(2)
    # The prefill host holds none of it: a prefix of 120 blocks on a decode host is fetched.
    held, _ = _on_a_decode_host_only(multi, engine, rng, 120)
    u = turn(multi, engine, held + rand_ids(rng, 7))
    assert u.cached_remote_tokens == 120 * BS and u.computed_prompt_tokens == 7

    # It holds 80 of 120 blocks (load_balance computed them there): 120 <= 1.5 x 80, not beyond
    # the threshold, nothing moves; the 80 are reused and the rest computed.
    held, _ = _on_a_decode_host_only(multi, engine, rng, 120)
    u = turn(multi, engine, held[: 80 * BS] + rand_ids(rng, 3), policy="load_balance")
    assert u.cached_remote_tokens == 0 and u.computed_prompt_tokens == 80 * BS + 3
    u = turn(multi, engine, held + rand_ids(rng, 5))
    assert u.cached_remote_tokens == 0 and u.cached_dram_tokens == 80 * BS
    assert u.computed_prompt_tokens == 40 * BS + 5

    # It holds 40 of 120: 120 > 1.5 x 40, beyond it: the 80 it lacks cross the link.
    held, _ = _on_a_decode_host_only(multi, engine, rng, 120)
    turn(multi, engine, held[: 40 * BS] + rand_ids(rng, 3), policy="load_balance")
    u = turn(multi, engine, held + rand_ids(rng, 2))
    assert u.cached_dram_tokens == 40 * BS and u.cached_remote_tokens == 80 * BS
    assert u.computed_prompt_tokens == 2


def test_fetch_or_recompute_follows_the_measured_link(multi, engine):
    """Both sides of the TTFT estimate on one link, as the prefill worker's own fetches measure
    it. The prefill host holds the first blocks of a 120-block prefix that a decode host holds
    whole. Unshaped, the 64 blocks it lacks are fetched or computed, whichever this machine does
    faster (within half again where the two are close); with the link shaped to 5 Mbit/s (tbf),
    the 104 it lacks are recomputed. Each time the choice is the faster one: fetching and
    computing are both timed at the worker from the same start, and the recomputed turn takes
    less than the link needs for those bytes alone. A first fetch measures the link each time,
    and shows that the shaping is real: it takes the wire time of its bytes."""
    rng = random.Random(3)
    hosts = multi.hc.hosts
    rate = 0.005  # Gbit/s

    def warm(held: list[int], node: str, n: int):
        """The prefill host's store emptied, its worker fetches the prefix's first `n` blocks
        from `node` (and holds them from then on): the reply, and the link it then reports."""
        multi.clear_store("prefillhost")
        before = multi.link(node)
        _, r = multi.prefill(held[: n * BS] + [5], fetch_from=node, fetch_blocks=n)
        assert r.cached_remote_tokens == n * BS and r.fetched_bytes > n * 8192
        return r, multi.link(node, (before.fetches if before else 0) + 1)

    # Unshaped: both ways timed from 56 blocks of its own (the better of two each, on a shared
    # host), then the policy's choice.
    held, node = _on_a_decode_host_only(multi, engine, rng, 120)
    prompt = held + rand_ids(rng, 4)
    fetch_ms = compute_ms = float("inf")
    for _ in range(2):
        warm(held, node, 56)
        ms, r = multi.prefill(prompt, fetch_from=node, fetch_blocks=120)
        assert r.cached_remote_tokens == 64 * BS and r.computed_tokens == 4
        fetch_ms = min(fetch_ms, ms)
        warm(held, node, 56)
        ms, r = multi.prefill(prompt)
        assert r.cached_remote_tokens == 0 and r.computed_tokens == 64 * BS + 4
        compute_ms = min(compute_ms, ms)
    fast, link = warm(held, node, 56)
    u = turn(multi, engine, prompt)
    assert u.cached_dram_tokens == 56 * BS
    # Which way wins depends on this machine (a fast CPU computes tiny-random's 1,024 tokens in
    # about the time the TLS link moves their blocks): the choice is the one measured faster, or
    # within half again of it where the two are that close.
    if u.cached_remote_tokens == 64 * BS:
        assert u.computed_prompt_tokens == 4
        assert fetch_ms < 1.5 * compute_ms, (fetch_ms, compute_ms)
    else:
        assert u.cached_remote_tokens == 0 and u.computed_prompt_tokens == 64 * BS + 4
        assert compute_ms < 1.5 * fetch_ms, (fetch_ms, compute_ms)

    # The link out of the decode host holding the next prefix, shaped to 5 Mbit/s (its way in
    # stays as it is: what the decode worker there pulls is not what is weighed here).
    held, node = _on_a_decode_host_only(multi, engine, rng, 120)
    src = hosts[next(h for h, n in multi.store_of_host.items() if n == node)]
    applied = hosts.shape(src, rate_gbit=rate, delay_ms=1.0, direction="out")
    assert applied.rate_gbit == rate  # delay_ms is 0 where this kernel has no netem
    try:
        slow, link = warm(held, node, 16)
        u = turn(multi, engine, held + rand_ids(rng, 4))
    finally:
        hosts.shape(src)  # unshaped again
    # The link is a real one: the 16 blocks took at least their wire time past tbf's burst,
    # where unshaped it moved 56 in far less...
    burst = 32 << 10
    wire_ms = (slow.fetched_bytes - burst) * 8 / (rate * 1e9) * 1000
    assert slow.fetch_ms >= 0.9 * wire_ms, (slow.fetch_ms, wire_ms)
    assert fast.fetch_ms < 0.5 * wire_ms, (fast.fetch_ms, wire_ms)
    assert link.bytes_per_ms < 2 * rate * 1e9 / 8 / 1000  # and the worker measured it so
    # ...so the 104 blocks it lacks are computed instead, and that was the faster: the link
    # alone needs longer for their bytes than the whole turn took.
    assert u.cached_remote_tokens == 0 and u.cached_dram_tokens == 16 * BS
    assert u.computed_prompt_tokens == 104 * BS + 4
    bound_ms = (104 * slow.fetched_bytes / 16 - burst) * 8 / (rate * 1e9) * 1000
    print(
        f"unshaped: fetch {fetch_ms:.0f} ms, compute {compute_ms:.0f} ms (56 blocks fetched in "
        f"{fast.fetch_ms:.1f} ms); at {rate:g} Gbit/s: 16 blocks in {slow.fetch_ms:.0f} ms "
        f"(wire {wire_ms:.0f}), the recomputed turn {u.ttft_ms:.0f} ms against {bound_ms:.0f} "
        "for the bytes alone",
        file=sys.stderr,
    )
    assert u.ttft_ms < bound_ms, u


def test_the_http_api_runs_on_the_secured_cluster(multi, engine):
    """The OpenAI-compatible server beside the conductor dials it over TLS with the node
    certificate and takes the cluster's API tokens, passing the caller's on (the conductor
    derives the tenant)."""
    assert multi.http_url.startswith(f"http://{multi.hc.head.ip}:")
    prompt = rand_ids(random.Random(7), 2 * BS + 3)

    def complete(token: str) -> dict:
        req = urllib.request.Request(
            f"{multi.http_url}/completions",
            data=json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    with pytest.raises(urllib.error.HTTPError) as err:
        complete("not-a-token")
    assert err.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as err:
        complete(multi.secured.cluster_token)  # the cluster's own token is no API token
    assert err.value.code == 401
    body = complete(multi.secured.api_token)
    want = engine.generate(prompt, SamplingParams(max_tokens=4))
    assert body["choices"][0]["text"] == engine.lm.tokenizer.decode(want)
    again = complete(multi.secured.api_token)  # the tenant's blocks, as over gRPC
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS


def test_every_cross_host_call_is_encrypted_and_authenticated(multi):
    """The servers the tests above used across hosts take TLS only, stores and workers only from
    holders of a node certificate, and internal methods only with the cluster token."""
    s = multi.secured
    status = multi.status()
    prefill = next(w.address for w in status.workers if w.kind == "prefill")
    store = next(x.address for x in status.stores if multi.host_of(x.address).name == "decodehost")
    node_cert = SecurityConfig(
        tls_ca=s.tls_ca, tls_cert=s.tls_cert, tls_key=s.tls_key, mutual_tls=True
    )

    def code(channel, call) -> grpc.StatusCode:
        with channel:
            with pytest.raises(grpc.RpcError) as err:
                call(channel)
        return err.value.code()

    load = lambda ch: pb_grpc.PrefillWorkerStub(ch).Load(pb.LoadRequest(), timeout=10)  # noqa: E731
    info = lambda ch: kv_grpc.KVStoreStub(ch).Info(kv_pb.KVInfoRequest(), timeout=10)  # noqa: E731
    for address, rpc in ((prefill, load), (store, info)):
        # plaintext: no answer from a TLS port
        assert code(grpc.insecure_channel(address), rpc) == grpc.StatusCode.UNAVAILABLE
        # TLS without a node certificate: mutual TLS refuses the handshake
        tls_only = grpc.ssl_channel_credentials(open(s.tls_ca, "rb").read())
        assert code(grpc.secure_channel(address, tls_only), rpc) == grpc.StatusCode.UNAVAILABLE
        # a node certificate without the cluster token: refused, the method named
        assert code(open_channel(address, node_cert), rpc) == grpc.StatusCode.UNAUTHENTICATED
    # a client's API token on an internal method: not enough
    with open_channel(prefill, node_cert) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillWorkerStub(ch).Load(pb.LoadRequest(), timeout=10, metadata=multi.md)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # and the conductor serves no one without an API token
    with pytest.raises(grpc.RpcError) as err:
        multi.stub.Status(pb.StatusRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _decoding(multi) -> list:
    """The decode workers the conductor sees running a sequence."""
    return [w for w in multi.status().workers if w.kind == "decode" and w.load.running]


def test_a_decode_host_lost_mid_stream_is_survived(multi, engine):
    """Runs last: it takes a host away for good."""
    rng = random.Random(4)
    prompt = rand_ids(rng, 2 * BS + 3)
    # long enough that the kill lands mid-stream: with the fused decode layers tiny-random
    # decodes a token in ~1-2 ms here, and 400 tokens ended before the kill (2,000 + the prompt
    # stay inside its 2,048-position window)
    n = 2000
    want = greedy(engine, prompt, n)
    got, final, lost = [], None, None
    call = multi.stub.Generate(
        request(token_ids=prompt, max_tokens=n), timeout=180, metadata=multi.md
    )
    for msg in call:
        got.extend(msg.token_ids)
        if len(got) >= 10 and lost is None:
            # the conductor refreshes loads every load_poll_s: right after the first tokens the
            # busy worker may not show yet
            wait_for(lambda: _decoding(multi), 10.0, "a decode worker running the stream")
            busy = _decoding(multi)[0]
            lost = busy.worker_id
            # the host's Ray node, its store node and its decode worker go at once
            assert multi.hc.hosts.kill(multi.host_of(busy.address)) > 0
        if msg.finished:
            final = msg
    assert got == want  # no token repeated, none missing
    assert final.finish_reason == "length" and final.usage.decode_worker not in ("", lost)
    # and the cluster goes on serving on what is left
    prompt = rand_ids(rng, BS + 2)
    ids, last = multi.generate(token_ids=prompt, max_tokens=4)
    assert ids == greedy(engine, prompt, 4) and last.usage.decode_worker != lost
