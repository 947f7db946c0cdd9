"""Access control on a local cluster of tiny-random: TLS everywhere, mutual TLS between nodes, API
tokens with tenants, the cluster token for internal calls, handle checks, stop-string bounds."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest

from client.api import Access, AsyncClient, Client
from kvstore import block_keys
from kvstore.client import StoreClient
from model import Engine, SamplingParams, finish_reason, load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from protos import kvstore_pb2 as kpb
from protos import kvstore_pb2_grpc as kpb_grpc
from servekit import SecurityConfig, make_certs, open_channel, tenant_salt
from servekit.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.serving_cluster import Cluster

BS = 16
CLUSTER_TOKEN = "cluster-secret"
TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def security(certs) -> SecurityConfig:
    return SecurityConfig(
        tls_cert=certs.cert,
        tls_key=certs.key,
        tls_ca=certs.ca,
        mutual_tls=True,
        cluster_token=CLUSTER_TOKEN,
        api_tokens=dict(TOKENS),
        tenant_secret="salt-key",
    )


@pytest.fixture(scope="module")
def cluster(lm, security):
    with Cluster(lm, cluster={"security": dataclasses.asdict(security)}) as c:
        yield c


def client(cluster, token: str, certs) -> Client:
    """A client as an end user holds it: the CA and a token, no certificate."""
    return Client(cluster.address, timeout_s=60, access=Access(token=token, tls_ca=certs.ca))


def node_channel(address: str, security: SecurityConfig, **change) -> grpc.Channel:
    """A channel to a cluster node with the node's own credentials, some of them changed."""
    return open_channel(address, dataclasses.replace(security, **change))


def rand_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_tls_and_token_serve_a_request_end_to_end(cluster, certs, lm):
    ids = rand_ids(1, 40)
    with client(cluster, "tok-alice", certs) as c:
        got = c.generate(token_ids=ids, max_tokens=8, ignore_eos=True)
        status = c.status()  # Status takes an API token too

    async def generate_async():
        access = Access(token="tok-bob", tls_ca=certs.ca)
        async with AsyncClient(cluster.address, timeout_s=60, access=access) as ac:
            return await ac.generate(token_ids=ids, max_tokens=8, ignore_eos=True)

    want = Engine(lm, block_size=BS).generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    assert got.token_ids == want and got.finish_reason == "length"
    assert asyncio.run(generate_async()).token_ids == want
    assert status.model == lm.name


