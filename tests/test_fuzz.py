"""Bad input, property-based: every gRPC method of every server (conductor, prefill worker, decode
worker, store node, and their health services) gets random messages built from its own
descriptor (edge and huge numbers, huge strings and lists, out-of-range token ids, forged block
keys and store addresses, unknown enum values), undecodable bytes (invalid UTF-8 in string
fields, truncated or random wire data), empty and huge (megabytes) messages, and one past the
store's message limit. Every call ends with a
well-formed status, never UNKNOWN or INTERNAL (an exception the server did not handle), and the
servers keep serving: each answers its health check and a real request is answered exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import descriptor as pbd
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.cli import main as cli_main
from client.traces import TraceError, load_azure, load_mooncake
from deploy import load_cluster_config
from model import Engine, SamplingParams, load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from protos import kvstore_pb2
from tests.serving_cluster import Cluster

BS = 16
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = 50  # per method: the module stays well under 90 s on 2 shared cores
CALL_TIMEOUT_S = 2.0  # a well-formed request may start real work: the deadline ends it
# What no input may cause: an exception the server did not turn into a status.
UNHANDLED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

F = pbd.FieldDescriptor
INT_LIMITS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def cluster(lm):
    with Cluster(lm) as c:
        yield c


def _ints(lo: int, hi: int, vocab: int) -> st.SearchStrategy[int]:
    """Any value of the type, the edges and the values around the vocabulary's end weighted in."""
    edges = [v for v in (lo, hi, -1, 0, 1, vocab - 1, vocab, vocab + 1, 2**31 - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(0, 300), st.integers(lo, hi))


def _scalar(field: pbd.FieldDescriptor, vocab: int, addresses: list[str]) -> st.SearchStrategy:
    t = field.type
    if t in INT_LIMITS:
        return _ints(*INT_LIMITS[t], vocab)
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if t == F.TYPE_FLOAT else 64)  # nan and infinities included
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_ENUM:
        return _ints(-(2**31), 2**31 - 1, 3)  # unknown enum values included
    if t == F.TYPE_STRING:
        return st.one_of(
            st.text(max_size=40),
            st.sampled_from(["", "x" * (1 << 20), "\u0000\ud7ff\U0010ffff", *addresses]),
            # a forged store address or node id: nothing listens there, or it is not a store
            st.sampled_from(["127.0.0.1:1", "256.0.0.1:99999", "store-9", "[::1]:0", ":"]),
        )
    if t == F.TYPE_BYTES:
        return st.one_of(
            st.binary(max_size=40),
            st.binary(min_size=16, max_size=16),  # a forged block key
            st.sampled_from([b"", b"\xff" * (1 << 20)]),
        )
    raise AssertionError(f"no strategy for {field.full_name} (type {t})")


def _field(field: pbd.FieldDescriptor, vocab: int, addresses: list[str], depth: int):
    """A strategy of values of one field (a list for a repeated one)."""
    if field.type == F.TYPE_MESSAGE:
        value = _message(field.message_type, vocab, addresses, depth + 1)
    else:
        value = _scalar(field, vocab, addresses)
    if not field.is_repeated:
        return value
    lists = [st.lists(value, max_size=6)]
    if field.type not in (F.TYPE_MESSAGE, F.TYPE_STRING, F.TYPE_BYTES):
        # a huge list of one value: 300k numbers (a prompt beyond any context window)
        lists.append(value.map(lambda v: [v] * 300_000))
    return st.one_of(*lists)


def _set(msg, field: pbd.FieldDescriptor, value) -> None:
    msg.ClearField(field.name)
    if field.is_repeated:
        getattr(msg, field.name).extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)  # a later member of a oneof replaces an earlier one


def _message(desc: pbd.Descriptor, vocab: int, addresses: list[str], depth: int = 0):
    """A strategy of messages of type `desc`: each field set or not, at random."""
    cls = message_factory.GetMessageClass(desc)
    fields = {
        f.name: st.one_of(st.none(), _field(f, vocab, addresses, depth))
        for f in desc.fields
        if f.type != F.TYPE_MESSAGE or depth < 3
    }

    def build(values: dict):
        msg = cls()
        for name, v in values.items():
            if v is not None:
                _set(msg, desc.fields_by_name[name], v)
        return msg

    return st.fixed_dictionaries(fields).map(build)


