"""A real Ray launch on tiny-random: store node, 1 prefill, 1 decode, the conductor; Generate,
status, a small replay, and shutdowns (in-process and `halfmoon serve` + SIGTERM) that leave no
process behind."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from ports import free_port_run

from client import SHIPPED_TRACE, AsyncClient, Client, Scaling, read_records, replay_trace
from client.cli import main as cli_main
from deploy import Cluster, load_cluster_config
from kvstore import StoreControl

ROOT = Path(__file__).resolve().parents[1]


def _overrides(tmp: Path) -> list[str]:
    return [
        "model=tiny-random",
        "conductor.port=0",
        "ray.num_cpus=2",
        "health_timeout_s=120",
        f"store.ssd_dir={tmp}/ssd-{{node_id}}",
        "store.dram_bytes=67108864",
        "store.ssd_bytes=268435456",
        "prefill.num_blocks=128",
        "decode.num_blocks=128",
    ]


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(pids, timeout_s=20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    metrics = free_port_run(4)
    cfg = load_cluster_config(
        None, _overrides(tmp_path_factory.mktemp("cluster")) + [f"metrics_base_port={metrics}"]
    )
    c = Cluster(cfg, log=lambda m: print(m, file=sys.stderr))
    # what earlier tests left running (a LocalCluster's forkserver lives for the session) is not
    # this launch's
    before = _descendants(os.getpid())
    c.start()
    started = _descendants(os.getpid()) - before
    yield c, started
    c.stop()


def test_a_server_that_cannot_start_stops_the_whole_launch(tmp_path):
    before = _descendants(os.getpid())
    with socket.socket() as taken:  # the conductor's port is held by someone else
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_cluster_config(None, _overrides(tmp_path) + [f"conductor.port={port}"])
        c = Cluster(cfg, log=lambda m: None)
        with pytest.raises(Exception, match=str(port)):
            c.start()
    assert _wait_gone(_descendants(os.getpid()) - before) == []
    assert c.address == "" and not c._actors


def test_servers_are_up_where_expected(cluster):
    c, started = cluster
    roles = sorted(s.role for s in c.servers)
    assert roles == ["conductor", "decode", "prefill", "store"]
    assert c.address.startswith("127.0.0.1:")
    assert {s.pid for s in c.servers} <= started  # every server is a process this launch started
    # at the configured nice value, not Ray's 15 (below the host's every other process)
    assert c._own_ray
    assert {psutil.Process(s.pid).nice() for s in c.servers} == {c.cfg.ray.worker_niceness}


def test_generate_through_the_cluster_matches_the_reference(cluster):
    from model import Engine, SamplingParams, load_model

    c, _ = cluster
    lm = load_model("tiny-random", dtype=c.cfg.conductor.dtype)  # local.yaml's dtype: auto
    prompt = lm.tokenizer.encode("halfmoon serves a tiny model")
    want = Engine(lm).generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    with Client(c.address) as client:
        chunks = list(client.generate_stream(token_ids=prompt, max_tokens=12, ignore_eos=True))
        again = client.generate(
            token_ids=prompt, max_tokens=12, ignore_eos=True
        )  # warm: the prefix is cached
    got = [t for ch in chunks for t in ch.token_ids]
    assert got == want
    assert chunks[-1].finished and chunks[-1].usage.completion_tokens == 12
    assert again.token_ids == want and again.ttft_ms > 0

    async def async_generate():
        async with AsyncClient(c.address) as ac:
            return await ac.generate(token_ids=prompt, max_tokens=12, ignore_eos=True)

    assert asyncio.run(async_generate()).token_ids == want


def test_generate_command_streams_text_and_json(cluster, capsys):
    c, _ = cluster
    assert cli_main(["generate", "hello there", "--address", c.address, "--max-tokens", "6"]) == 0
    captured = capsys.readouterr()
    # a short prompt: local.yaml's local_prefill_tokens has the decode worker prefill it
    assert "tokens" in captured.err and "prefilled on decode-0" in captured.err
    assert (
        cli_main(["generate", "hello there", "--address", c.address, "--max-tokens", "6", "--json"])
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (
        records[-1]["finished"]
        and records[-1]["usage"]["completion_tokens"]
        == sum(len(r["token_ids"]) for r in records)
        <= 6
    )
    assert (
        "".join(r["text"] for r in records).strip() in captured.out
    )  # --json carries the same text
    # bad input is one error line, and the cluster keeps serving
    assert cli_main(["generate", "hi", "--address", c.address, "--max-tokens", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT")
    assert cli_main(["generate", "hi", "--address", c.address, "--max-tokens", "2"]) == 0


def test_every_server_exports_prometheus_metrics(cluster):
    c, _ = cluster
    base = c.cfg.metrics_base_port
    for i, server in enumerate(c.servers):  # ports are handed out in start order
        with urllib.request.urlopen(f"http://127.0.0.1:{base + i}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "# TYPE" in text, f"{server.name} on port {base + i}"


def test_status_command_prints_the_cluster(cluster, capsys):
    c, _ = cluster
    assert cli_main(["status", "--address", c.address]) == 0
    out = capsys.readouterr().out
    for name in ("prefill-0", "decode-0", "store-0", "tiny-random"):
        assert name in out
    assert cli_main(["status", "--address", c.address, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert {w["kind"] for w in status["workers"]} == {"prefill", "decode"}
    # each store's bulk port (the one its Info advertises to readers on other hosts) is shown
    (store,) = status["stores"]
    with StoreControl(store["address"]) as control:
        assert store["bulk_port"] == control.bulk_port() > 0
    table = out.split("bulk_port", 1)[1].splitlines()  # the stores table from its header on
    assert f" {store['bulk_port']} " in table[2]  # its first row, under the header and its rule


def test_replay_compares_policies_on_the_cluster(cluster, tmp_path):
    c, _ = cluster
    trace = tmp_path / "t.jsonl"
    # three requests share a two-block prefix; the fourth shares nothing
    # (512-token trace blocks -> 16 tokens)
    rows = [(0, [1, 2, 3]), (400, [1, 2, 4]), (800, [1, 2, 5]), (1200, [9])]
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": t,
                    "input_length": 512 * len(ids),
                    "output_length": 3,
                    "hash_ids": ids,
                }
            )
            + "\n"
            for t, ids in rows
        )
    )
    result = replay_trace(
        c.address,
        trace,
        scaling=Scaling(length_scale=16 / 512, time_scale=1.0),
        policies=["mooncake", "cache_off"],
        ttft_slo_ms=60_000,
        tbt_slo_ms=60_000,
        output_dir=tmp_path / "out",
        progress=False,
        repeats=2,
    )
    by = {r.policy: r for r in result.reports}
    assert by["mooncake"].done == by["cache_off"].done == 2 * 4  # each policy's two runs
    assert by["mooncake"].slo_attainment == 1.0 and by["mooncake"].goodput_rps > 0
    assert by["cache_off"].prefill_tokens_saved == 0
    assert by["mooncake"].prompt_tokens == by["cache_off"].prompt_tokens == 2 * (3 * 48 + 16)
    assert by["cache_off"].prefill_tokens_computed == 2 * (3 * 48 + 16)
    # in each run the later two requests reuse the shared two blocks (the cluster may cache more,
    # never less); the warm-up before it, under a salt of its own, gives it nothing
    assert by["mooncake"].prefill_tokens_saved >= 2 * 2 * 32
    summary = json.loads((tmp_path / "out" / "report.json").read_text())
    order = [(r["policy"], r["repeat"]) for r in summary["runs"]]
    assert order == [("mooncake", 0), ("cache_off", 0), ("cache_off", 1), ("mooncake", 1)]
    records = read_records(tmp_path / "out" / "records-mooncake.jsonl")
    firsts = sorted(records, key=lambda r: r.sent_s)[:: len(records) // 2]  # each run's first
    assert [sum(r.cached_tokens.values()) for r in firsts] == [0, 0]
    assert result.png.is_file()


def test_replay_command_on_the_shipped_trace(cluster, tmp_path, capsys):
    c, _ = cluster
    shipped = SHIPPED_TRACE
    out = tmp_path / "replay"
    assert (
        cli_main(
            [
                "replay",
                str(shipped),
                "--address",
                c.address,
                "--limit",
                "3",
                "--length-scale",
                "0.004",
                "--time-scale",
                "0.2",
                "--max-output",
                "2",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    last = json.loads(
        capsys.readouterr().out.strip().splitlines()[-1]
    )  # the run ends with one JSON line
    assert last["reports"][0]["requests"] == 3 and last["reports"][0]["done"] == 3
    assert {p.name for p in out.iterdir()} == {
        "records-default.jsonl",
        "report.json",
        "report.txt",
        "cdf.png",
    }


def test_in_process_stop_leaves_no_process(cluster):
    c, started = cluster
    assert started and _alive(started)
    c.stop()  # the fixture's stop afterwards is a no-op
    assert c.address == ""
    assert _wait_gone(started) == []


def test_serve_command_stops_everything_on_sigterm(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "client.cli",
        "serve",
        *[x for o in _overrides(tmp_path) for x in ("--set", o)],
    ]
    log = open(
        tmp_path / "serve.log", "w"
    )  # a file, not a pipe: nobody drains it while the test runs
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        address = proc.stdout.readline().strip()  # the first stdout line is the conductor's address
        assert address.startswith("127.0.0.1:"), (tmp_path / "serve.log").read_text()
        spawned = _descendants(proc.pid)
        assert len(spawned) >= 5  # Ray's own processes and the four servers
        assert cli_main(["status", "--address", address]) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert _wait_gone(spawned) == []