def test_missing_or_wrong_token_is_unauthenticated(cluster, certs):
    for token in ("", "tok-mallory"):
        with client(cluster, token, certs) as c:
            assert code_of(lambda: c.generate(token_ids=[5, 6, 7], max_tokens=2)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert code_of(c.status) == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_cannot_reach_a_tls_conductor(cluster):
    with Client(cluster.address, timeout_s=5, access=Access(token="tok-alice")) as c:
        assert code_of(c.status) == grpc.StatusCode.UNAVAILABLE


def test_client_token_cannot_call_internal_methods(cluster, certs, security):
    with client(cluster, "tok-alice", certs) as c:
        assert code_of(c.clear_cache) == grpc.StatusCode.PERMISSION_DENIED
        # every tenant's recent requests are not one tenant's to read
        assert code_of(c.recent_trace) == grpc.StatusCode.PERMISSION_DENIED
    # The same token, even over a channel with a node's certificate, reaches no store method...
    with node_channel(
        cluster.store_address, security, cluster_token="tok-alice", api_tokens={}
    ) as ch:
        store = kpb_grpc.KVStoreStub(ch)
        assert code_of(lambda: store.Clear(kpb.KVClearRequest(), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        put = lambda: store.Put(iter([kpb.KVPutChunk()]), timeout=5)  # noqa: E731
        assert code_of(put) == grpc.StatusCode.PERMISSION_DENIED
    # ... and no worker method.
    with node_channel(
        cluster.prefills[0].address, security, cluster_token="tok-alice", api_tokens={}
    ) as ch:
        worker = pb_grpc.PrefillWorkerStub(ch)
        assert code_of(lambda: worker.Load(pb.LoadRequest(), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    # The cluster token may.
    with Client(cluster.address, access=Access(token=CLUSTER_TOKEN, tls_ca=certs.ca)) as admin:
        admin.clear_cache()
        assert admin.recent_trace().block_size == BS


def test_mutual_tls_refuses_a_node_client_without_a_certificate(cluster, security):
    no_cert = {"tls_cert": "", "tls_key": "", "mutual_tls": False}
    with node_channel(cluster.store_address, security, **no_cert) as ch:
        store = kpb_grpc.KVStoreStub(ch)
        assert code_of(lambda: store.Stats(kpb.KVStatsRequest(), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    with node_channel(cluster.store_address, security) as ch:  # with the node certificate
        assert kpb_grpc.KVStoreStub(ch).Stats(kpb.KVStatsRequest(), timeout=5).node_id


def _store_blocks(cluster, security) -> int:
    with StoreClient(cluster.store_address, transport="grpc", security=security) as s:
        return sum(t.blocks for t in s.stats().tiers)


def test_tenants_never_share_blocks_or_see_each_others_hits(cluster, certs, security):
    cluster.wait_idle()
    ids = rand_ids(2, 4 * BS + 3)
    gen = dict(token_ids=ids, max_tokens=2, ignore_eos=True)
    with client(cluster, "tok-alice", certs) as alice, client(cluster, "tok-bob", certs) as bob:
        first = alice.generate(**gen)
        cluster.wait_idle()
        again = alice.generate(**gen)
        cluster.wait_idle()
        before = _store_blocks(cluster, security)
        plain = bob.generate(**gen)  # Bob sends the same prompt with the same (empty) salt...
        cluster.wait_idle()
        after = _store_blocks(cluster, security)
        # ... and then with the salt Alice's blocks are keyed under
        stolen = bob.generate(**gen, cache_salt=tenant_salt(security, "alice"))
        cluster.wait_idle()
        own = bob.generate(**gen)
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == 4 * BS  # Alice's own blocks serve her
    assert plain.usage.cached_tokens == 0 and stolen.usage.cached_tokens == 0  # none serve Bob
    assert own.usage.cached_tokens == 4 * BS  # Bob's own do
    assert after - before >= 4  # Bob's blocks are new ones, under his own keys
    assert plain.token_ids == first.token_ids  # same prompt, same answer


def test_decode_worker_refuses_a_forged_handle(cluster, security):
    decode = cluster.decodes[0]
    ids, other = rand_ids(3, 2 * BS), rand_ids(4, 2 * BS)

    def ask(keys, store_address):
        req = pb.DecodeRequest(
            request_id="forged",
            prompt_ids=ids,
            first_token=5,
            handle=pb.KVHandle(block_keys=keys, store_address=store_address, num_tokens=len(ids)),
            sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        with node_channel(decode.address, security) as ch:
            return code_of(lambda: list(pb_grpc.DecodeWorkerStub(ch).Decode(req, timeout=10)))

    own = cluster.store_address
    assert ask(block_keys(other, BS, decode.fingerprint), own) == grpc.StatusCode.INVALID_ARGUMENT
    assert ask(block_keys(ids, BS, "another model"), own) == grpc.StatusCode.INVALID_ARGUMENT
    # the right keys, but a store that is not one of the cluster's
    right = block_keys(ids, BS, decode.fingerprint)
    assert ask(right, "127.0.0.1:9") == grpc.StatusCode.PERMISSION_DENIED


def test_stop_strings_are_bounded(cluster, certs):
    with client(cluster, "tok-alice", certs) as c:
        for stop in (["x"] * (MAX_STOP_STRINGS + 1), ["y" * (MAX_STOP_CHARS + 1)]):
            call = lambda stop=stop: c.generate(token_ids=[5, 6, 7], max_tokens=2, stop=stop)  # noqa: E731
            assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT


def test_stop_string_found_in_the_newest_tokens_of_a_long_answer(lm):
    # each step decodes a short tail, not the whole answer: a stop string at the end of 2000
    # tokens is still found, and one only in the early part is not found again later
    decode = lm.tokenizer.decode
    words = lm.tokenizer.encode(" plain words" * 400)
    stop_ids = lm.tokenizer.encode(" STOPHERE")
    params = SamplingParams(max_tokens=10_000, stop=("STOPHERE",), ignore_eos=True)
    assert finish_reason(words + stop_ids, params, set(), 10_000, decode) == "stop"
    assert finish_reason(words, params, set(), 10_000, decode) == ""


def test_tenant_salts():
    cfg = SecurityConfig(cluster_token="c", api_tokens={"a": "alice"}, tenant_secret="k")
    assert tenant_salt(cfg, "alice") != tenant_salt(cfg, "bob")
    assert tenant_salt(cfg, "alice", "run-1") != tenant_salt(cfg, "alice", "run-2")
    # the secret changes every salt: who lacks it cannot compute one
    other = SecurityConfig(cluster_token="c", api_tokens={"a": "alice"}, tenant_secret="j")
    assert tenant_salt(cfg, "alice") != tenant_salt(other, "alice")


def test_security_config_errors(tmp_path):
    with pytest.raises(ValueError, match="cluster_token"):
        SecurityConfig(api_tokens={"t": "alice"})
    with pytest.raises(ValueError, match="tls_key"):
        SecurityConfig(tls_cert="a.pem", tls_ca="ca.pem")
    with pytest.raises(ValueError, match="mutual_tls"):
        SecurityConfig(mutual_tls=True)
    with pytest.raises(ValueError, match="must not also be an API token"):
        SecurityConfig(cluster_token="t", api_tokens={"t": "alice"})
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match="tls_ca"):
        open_channel("127.0.0.1:1", SecurityConfig(tls_ca=missing))


def test_http_front_door_speaks_tls_to_the_conductor_and_passes_api_tokens_on(cluster, security):
    # The HTTP server in front of a TLS cluster with tokens: it dials the conductor over TLS,
    # accepts the cluster's API tokens (no keys of its own) and passes the caller's token on,
    # so the conductor authenticates it and derives the tenant's salt.
    import json
    import urllib.error
    import urllib.request

    from openai_api import HttpConfig, HttpServer

    server = HttpServer(HttpConfig(conductor=cluster.address, security=security))
    base = f"http://{server.start()}"
    try:

        def complete(token: str, prompt: list[int]) -> dict:
            req = urllib.request.Request(
                f"{base}/v1/completions",
                data=json.dumps({"prompt": prompt, "max_tokens": 2}).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())

        with urllib.request.urlopen(f"{base}/health", timeout=30) as r:
            assert r.status == 200  # its health channel reached the conductor over TLS
        with pytest.raises(urllib.error.HTTPError) as err:
            complete("not-a-token", [5, 6, 7])
        assert err.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as err:
            complete(CLUSTER_TOKEN, [5, 6, 7])  # the cluster's own token is not an API token
        assert err.value.code == 401
        prompt = rand_ids(31, 3 * BS + 5)
        cached = lambda body: body["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
        assert cached(complete("tok-alice", prompt)) == 0
        assert cached(complete("tok-alice", prompt)) == 3 * BS  # her tenant's blocks
        assert cached(complete("tok-bob", prompt)) == 0  # never another tenant's
    finally:
        server.stop()
