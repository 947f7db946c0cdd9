"""`halfmoon plan`: the P:D split it recommends follows the load (sim.plan, on a toy profile)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from client.cli import main as cli_main
from client.traces import TraceRequest
from sim import ClusterSpec
from sim.arrivals import TraceScaling
from sim.plan import plan_split, splits_of, vllm_baseline_specs, vllm_counterpart
from sim.profile import profile_to_dict
from tests.test_sim import TOY as SIM_TOY

# test_sim's toy profile (1 ms a prompt token, 10 ms a decode step + 1 ms a sequence), with a
# pool that never binds, batches of 4 at most and no store tiers
TOY = dataclasses.replace(SIM_TOY, kv_blocks=256, max_batch=4, dram_blocks=0, ssd_blocks=0)
SCALING = TraceScaling(length_scale=16 / 512)  # a trace block of 512 tokens -> one 16-token block
SPEC = ClusterSpec(policy="load_balance", ttft_slo_ms=2000, tbt_slo_ms=100)


def _trace(n: int, every_ms: float, prompt: int, answer: int) -> list[TraceRequest]:
    b = prompt // 16  # trace blocks of the unscaled prompt (512 tokens -> 16 each)
    return [
        TraceRequest(i, i * every_ms, prompt * 32, answer, tuple(range(i << 10, (i << 10) + b)),
                     i + 1)  # fmt: skip
        for i in range(n)
    ]


def test_long_prompts_short_answers_want_prefill_short_prompts_long_answers_decode():
    rates = [0.5, 1, 2, 4]
    # 600-token prompts (600 ms of prefill each), 2-token answers, one every 250 ms: prefill bound
    heavy_prompts = plan_split(_trace(40, 250.0, 600, 2), SCALING, TOY, 4, rates, SPEC, 0.9)
    assert heavy_prompts.best.prefill > heavy_prompts.best.decode
    # 16-token prompts, 200-token answers in batches of 4: decode bound
    long_answers = plan_split(_trace(40, 250.0, 16, 200), SCALING, TOY, 4, rates, SPEC, 0.9)
    assert long_answers.best.decode > long_answers.best.prefill
    # every split was tried, and the recommended one has the highest capacity
    for plan in (heavy_prompts, long_answers):
        assert [(s.prefill, s.decode) for s in plan.splits] == [(1, 3), (2, 2), (3, 1)]
        assert plan.best.capacity_rps == max(s.capacity_rps for s in plan.splits) > 0


def test_the_colocated_vllm_baseline_is_swept_on_as_many_instances():
    rates = [0.5, 1, 2, 4]
    reqs = _trace(40, 250.0, 600, 2)
    vllm = vllm_baseline_specs(4, SPEC, budgets=(0, 256))
    plan = plan_split(reqs, SCALING, TOY, 4, rates, SPEC, 0.9, baseline=vllm, baseline_profile=TOY)
    b = plan.baseline
    assert b is not None and b.kind == "vllm" and b.capacity_rps > 0
    assert [label for label, _ in b.tried] == [s.label for s in vllm]
    assert b.capacity_rps == max(c for _, c in b.tried) and b.spec.colocated == 4
    assert plan.capacity_vs_baseline == plan.best.capacity_rps / b.capacity_rps
    # the splits are what a plan without the baseline finds
    alone = plan_split(reqs, SCALING, TOY, 4, rates, SPEC, 0.9)
    assert alone.baseline is None and alone.capacity_vs_baseline is None
    assert alone.splits == plan.splits
    with pytest.raises(ValueError, match="4 each"):
        plan_split(reqs, SCALING, TOY, 4, rates, SPEC, 0.9, baseline=vllm_baseline_specs(3, SPEC),
                   baseline_profile=TOY)  # fmt: skip
    # the shipped profiles' counterparts: <name>-vllm, and the CPU fit of the same model
    assert vllm_counterpart("llama2-70b-8xa800") == "llama2-70b-8xa800-vllm"
    assert vllm_counterpart("smollm2-cpu") == "vllm-cpu-smollm2-135m"
    assert vllm_counterpart("toy") is None


def test_a_split_needs_two_instances():
    assert splits_of(2) == [(1, 1)]
    with pytest.raises(ValueError, match="--instances"):
        splits_of(1)


def test_plan_command_prints_the_recommendation_as_json(tmp_path, capsys):
    # the paper's setting (a 70B model on 8xA800 nodes, TTFT 30 s)
    rc = cli_main(["plan", "--instances", "3", "--config", "paper", "--limit", "40",
                   "--rates", "0.5,2", "--output", str(tmp_path)])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["capacity_rps"]) == {"1P:2D", "2P:1D"}
    assert result["recommended"]["prefill"] + result["recommended"]["decode"] == 3
    assert (tmp_path / "plan.png").exists() and (tmp_path / "plan.json").exists()
    # the vLLM-like baseline by default (the paper profile's -vllm counterpart), in both outputs
    base = result["baseline"]
    assert base["kind"] == "vllm" and base["profile"] == "llama2-70b-8xa800-vllm"
    assert base["capacity_rps"] > 0 and base["label"] in base["tried"]
    best = max(result["capacity_rps"].values())
    assert result["capacity_vs_baseline"] == pytest.approx(best / base["capacity_rps"], rel=1e-3)
    assert json.loads((tmp_path / "plan.json").read_text())["baseline"] == base
    # --baseline none: no baseline swept, said nowhere
    assert cli_main(["plan", "--instances", "3", "--config", "paper", "--limit", "40", "--rates",
                     "0.5,2", "--baseline", "none", "--output", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    none = json.loads(out.splitlines()[-1])
    assert none["baseline"] is None and none["capacity_vs_baseline"] is None
    assert "baseline" not in out.split("plot in")[0]
    assert none["capacity_rps"] == result["capacity_rps"]
    # a TPOT objective reaches every split and the baseline: one nothing meets keeps none
    tight_args = ["plan", "--instances", "3", "--config", "paper", "--limit", "40", "--rates",
                  "0.5,2", "--tpot-slo-ms", "0.001", "--output", str(tmp_path)]  # fmt: skip
    assert cli_main(tight_args) == 0
    tight = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert tight["tpot_slo_ms"] == 0.001 and tight["recommended"] is None
    assert set(tight["capacity_rps"].values()) == {0.0} and tight["baseline"]["capacity_rps"] == 0
    with pytest.raises(SystemExit):
        cli_main(["plan", "--instances", "3", "--baseline", "sglang"])
    assert "invalid choice: 'sglang'" in capsys.readouterr().err
    # a profile with no vLLM counterpart: none by default, said; asked for, an error naming the fix
    toy = tmp_path / "toy.yaml"
    toy.write_text(json.dumps(profile_to_dict(TOY)))
    args = ["plan", "--instances", "2", "--limit", "20", "--rates", "1", "--profile", str(toy),
            "--output", str(tmp_path)]  # fmt: skip
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "no vLLM baseline" in out and json.loads(out.splitlines()[-1])["baseline"] is None
    assert cli_main([*args, "--baseline", "vllm"]) != 0
    assert "--vllm-profile" in capsys.readouterr().err
    # objectives nothing meets: said, and nothing recommended
    assert cli_main(["plan", "--instances", "2", "--limit", "20", "--rates", "1",
                     "--ttft-slo-ms", "0.001", "--output", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "no recommendation" in out and json.loads(out.splitlines()[-1])["recommended"] is None
    assert cli_main(["plan", "--instances", "1", "--output", str(tmp_path)]) != 0
    assert "--instances" in capsys.readouterr().err
