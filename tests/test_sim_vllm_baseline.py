"""The vLLM-like colocated baseline (sim.vllm_baseline) and its fit from `vllm bench serve` runs
(sim.vllm_fit): scheduling on hand-built inputs, the fit recovering a known step model from a
simulated run, the shipped profile. No model, no servers: seconds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from client.cli import main as cli_main
from client.traces import TraceRequest
from sim import ClusterSpec, Profile, TraceScaling, load_profile, make_arrivals, simulate
from sim.arrivals import SimRequest
from sim.cache import BlockCache
from sim.capacity import splits_vs_colocated
from sim.config import sim_config_from_dict
from sim.events import EventLoop
from sim.index import GlobalIndex
from sim.instances import Job
from sim.vllm_baseline import VllmConfig, VllmInstance, step_ms
from sim.vllm_fit import bench_files, fitted_runs, read_bench_run, rebuild_steps
from tests.test_sim import TOY as SIM_TOY

ROOT = Path(__file__).resolve().parent.parent

# test_sim's toy profile (1 ms a prompt token, a 10 ms step + 1 ms a decoded sequence), 16-token
# blocks, a pool that never binds unless a test shrinks it, a 64-token step budget
TOY = dataclasses.replace(SIM_TOY, kv_blocks=512, max_batch=16, max_batch_tokens=64)


def req(i: int, t_ms: float, tokens: int, out: int, keys: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(i, t_ms, tokens, out, keys or tuple(range(1000 * (i + 1),
                                                               1000 * (i + 1) + tokens // 16)))


def run_engine(reqs: list[SimRequest], profile: Profile = TOY, **cfg) -> tuple[VllmInstance,
                                                                               list[Job]]:
    """The requests straight into one instance (no policy), every step logged."""
    loop = EventLoop()
    cache = BlockCache("m0-dev", GlobalIndex(), profile.kv_blocks)
    inst = VllmInstance(loop, "m0", profile, cache, lambda j: None, VllmConfig(**cfg))
    inst.step_log = []
    jobs = [Job(r, SimpleNamespace(use_cache=True), r.arrival_ms, profile.block_size)
            for r in reqs]  # fmt: skip
    for j in jobs:
        loop.at(j.arrived, inst.submit, j)
    loop.run()
    return inst, jobs


def test_chunked_prefill_bounds_decode_gaps_where_the_stall_baseline_stalls():
    # a stream decoding, then a 2000-token prompt (2 s of prefill) arrives beside it
    reqs = [req(0, 0, 32, 60), req(1, 100, 2000, 2)]
    inst, jobs = run_engine(reqs)
    stream = jobs[0]
    # each step: 10 ms + 1 ms the stream + at most 63 prompt tokens (1 ms each)
    assert max(stream.gaps) <= step_ms(TOY, 1, 200, 63, 63 * 2000) + 1e-6
    assert any(s.prefill_tokens == 63 and s.decodes == 1 for s in inst.step_log)
    assert jobs[1].done_at > 0 and stream.done_at > 0
    # the old colocated instance prefills the whole prompt between two of the stream's steps
    arr = [r._replace(keys=r.keys) for r in reqs]
    stall = simulate(arr, TOY, ClusterSpec(colocated=1, policy="load_balance"))
    vllm = simulate(arr, TOY, ClusterSpec(colocated=1, colocated_kind="vllm",
                                          policy="load_balance"))  # fmt: skip
    worst = lambda r: max(next(x for x in r.records if x.index == 0).gaps_ms)  # noqa: E731
    assert worst(stall) > 1500
    assert worst(vllm) < 100


def test_every_step_keeps_the_budget_and_a_burst_fills_it():
    reqs = [req(i, 5 * i, 40 + 37 * i, 8) for i in range(10)]
    inst, jobs = run_engine(reqs, max_num_batched_tokens=100)
    carried = [s.decodes + s.prefill_tokens for s in inst.step_log]
    assert max(carried) == 100  # the burst filled steps to the budget, never past it
    assert all(j.done_at > 0 and len(j.gaps) == 7 for j in jobs)  # 8 tokens each, none refused


def test_prompts_are_admitted_first_come_first_served():
    # a long prompt first, short ones right after: FCFS finishes the long one's prefill first
    reqs = [req(0, 0, 300, 4)] + [req(i, 1 + i, 20, 4) for i in range(1, 5)]
    inst, jobs = run_engine(reqs)
    firsts = [j.first_at for j in jobs]
    assert firsts == sorted(firsts)
    assert firsts[1] >= firsts[0] > 0
    # the first step carried only the long prompt (it took the whole budget)
    assert inst.step_log[0].requests == (0,) and inst.step_log[0].prefill_tokens == 64


def test_a_shared_prefix_is_served_from_the_pool():
    shared = tuple(range(1, 9))  # 8 blocks of 16 tokens in common
    a = req(0, 0, 160, 2, shared + (101, 102))
    b = req(1, 2000, 160, 2, shared + (201, 202))
    _, (ja, jb) = run_engine([a, b])
    assert ja.computed == 160 and jb.computed == 160 - 8 * 16
    assert jb.cached["device"] == 8 * 16
    assert jb.first_at - jb.arrived < ja.first_at - ja.arrived
    _, (_, jb_off) = run_engine([a, b], prefix_caching=False)
    assert jb_off.computed == 160 and jb_off.cached["device"] == 0
    # blocks are cached as soon as a step computes them: a prompt arriving during the first
    # prompt's first step (100 of its tokens, 6 full blocks) reuses those 6 the step after
    c = req(2, 50, 160, 2, shared + (301, 302))
    _, (_, jc) = run_engine([a, c], max_num_batched_tokens=100)
    assert jc.cached["device"] == 6 * 16


def test_a_full_pool_preempts_the_last_admitted_and_serves_everyone():
    small = dataclasses.replace(TOY, kv_blocks=12)  # 192 tokens of KV
    reqs = [req(i, i, 64, 60) for i in range(3)]  # 3 x (64 + 60) tokens do not fit at once
    inst, jobs = run_engine(reqs, profile=small)
    assert inst.preemptions > 0
    assert all(j.done_at > 0 and len(j.gaps) == 59 for j in jobs)
    assert inst.used == 0 and not inst.refs  # every block given back
    assert jobs[0].done_at < jobs[2].done_at  # the first admitted was never the victim
    assert max(jobs[0].gaps) < max(jobs[2].gaps)  # the victim's gap holds its recompute


def test_cluster_spec_names_the_kind_and_checks_its_options():
    spec = ClusterSpec(colocated=2, colocated_kind="vllm",
                       colocated_options={"max_num_batched_tokens": 256})  # fmt: skip
    assert spec.label == "mooncake[2M vllm max_num_batched_tokens=256]"
    with pytest.raises(ValueError, match="colocated_kind"):
        ClusterSpec(colocated=1, colocated_kind="sglang")
    with pytest.raises(TypeError):
        ClusterSpec(colocated=1, colocated_kind="vllm", colocated_options={"budget": 1})
    cfg = sim_config_from_dict({"clusters": [{"colocated": 2, "colocated_kind": "vllm",
                                              "colocated_options": {"max_num_seqs": 4}}]})
    assert cfg.clusters[0].colocated_kind == "vllm"


def test_simulate_cli_runs_the_vllm_kind(tmp_path):
    out = tmp_path / "sim"
    base = ["simulate", "--profile", "vllm-cpu-smollm2-135m", "--limit", "30", "--colocated",
            "1", "--policy", "load_balance", "--output", str(out)]  # fmt: skip
    reports = {}
    for kind in ("stall", "vllm"):
        assert cli_main(base + ["--colocated-kind", kind, "--vllm-budget", "256"]
                        if kind == "vllm" else base + ["--colocated-kind", kind]) == 0
        reports[kind] = json.loads((out / "report.json").read_text())["reports"][0]
    assert reports["vllm"]["policy"].endswith("[1M vllm max_num_batched_tokens=256]")
    assert reports["stall"]["policy"] == "load_balance[1M]"
    assert reports["vllm"]["done"] == 30  # nothing refused


# ---- the fit: a simulated run written as bench serve writes it, fitted back ----

TRUE = dataclasses.replace(
    TOY, name="true", block_size=128, kv_blocks=400, max_batch=64, max_batch_tokens=512,
    decode_coef=(20.0, 1.5, 0.002), prefill_coef=(3.0, 0.6, 0.0002), decode_join_ms=20.0,
)  # fmt: skip


def _write_bench_run(tmp: Path, rate: str, n: int = 70) -> Path:
    """A trace (hash ids of 16 tokens, some prefixes shared) and the TRUE profile's simulated
    run of it as `vllm bench serve --save-detailed` writes its result."""
    # prompts of 100-499 tokens (within the 512 budget, as bench/goodput.py's are within
    # 2048), every third one opening with the same 2 blocks (16 hash ids)
    trace = [
        TraceRequest(i, 800.0 * i / float(rate) * ((i * 7) % 5 + 1) / 3, 100 + (i * 233) % 400,
                     2 + (i * 37) % 60, tuple(range(16) if i % 3 == 0 else ())
                     + tuple(range(100 * (i + 1), 100 * (i + 1) + 32)), i + 1)  # fmt: skip
        for i in range(n)
    ]
    trace.sort(key=lambda r: r.timestamp_ms)
    path = tmp / f"trace-{rate}.jsonl"
    with open(path, "w") as f:
        for r in trace:
            ids = list(r.hash_ids)[: -(-r.input_length // 16)]
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": ids}) + "\n")
    from client.traces import load_trace

    arr = make_arrivals(load_trace(path), TraceScaling(trace_block_tokens=16), 128)
    spec = ClusterSpec(colocated=1, colocated_kind="vllm", policy="load_balance")
    recs = sorted(simulate(arr, TRUE, spec).records, key=lambda r: r.index)
    result = {
        "ttfts": [r.ttft_ms / 1000 for r in recs],
        "itls": [[g / 1000 for g in r.gaps_ms] for r in recs],
        "latencies": [r.e2e_ms / 1000 for r in recs],
        "start_times": [1000.0 + r.arrival_s for r in recs],
        "input_lens": [r.prompt_tokens for r in recs],
        "output_lens": [r.output_tokens for r in recs],
        "duration": max(r.arrival_s + r.e2e_ms / 1000 for r in recs),
    }
    out = tmp / f"vllm-{rate}.json"
    out.write_text(json.dumps(result))
    (tmp / f"vllm-{rate}.server.log").write_text(
        "INFO [cpu_worker.py:260] Explicitly set (0.5/23.54) GiB for KV cache on node 0.\n"
        "INFO [kv_cache_utils.py:2327] CPU KV cache size: 51,200 tokens, Maximum concurrency\n"
    )
    return out


def test_the_fit_recovers_a_known_step_model_and_the_cli_writes_it(tmp_path, capsys):
    fit_run, held = _write_bench_run(tmp_path, "1"), _write_bench_run(tmp_path, "3")
    run = read_bench_run(*bench_files(str(fit_run)), block_size=128)
    rebuilt = rebuild_steps(run, 512, 128, 400, 20.0)
    assert rebuilt.mismatches == 0  # the replay placed every first token where it came out
    assert sum(r.prefill_tokens for r in rebuilt.rows) < sum(a.input_tokens for a in run.arrivals)
    out = tmp_path / "vllm-fitted.yaml"
    rc = cli_main(["fit-profile", "--vllm-bench", str(fit_run), "--vllm-holdout", str(held),
                   "--vllm-budget", "512", "--name", "fitted", "--output", str(out)])  # fmt: skip
    assert rc == 0
    p = load_profile(out)
    assert p.kv_blocks == 400 and p.max_batch_tokens == 512 and p.decode_join_ms == 20.0
    for got, want in zip(p.decode_coef + p.prefill_coef, TRUE.decode_coef + TRUE.prefill_coef):
        assert got == pytest.approx(want, rel=0.01)  # the simulated run is noiseless
    assert fitted_runs(p) == {str(fit_run)}
    table = capsys.readouterr().out
    assert "held out" in table and "vllm-3.json" in table
    assert "held out" in out.read_text().split("name:")[0]  # the check is in the header


def test_the_shipped_profile_loads_and_names_its_fit():
    p = load_profile("vllm-cpu-smollm2-135m")
    assert p.block_size == 128 and p.max_batch_tokens == 2048 and p.kv_blocks > 0
    assert min(p.decode_coef[0], p.prefill_coef[1]) > 0  # a step and a prompt token cost time
    assert {Path(f).name for f in fitted_runs(p)} == {"vllm-0.5.json", "vllm-2.json"}


def test_refitting_the_measured_runs_gives_the_shipped_profile(tmp_path):
    out = tmp_path / "refit.yaml"
    fit = [str(f) for f in sorted(fitted_runs(load_profile("vllm-cpu-smollm2-135m")))]
    args = ["fit-profile", "--name", "vllm-cpu-smollm2-135m", "--output", str(out)]
    assert cli_main(args + [x for f in fit for x in ("--vllm-bench", str(ROOT / f))]) == 0
    shipped = yaml.safe_load((ROOT / "sim/profiles/vllm-cpu-smollm2-135m.yaml").read_text())
    again = yaml.safe_load(out.read_text())
    for key in ("decode_coef", "prefill_coef", "decode_join_ms", "kv_blocks", "block_bytes"):
        assert again[key] == pytest.approx(shipped[key]), key


def test_splits_against_colocated_stop_at_the_first_miss_and_rank_both_sides():
    # 16-token prompts, 100-token answers, one every 100 ms: decode bound
    trace = [TraceRequest(i, 100.0 * i, 16 * 32, 100, (i,), i + 1) for i in range(40)]
    scaling = TraceScaling(length_scale=1 / 32)
    base = ClusterSpec(policy="load_balance", ttft_slo_ms=2000, tbt_slo_ms=40)
    col = [ClusterSpec(colocated=3, colocated_kind="vllm", policy="load_balance",
                       ttft_slo_ms=2000, tbt_slo_ms=40)]  # fmt: skip
    r = splits_vs_colocated(trace, scaling, TOY, TOY, 3, [0.5, 1, 2, 4, 8, 16], base, col, 0.9)
    assert [(c.spec.prefill, c.spec.decode) for c in r.splits] == [(1, 2), (2, 1)]
    assert r.best_split.capacity_rps == max(c.capacity_rps for c in r.splits)
    assert r.ratio == pytest.approx(r.best_split.capacity_rps / r.best_colocated.capacity_rps)
    assert r.best_split.spec.decode == 2  # decode bound: the split with more decode wins
    for label in {p.label for p in r.points}:  # each sweep ends at its first miss, if any
        att = [p.attainment for p in r.points if p.label == label]
        assert all(a >= 0.9 for a in att[:-1])
    assert len([p for p in r.points if p.label == col[0].label]) < 6  # it stopped early
    with pytest.raises(ValueError, match="instances"):
        splits_vs_colocated(trace, scaling, TOY, TOY, 4, [1], base, col, 0.9)
