"""deploy/prometheus/prometheus.yml and deploy/grafana/halfmoon.json against a real Prometheus
server scraping a local cluster on tiny-random (skipped where no `prometheus` binary is installed;
Debian's `prometheus` package has one)."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml
from ports import free_port_run

from deploy import LocalCluster, cluster_config_from_dict
from deploy.wiring import write_prometheus_targets
from model import load_model

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
DASHBOARD = ROOT / "deploy" / "grafana" / "halfmoon.json"
REQUESTS = 6


def _api(prom: str, path: str, **params) -> dict:
    url = f"http://{prom}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        reply = json.loads(r.read())
    assert reply["status"] == "success", reply
    return reply["data"]


def _wait(what: str, check, timeout_s: float = 30.0, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:  # Prometheus not listening yet
            last = exc
        time.sleep(0.25)
    tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
    raise TimeoutError(f"{what}: still {last!r} after {timeout_s} s\n{tail}")


def _scalar(prom: str, query: str) -> float:
    result = _api(prom, "query", query=query)["result"]
    return float(result[0]["value"][1]) if result else math.nan


def test_dashboard_is_grafana_json_over_halfmoon_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = set(re.findall(r"\bhalfmoon_[a-z_]+", " ".join(exprs)))
    # what the issue asks for: TTFT/TBT histograms, hits by tier, queues, store, transfer bytes
    for want in (
        "halfmoon_ttft_seconds_bucket",
        "halfmoon_tbt_seconds_bucket",
        "halfmoon_cached_tokens_total",
        "halfmoon_prefill_queued_requests",
        "halfmoon_store_bytes",
        "halfmoon_store_transfer_bytes_total",
        "halfmoon_slo_requests_total",
    ):
        assert want in names
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")
def test_prometheus_scrapes_the_cluster_and_answers_the_dashboards_queries(tmp_path):
    lm = load_model("tiny-random")
    cfg = cluster_config_from_dict(
        {
            "model": "tiny-random",
            "dtype": "float32",  # the model loaded here
            "metrics_base_port": free_port_run(4),  # store, prefill, decode, conductor
            "store": {"dram_bytes": 64 << 20, "heartbeat_s": 0.5},
            "prefill": {"num_blocks": 128},
            "decode": {"num_blocks": 128},
            "conductor": {"load_poll_s": 0.05},
        }
    )
    with LocalCluster(cfg, lm=lm, http=True) as cluster:
        servers = [*cluster.servers, cluster.http_server]
        assert all(s.metrics for s in servers)
        # the shipped configuration, scraping every second instead of every 5 s, and the targets
        # where `halfmoon serve --metrics` writes them (targets/ beside the configuration)
        conf = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        conf["global"].update(scrape_interval="1s", evaluation_interval="1s")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(conf))
        write_prometheus_targets(servers, tmp_path / "targets" / "halfmoon.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            prom = f"127.0.0.1:{s.getsockname()[1]}"
        log = tmp_path / "prometheus.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address={prom}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:

            def all_up():
                active = _api(prom, "targets")["activeTargets"]
                if len(active) == len(servers) and all(t["health"] == "up" for t in active):
                    return {t["labels"]["role"] for t in active}
                return None

            roles = _wait("every target up", all_up, log=log)
            assert roles == {"store", "prefill", "decode", "conductor", "http"}

            base = f"http://{cluster.http_address}/v1"
            with openai.OpenAI(base_url=base, api_key="-", max_retries=0, timeout=60) as api:
                for i in range(REQUESTS):  # half streamed, half whole
                    prompt = list(range(3, 40)) + [i + 3]
                    kw = dict(model="tiny-random", prompt=prompt, max_tokens=4)
                    if i % 2:
                        list(api.completions.create(**kw, stream=True))
                    else:
                        api.completions.create(**kw)
            # the conductor's TTFT histogram, as Prometheus scraped it
            count = "sum(halfmoon_ttft_seconds_count)"
            _wait(f"{count} == {REQUESTS}", lambda: _scalar(prom, count) == REQUESTS, log=log)
            p90 = "histogram_quantile(0.9, sum by (le) (rate(halfmoon_ttft_seconds_bucket[30s])))"
            _wait("a TTFT p90", lambda: _scalar(prom, p90) > 0, log=log)
            buckets = _api(prom, "query", query="sum by (le) (halfmoon_ttft_seconds_bucket)")
            inf = next(r for r in buckets["result"] if r["metric"]["le"] == "+Inf")
            assert float(inf["value"][1]) == REQUESTS
            # the HTTP server's own metrics (another target, scraped at its own time): its TTFT
            # histogram counts the streamed answers
            http_ttft = "sum(halfmoon_http_ttft_seconds_count)"
            _wait(http_ttft, lambda: _scalar(prom, http_ttft) == REQUESTS // 2, log=log)
            http_200 = 'sum(halfmoon_http_requests_total{route="/v1/completions",status="200"})'
            _wait(http_200, lambda: _scalar(prom, http_200) == REQUESTS, log=log)
            # and the store's (its transfer counters exist from its first put on: a scrape just
            # before that one and the requests' end finds none yet)
            moved = "sum(halfmoon_store_transfer_bytes_total)"
            _wait(moved, lambda: _scalar(prom, moved) > 0, log=log)

            # every query of the dashboard is valid PromQL over what the servers export
            dash = json.loads(DASHBOARD.read_text())
            names = set(_api(prom, "label/__name__/values"))
            for panel in dash["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace("$__rate_interval", "30s")
                    _api(prom, "query", query=expr)  # status success, or the assert says why
            for exported in (
                "halfmoon_ttft_seconds_bucket",
                "halfmoon_tbt_seconds_bucket",
                "halfmoon_http_ttft_seconds_bucket",
                "halfmoon_prompt_tokens_total",
                "halfmoon_prefill_queued_requests",
                "halfmoon_decode_running",
                "halfmoon_store_bytes",
                "halfmoon_store_capacity_bytes",
                "halfmoon_store_transfer_bytes_total",
                "halfmoon_slo_requests_total",
            ):
                assert exported in names, exported
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
