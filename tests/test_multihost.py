"""A Ray cluster across hosts that the kernel keeps apart (deploy.netns: a network namespace, a
hostname and a /dev/shm each), started as on real machines (`ray start` per host, then
`halfmoon serve --config deploy/configs/multinode.yaml --ray-address HEAD` from the head):
placement by resources, KV pulled across hosts over gRPC only, a prefix on one host fetched by a
prefill worker on another exactly when the policy's threshold says so, a link that `tc` shapes,
outputs equal to Engine's, and a decode host lost mid-stream. The cluster runs with TLS (mutual
between nodes) and tokens, so every one of those cross-host calls is encrypted and authenticated.
Needs root and `ip netns`."""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request

import grpc
import pytest

from deploy.netns import netns_problem

_PROBLEM = netns_problem()
if _PROBLEM:
    pytest.skip(f"cannot make network namespaces here: {_PROBLEM}", allow_module_level=True)

from client.api import Access  # noqa: E402
from deploy.hosts import HostCluster, HostSpec, Secured  # noqa: E402
from kvstore import Index, block_keys  # noqa: E402
from model import Engine, SamplingParams, load_model  # noqa: E402
from protos import halfmoon_pb2 as pb  # noqa: E402
from protos import halfmoon_pb2_grpc as pb_grpc  # noqa: E402
from protos import kvstore_pb2 as kv_pb  # noqa: E402
from protos import kvstore_pb2_grpc as kv_grpc  # noqa: E402
from servekit import SecurityConfig, open_channel, tenant_salt  # noqa: E402
from serving_cluster import request  # noqa: E402

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
        "health_timeout_s=240",
        "http_port=0",
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

    def __init__(self, hc: HostCluster, address: str, targets: str, secured: Secured):
        self.hc, self.address, self.secured = hc, address, secured
        self.access = Access(token=secured.api_token, tls_ca=secured.tls_ca)
        self.md = self.access.metadata()
        self.channel = grpc.secure_channel(address, self.access.credentials())
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
        m = Multi(hc, served.address, targets, secured)
        yield m
        m.channel.close()
    finally:
        hc.stop()


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("tiny-random"))


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))


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
        slabs = [f for f in shm if f.startswith("halfmoon-")]
        assert slabs and all(f.startswith(f"halfmoon-{mine}-") for f in slabs), (spec.name, shm)


def test_decode_pulls_kv_across_hosts_over_grpc_and_outputs_equal_engine(multi, engine):
    rng = random.Random(1)
    store = multi.store_of_host["prefillhost"]
    before = {p: multi.store_bytes(store, "get", p) for p in ("grpc", "shm")}
    for n in (3 * BS + 5, 2 * BS, 7):
        prompt = rand_ids(rng, n)
        ids, last = multi.generate(token_ids=prompt, max_tokens=8)
        assert ids == greedy(engine, prompt, 8)
        assert last.usage.prefill_worker == "prefill-0" and last.usage.decode_worker
    after = {p: multi.store_bytes(store, "get", p) for p in ("grpc", "shm")}
    # 3 + 2 full blocks of 8 KiB crossed from the prefill host's store to a decode host
    assert after["grpc"] - before["grpc"] >= 5 * 8192
    assert after["shm"] == before["shm"]  # never shared memory across hosts


