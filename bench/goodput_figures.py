"""bench/goodput.py's figures from its rows: capacity, the ratios to vLLM and the issue's aims,
halfmoon's TTFT estimates against its measures (from the conductor's RecentTrace), and the
goodput plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

SYSTEMS = ("halfmoon", "vllm")
GOOD = 0.9  # attainment at capacity
BAND = (0.5, 0.9)  # vLLM's attainment where halfmoon's goodput must lead by GOODPUT_AIM
CAPACITY_AIM, GOODPUT_AIM, PAST_CAPACITY_AIM, STARVE_FACTOR = 1.5, 1.3, 0.9, 3.0
PREDICTION_AIM = 1.3  # 90% of halfmoon's TTFT estimates within this factor of the measure


def ttft_prediction(grpc_address: str, requests: int, out: Path) -> dict:
    """halfmoon's TTFT estimates against its measures, of the replay's answered requests (the
    conductor's newest `requests`, RecentTrace): predicted over measured, p50 and p90; each
    request's pair written to `out` (JSONL: prompt tokens, predicted, measured, refused)."""
    import grpc

    from client.api import Client
    from client.report import prediction_error

    try:
        with Client(grpc_address) as c:
            reply = c.recent_trace(requests)
        recs = reply.requests
    except grpc.RpcError as exc:
        return {"error": f"RecentTrace: {exc.code().name}: {exc.details()}"}
    out.write_text("".join(json.dumps({"input_length": r.input_length, "refused": r.refused,
                                       "predicted_ttft_ms": round(r.predicted_ttft_ms, 1),
                                       "ttft_ms": round(r.ttft_ms, 1)}) + "\n"
                           for r in recs), encoding="utf-8")  # fmt: skip
    e = prediction_error((r.predicted_ttft_ms, r.ttft_ms) for r in recs)
    ratios = [r.predicted_ttft_ms / r.ttft_ms for r in recs if r.predicted_ttft_ms and r.ttft_ms]
    # what the conductor scaled each worker's model by at the end (measured over predicted)
    corrections = {m.worker_id: round(m.correction, 3) for m in reply.models}
    if not ratios:
        return {"requests": 0, "p50": None, "p90": None, "within_1.3x": None,
                "corrections": corrections}  # fmt: skip
    within = sum(1 / PREDICTION_AIM <= x <= PREDICTION_AIM for x in ratios) / len(ratios)
    return {"requests": e.requests, "p50": round(e.ratio_p50, 3), "p90": round(e.ratio_p90, 3),
            "within_1.3x": round(within, 3), "corrections": corrections}  # fmt: skip


def capacity(rows: dict[str, dict]) -> float | None:
    """The highest rate at which >= 90% of the offered requests met both objectives."""
    ok = [float(r) for r, row in rows.items() if row.get("attainment", 0.0) >= GOOD]
    return max(ok) if ok else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(result: dict) -> None:
    """halfmoon against vLLM (capacity, goodput at each rate) and the issue's aims, into
    `result`; an aim that this run cannot judge (no rate in its range) is None."""
    hm, vl = result.get("halfmoon", {}), result.get("vllm", {})
    caps = {s: capacity(result[s]) for s in SYSTEMS if s in result}
    result["capacity"] = caps
    if not (hm and vl):
        return
    result["capacity_vs_vllm"] = ratio(caps["halfmoon"], caps["vllm"])
    rates = [r for r in hm if "goodput" in hm[r] and "goodput" in vl.get(r, {})]
    result["goodput_vs_vllm"] = {r: ratio(hm[r]["goodput"], vl[r]["goodput"]) for r in rates}
    band = [r for r in rates if BAND[0] <= vl[r]["attainment"] < BAND[1]]
    in_band = [result["goodput_vs_vllm"][r] or 0.0 for r in band]
    cap = caps["halfmoon"]
    past = [r for r in hm if cap is not None and float(r) > cap and "goodput" in hm[r]]
    at_cap = hm[f"{cap:g}"]["goodput"] if cap is not None else None
    p99s = [hm[r]["ttft_ms"]["99"] for r in hm if (hm[r].get("ttft_ms") or {}).get("99")]
    cap_ratio, ttft_limit = (
        result["capacity_vs_vllm"],
        STARVE_FACTOR * result["objectives"]["ttft_ms"],
    )
    judged = lambda rates, met: {"rates": rates, "met": met} if rates else None  # noqa: E731
    predicted = [r for r in hm if (hm[r].get("ttft_predicted_over_measured") or {}).get("p90")]
    result["aims"] = {
        "capacity_vs_vllm_ge_1.5": None if cap_ratio is None else cap_ratio >= CAPACITY_AIM,
        "goodput_vs_vllm_ge_1.3_in_band": judged(band, bool(band) and min(in_band) >= GOODPUT_AIM),
        "past_capacity_goodput_ge_0.9": judged(
            past if at_cap else [],
            all(hm[r]["goodput"] >= PAST_CAPACITY_AIM * (at_cap or 0) for r in past),
        ),
        "ttft_p99_le_3x": max(p99s) <= ttft_limit if p99s else None,
        # at every rate 90% of the answered requests predicted within 1.3x of their TTFT
        "ttft_prediction_90pct_within_1.3x": judged(
            predicted,
            all(hm[r]["ttft_predicted_over_measured"]["within_1.3x"] >= GOOD for r in predicted),
        ),
    }


def plot(result: dict, path: Path) -> None:
    """Goodput (req/s) and attainment against the offered rate, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = [float(r) for r in result["rates"]]
    a.plot(rates, rates, ":", color="grey", label="offered")
    for system in SYSTEMS:
        rows = result.get(system, {})
        pts = [(float(r), row) for r, row in rows.items() if "goodput" in row]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        a.plot(xs, [row["goodput"] for _, row in pts], "o-", label=system)
        b.plot(xs, [row["attainment"] for _, row in pts], "o-", label=system)
    obj = result["objectives"]
    a.set_xlabel("offered load (requests/s)")
    a.set_ylabel("goodput (requests/s meeting both objectives)")
    a.set_title(f"goodput: TTFT <= {obj['ttft_ms']:g} ms, TPOT <= {obj['tpot_ms']:g} ms")
    b.axhline(GOOD, ls="--", color="grey", lw=1)
    b.set_ylim(0, 1.05)
    b.set_xlabel("offered load (requests/s)")
    b.set_ylabel("attainment (share of requests meeting both)")
    caps = ", ".join(f"{k} {v if v is not None else '-'}" for k, v in result["capacity"].items())
    b.set_title(f"capacity (attainment >= {GOOD:.0%}, req/s): {caps}")
    a.set_ylim(bottom=0)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{result['model']} on {os.cpu_count()} CPUs, {result['dtype']}, "
        f"{result['requests']} requests of a Mooncake trace / {result['scale']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