def _near(base, vocab: int, addresses: list[str]):
    """A strategy of `base` (a request that works) with a few of its fields, at any depth, cleared
    or replaced by random values of their type: what gets past the first checks."""

    @st.composite
    def mutated(draw):
        msg = type(base)()
        msg.CopyFrom(base)
        _mutate(draw, msg, vocab, addresses, 0)
        return msg

    return mutated()


def _mutate(draw, msg, vocab: int, addresses: list[str], depth: int) -> None:
    for field in msg.DESCRIPTOR.fields:
        actions = ["keep"] * 8 + ["replace", "clear"]  # most fields stay: the call gets deep
        nested = field.type == F.TYPE_MESSAGE and not field.is_repeated
        if nested and msg.HasField(field.name):
            actions += ["inside"] * 2
        action = draw(st.sampled_from(actions))
        if action == "replace":
            _set(msg, field, draw(_field(field, vocab, addresses, depth)))
        elif action == "clear":
            msg.ClearField(field.name)
        elif action == "inside":
            _mutate(draw, getattr(msg, field.name), vocab, addresses, depth + 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _undecodable(desc: pbd.Descriptor) -> st.SearchStrategy[bytes]:
    """Wire bytes no decoder accepts: invalid UTF-8 in a string field, a length past the end,
    random bytes."""
    strings = [f.number for f in desc.fields if f.type == F.TYPE_STRING]
    bad_utf8 = [b"\xc3\x28", b"\xff\xfe", b"\xed\xa0\x80", b"ok\x80"]
    cases = [
        st.binary(min_size=1, max_size=64),
        st.just(_varint((1 << 3) | 2) + _varint(1000) + b"short"),  # length beyond the message
    ]
    if strings:
        cases.append(
            st.builds(
                lambda number, raw: _varint((number << 3) | 2) + _varint(len(raw)) + raw,
                st.sampled_from(strings),
                st.sampled_from(bad_utf8),
            )
        )
    return st.one_of(*cases)


SERVICES = {  # service -> (its file's descriptor, the cluster server that serves it)
    "halfmoon.Conductor": (pb.DESCRIPTOR, "conductor"),
    "halfmoon.PrefillWorker": (pb.DESCRIPTOR, "prefill-0"),
    "halfmoon.DecodeWorker": (pb.DESCRIPTOR, "decode-0"),
    "halfmoon.KVStore": (kvstore_pb2.DESCRIPTOR, "store-0"),
    "grpc.health.v1.Health": (health_pb2.DESCRIPTOR, "store-0"),
}
METHODS = [
    (service, m)
    for service, (file, _) in SERVICES.items()
    for m in file.services_by_name[service.rsplit(".", 1)[1]].methods
    if m.name != "Watch"  # a health watch is a stream that never ends by design
]


def _call(channel: grpc.Channel, method: pbd.MethodDescriptor, payloads: list[bytes]):
    """The call's status code and details; the payloads go out as they are (bytes)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            channel.stream_unary(path)(iter(payloads), timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(payloads[0], timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(payloads[0], timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def channels(cluster):
    chans = {
        s.name: grpc.insecure_channel(
            s.address,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        for s in cluster.local.servers
    }
    yield chans
    for ch in chans.values():
        ch.close()


@pytest.fixture(scope="module")
def bases(cluster, channels) -> dict:
    """A request that works, per method, from a real prefill: the mutations start from these."""
    prompt = [random.Random(1).randrange(3, 259) for _ in range(2 * BS + 5)]
    greedy = pb.SamplingParams(max_tokens=4, ignore_eos=True)
    prefill = pb.PrefillRequest(request_id="fuzz", token_ids=prompt, sampling=greedy)
    reply = pb_grpc.PrefillWorkerStub(channels["prefill-0"]).Prefill(prefill, timeout=30)
    keys = list(reply.handle.block_keys)
    fingerprint = cluster.store.cfg.model_fingerprint
    generate = pb.GenerateRequest(sampling=greedy, cache_salt="fuzz")
    generate.token_ids.ids.extend(prompt)
    return {
        "/halfmoon.Conductor/Generate": generate,
        "/halfmoon.PrefillWorker/Prefill": prefill,
        "/halfmoon.PrefillWorker/Load": pb.LoadRequest(memory=True),
        "/halfmoon.DecodeWorker/Decode": pb.DecodeRequest(
            request_id="fuzz",
            prompt_ids=prompt,
            first_token=reply.first_token,
            handle=reply.handle,
            sampling=greedy,
        ),
        "/halfmoon.DecodeWorker/Load": pb.LoadRequest(memory=True),
        "/halfmoon.KVStore/Lookup": kvstore_pb2.KVLookupRequest(keys=keys),
        "/halfmoon.KVStore/Get": kvstore_pb2.KVGetRequest(keys=keys),
        "/halfmoon.KVStore/Lease": kvstore_pb2.KVLeaseRequest(keys=keys, packed=True),
        "/halfmoon.KVStore/Put": kvstore_pb2.KVPutChunk(
            open=kvstore_pb2.KVPutOpen(
                keys=[bytes(16)], sizes=[4096], parent=keys[0], model_fingerprint=fingerprint
            )
        ),
        "/grpc.health.v1.Health/Check": health_pb2.HealthCheckRequest(service="halfmoon.KVStore"),
    }


@pytest.mark.parametrize(
    "service,method", METHODS, ids=[f"{s.rsplit('.', 1)[1]}.{m.name}" for s, m in METHODS]
)
def test_every_method_answers_bad_input_with_a_status(cluster, channels, bases, service, method):
    vocab = cluster.lm.config.vocab_size
    addresses = [s.address for s in cluster.local.servers]
    channel = channels[SERVICES[service][1]]
    path = f"/{service}/{method.name}"
    encode = lambda m: m.SerializeToString()  # noqa: E731
    typed = _message(method.input_type, vocab, addresses).map(encode)
    kinds = [typed, _undecodable(method.input_type)]
    if path in bases:
        kinds += [_near(bases[path], vocab, addresses).map(encode)] * 2
    payload = st.one_of(*kinds)
    if method.client_streaming:  # an opening message, then any
        payloads = st.tuples(payload, st.lists(st.one_of(typed, payload), max_size=2)).map(
            lambda first_rest: [first_rest[0], *first_rest[1]]
        )
    else:
        payloads = payload.map(lambda p: [p])

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples every run: a failure reproduces
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(payloads)
    def check(sent: list[bytes]) -> None:
        code, details = _call(channel, method, sent)
        assert code not in UNHANDLED, (code, details, [p[:200] for p in sent])
        # the status message reached the client (one past 16 KiB is dropped on the way)
        assert "exceeds hard limit" not in details, details

    check()


def test_a_message_past_the_limit_is_refused(cluster):
    """A Lookup of 70 MB of keys, past the store's 64 MiB message limit: RESOURCE_EXHAUSTED."""
    limit = cluster.store.cfg.max_message_bytes
    big = kvstore_pb2.KVLookupRequest(keys=[b"k" * (1 << 20)] * (limit // (1 << 20) + 6))
    options = [("grpc.max_send_message_length", 2 * limit)]
    with grpc.insecure_channel(cluster.store_address, options=options) as ch:
        code, details = _call(
            ch,
            kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name["Lookup"],
            [big.SerializeToString()],
        )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)


def test_servers_keep_serving_after_the_fuzzing(cluster, channels, lm):
    """Runs after the fuzzing (module order): every server healthy, a real request exact."""
    for name, ch in channels.items():
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    prompt = [random.Random(3).randrange(3, 259) for _ in range(2 * BS + 5)]
    got = cluster.generate(token_ids=prompt, max_tokens=12)[0]
    want = Engine(lm, block_size=BS).generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True)
    )
    assert got == want