def _conversation(multi, engine, rng, answer_blocks: int):
    """A first turn whose prompt is shorter than a block, so the decode worker publishes every
    full block of prompt + answer on its own host: (those tokens, the host's store node)."""
    first = rand_ids(rng, 10)
    n_new = answer_blocks * BS + 1  # the last token's KV is not in the pool
    ids, last = multi.generate(token_ids=first, max_tokens=n_new)
    assert ids == greedy(engine, first, n_new)
    held = (first + ids)[: (len(first) + n_new - 1) // BS * BS]
    decode = next(w for w in multi.status().workers if w.worker_id == last.usage.decode_worker)
    node = multi.store_of_host[multi.host_of(decode.address).name]
    multi.wait_held(node, held, len(held) // BS)
    return held, node


def test_a_prefix_on_a_decode_host_is_fetched_exactly_when_the_threshold_says(multi, engine):
    rng = random.Random(2)

    def turn(prompt, **extra):
        ids, last = multi.generate(token_ids=prompt, max_tokens=3, **extra)
        assert ids == greedy(engine, prompt, 3)  # fetched or computed, the same tokens
        return last.usage

    # The prefill host holds none of it: a prefix of 9 blocks on a decode host is fetched.
    held, node = _conversation(multi, engine, rng, 9)
    assert len(held) == 9 * BS
    u = turn(held + rand_ids(rng, 7))
    assert u.cached_remote_tokens == 9 * BS and u.computed_prompt_tokens == 7

    # It holds 7 of 9 blocks (load_balance computed them there): 9 <= 1.5 x 7, below the
    # threshold, nothing moves; the 7 are reused and the rest computed.
    held, node = _conversation(multi, engine, rng, 9)
    u = turn(held[: 7 * BS] + rand_ids(rng, 3), policy="load_balance")
    assert u.cached_remote_tokens == 0 and u.computed_prompt_tokens == 7 * BS + 3
    u = turn(held + rand_ids(rng, 5))
    assert u.cached_remote_tokens == 0 and u.cached_dram_tokens == 7 * BS
    assert u.computed_prompt_tokens == 2 * BS + 5

    # It holds 4 of 9: 9 > 1.5 x 4, above it: the 5 it lacks cross the link.
    held, node = _conversation(multi, engine, rng, 9)
    turn(held[: 4 * BS] + rand_ids(rng, 3), policy="load_balance")
    u = turn(held + rand_ids(rng, 2))
    assert u.cached_dram_tokens == 4 * BS and u.cached_remote_tokens == 5 * BS
    assert u.computed_prompt_tokens == 2


def test_a_shaped_link_is_a_real_one(multi, engine):
    """A fetch across a 2 Mbit/s link takes at least the time its bytes need on it (the policy's
    transfer estimate is the conductor's configured bandwidth, not the link's)."""
    rng = random.Random(3)
    hosts = multi.hc.hosts
    rate = 0.002
    wire_ms = 12 * 8192 * 8 / (rate * 1e9) * 1000  # 393 ms for 12 blocks of 8 KiB
    transfer = {}
    for shaped in (False, True):
        held, node = _conversation(multi, engine, rng, 12)
        src = hosts[next(h for h, n in multi.store_of_host.items() if n == node)]
        if shaped:
            applied = hosts.shape(src, rate_gbit=rate, delay_ms=1.0)
            assert applied.rate_gbit == rate
        prompt = held + rand_ids(rng, 4)
        try:
            ids, last = multi.generate(token_ids=prompt, max_tokens=2)
        finally:
            hosts.shape(src)  # unshaped again
        assert last.usage.cached_remote_tokens == 12 * BS
        assert ids == greedy(engine, prompt, 2)
        transfer[shaped] = last.usage.transfer_ms
    assert transfer[True] >= 0.8 * wire_ms, transfer
    assert transfer[False] < 0.8 * wire_ms, transfer  # the link, not the machine, made it slow


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


def test_a_decode_host_lost_mid_stream_is_survived(multi, engine):
    """Runs last: it takes a host away for good."""
    rng = random.Random(4)
    prompt = rand_ids(rng, 2 * BS + 3)
    # long enough that the kill lands mid-stream: tiny-random decodes a token in a few ms
    n = 400
    want = greedy(engine, prompt, n)
    got, final, lost = [], None, None
    call = multi.stub.Generate(
        request(token_ids=prompt, max_tokens=n), timeout=180, metadata=multi.md
    )
    for msg in call:
        got.extend(msg.token_ids)
        if len(got) >= 10 and lost is None:
            busy = next(w for w in multi.status().workers if w.kind == "decode" and w.load.running)
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