# ---- files: traces and cluster configs ----

_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()  # nan and infinities: json writes NaN and Infinity, and reads them back
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_GOOD_LINE = b'{"timestamp": 5, "input_length": 700, "output_length": 9, "hash_ids": [1, 2]}'
_FIELDS = ["timestamp", "input_length", "output_length", "hash_ids"]
_BAD_LINES = st.one_of(
    # a record with some fields of any JSON type
    st.dictionaries(st.sampled_from(_FIELDS + ["other"]), _JSON_VALUES, max_size=5).map(
        lambda d: json.dumps(d).encode()
    ),
    st.text(max_size=30).map(lambda t: t.replace("\n", " ").encode()),
    st.binary(max_size=30).map(lambda b: b.replace(b"\n", b" ")),  # invalid UTF-8 too
    st.sampled_from([b"[" * 5000, b"9" * 5000, b'{"input_length": 1e999}', b"\x00"]),
)


def _trace_error_line(message: str, path) -> int:
    prefix = f"{path}:"
    assert message.startswith(prefix), message
    return int(message[len(prefix) :].split(":", 1)[0])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.just(_GOOD_LINE), _BAD_LINES), min_size=1, max_size=6))
def test_a_malformed_trace_line_is_named(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        reqs = load_mooncake(path)
    except TraceError as exc:
        line = _trace_error_line(str(exc), path)
        assert lines[line - 1] != _GOOD_LINE, (line, lines)
        assert all(x == _GOOD_LINE or not x.strip() for x in lines[: line - 1])
    else:
        # every line was a record (a bad one would have been named): the good ones among them
        assert len(reqs) >= sum(x == _GOOD_LINE for x in lines)


_AZURE_ROW = st.lists(
    st.one_of(
        st.integers(-5, 10**30).map(str),
        st.sampled_from(["nan", "inf", "-1e400", "0001-01-01", "2023-11-16 18:15:46.6805900", ""]),
        st.text(max_size=10).map(lambda t: t.replace("\n", " ")),
    ),
    min_size=0,
    max_size=4,
).map(lambda cells: ",".join(cells).encode())


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(
        st.one_of(
            st.just(b"2023-11-16 18:15:46,374,44"),
            _AZURE_ROW,
            st.binary(max_size=20).map(lambda b: b.replace(b"\n", b" ")),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_a_malformed_azure_row_is_named(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("trace") / "t.csv"
    path.write_bytes(b"\n".join([b"TIMESTAMP,ContextTokens,GeneratedTokens", *rows]))
    try:
        load_azure(path)
    except TraceError as exc:
        line = _trace_error_line(str(exc), path)
        assert 2 <= line <= len(rows) + 1, (line, rows)


_CONFIG = yaml.safe_load((ROOT / "deploy" / "configs" / "local.yaml").read_text())
_SECTIONS = [None, "ray", "placement", "store", "prefill", "decode", "conductor", "http"]
_YAML_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _config_key(section):
    known = list(_CONFIG) if section is None else list(_CONFIG.get(section) or {})
    return st.one_of(st.sampled_from(known or ["x"]), st.text(min_size=1, max_size=8))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_a_bad_cluster_config_value_is_named_with_its_line(tmp_path_factory, data):
    """A shipped config with a few values replaced (any type, unknown keys too): it loads, or the
    error names the file and a line - the line of a key that was changed."""
    cfg = json.loads(json.dumps(_CONFIG))
    changed = []
    for _ in range(data.draw(st.integers(1, 3))):
        section = data.draw(st.sampled_from(_SECTIONS))
        key = data.draw(_config_key(section))
        node = cfg if section is None else cfg.setdefault(section, {})
        if not isinstance(node, dict):
            continue
        node[key] = data.draw(_YAML_VALUES)
        changed.append((section, key))
    path = tmp_path_factory.mktemp("config") / "c.yaml"
    text = yaml.safe_dump(cfg, sort_keys=False, width=1 << 20)
    path.write_text(text)
    try:
        load_cluster_config(path)
    except (ValueError, FileNotFoundError) as exc:
        line = _trace_error_line(str(exc), path)
        named = yaml.safe_load(text.splitlines()[line - 1].strip())
        assert isinstance(named, dict), (str(exc), line)
        (key,) = named
        # a changed key (or its section), or one the message names: a rule over several keys
        # ("completion_max_tokens and chat_max_tokens must be >= 1") names the first of them
        changed_keys = {k for _, k in changed} | {s for s, _ in changed if s}
        assert key in changed_keys or f"{key}" in str(exc).split(": ", 1)[1], (str(exc), changed)


def test_the_cli_names_the_bad_line_without_a_traceback(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(_GOOD_LINE + b"\n" + _GOOD_LINE + b'\n{"timestamp": -1}\n')
    assert cli_main(["replay", str(trace), "--address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3:" in err and "timestamp" in err and "Traceback" not in err
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny-random\ndecode:\n  max_batch: 4\n  num_blockz: 9\n")
    assert cli_main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}:4:" in err and "num_blockz" in err and "Traceback" not in err
