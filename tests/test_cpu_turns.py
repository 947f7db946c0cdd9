"""servekit.CpuTurns: the forwards of workers sharing a host's CPUs take turns (an flock on a file
named by the CPU set), a turn is never held by a process that is gone, and a holder that hangs
costs a bounded wait, counted, never a stopped worker."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import pytest

from decode_node import DecodeConfig
from servekit import CpuTurns, decode_slack_ms


def test_forwards_on_one_cpu_set_never_overlap_and_each_gets_its_turns(tmp_path):
    spans: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}

    def worker(name: str, hold_s: float, n: int):
        turns = CpuTurns(name, [0, 1], 2, "auto", 5.0, lock_dir=str(tmp_path))
        for _ in range(n):
            with turns.turn():
                t0 = time.perf_counter()
                time.sleep(hold_s)
                spans[name].append((t0, time.perf_counter()))
            time.sleep(0.001)  # a decode step's bookkeeping between forwards

    ths = [
        threading.Thread(target=worker, args=("prefill", 0.02, 10)),
        threading.Thread(target=worker, args=("decode", 0.005, 40)),
    ]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    every = sorted(spans["prefill"] + spans["decode"])
    assert len(every) == 50
    assert all(a[1] <= b[0] for a, b in zip(every, every[1:])), "two forwards held a turn at once"
    # the decode worker's short turns did not starve the prefill's long ones: both finished
    # in about the time of all turns back to back
    assert wall < 2 * (10 * 0.02 + 40 * 0.006) + 0.5


def test_auto_takes_turns_only_where_two_workers_would_oversubscribe(tmp_path):
    d = str(tmp_path)
    assert CpuTurns("w", [0, 1], 2, "auto", 1.0, lock_dir=d).path  # 2 x 2 threads > 2 CPUs
    assert not CpuTurns("w", [0, 1, 2, 3], 2, "auto", 1.0, lock_dir=d).path  # 4 fit on 4
    assert CpuTurns("w", [0, 1, 2, 3], 2, "on", 1.0, lock_dir=d).path
    assert not CpuTurns("w", [0, 1], 2, "off", 1.0, lock_dir=d).path
    # workers on other CPUs do not share a lock
    a = CpuTurns("a", [0, 1], 2, "on", 1.0, lock_dir=d).path
    b = CpuTurns("b", [2, 3, 5], 2, "on", 1.0, lock_dir=d).path
    assert a.endswith("halfmoon-cpus-0-1.lock") and b.endswith("halfmoon-cpus-2-3_5.lock")
    with pytest.raises(ValueError, match="cpu_turns"):
        CpuTurns("w", [0], 1, "sometimes", 1.0, lock_dir=d)
    with pytest.raises(ValueError, match="cpu_turns"):
        DecodeConfig(cpu_turns="always")


def test_a_hung_holder_costs_a_bounded_wait_and_a_dead_one_nothing(tmp_path):
    turns = CpuTurns("decode-0", [0, 1], 2, "on", 0.3, lock_dir=str(tmp_path))
    skipped = []
    turns.on_timeout = lambda: skipped.append(1)
    # another process takes the turn and keeps it (a worker hung mid-forward)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({turns.path!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.perf_counter()
        with turns.turn() as waited:
            ran = time.perf_counter() - t0
        assert 0.3 <= ran < 1.5 and waited >= 0.3
        assert turns.timeouts == 1 and skipped == [1]
        # while it stays stuck, the next forwards do not wait again (each counted)
        t0 = time.perf_counter()
        with turns.turn():
            pass
        assert time.perf_counter() - t0 < 0.1 and turns.timeouts == 2
    finally:
        holder.kill()  # killed holding it: the kernel drops the lock with the process
        holder.wait()
    # the holder gone, the turn is had (another worker waiting on it now waits) at once
    other = CpuTurns("prefill-0", [0, 1], 2, "on", 0.05, lock_dir=str(tmp_path))
    t0 = time.perf_counter()
    with turns.turn():
        assert time.perf_counter() - t0 < 0.1
        with other.turn():
            pass
    assert other.timeouts == 1 and turns.timeouts == 2


def _layers_beside_steps(tmp_path, slice_s: float, offer_ms: float | None = None, layers_n=20):
    """A 20-layer forward (10 ms a layer) that calls `share` between layers, and a worker that
    asks for 5 ms steps from 50 ms into it until it ends, offering `offer_ms` of slack: (layer
    spans, step spans, the time the first step asked, the forward's start and end, its
    passes)."""
    d = str(tmp_path)
    prefill = CpuTurns("prefill", [0, 1], 2, "on", 5.0, lock_dir=d, slice_s=slice_s)
    decode = CpuTurns("decode", [0, 1], 2, "on", 5.0, lock_dir=d, slice_s=slice_s)
    decode.offer(offer_ms)
    layers, steps, asked, done = [], [], [], threading.Event()

    def forward():
        with prefill.turn():
            for _ in range(layers_n):
                t0 = time.perf_counter()
                time.sleep(0.01)
                layers.append((t0, time.perf_counter()))
                prefill.share()
        done.set()

    def stepping():
        time.sleep(0.05)
        asked.append(time.perf_counter())
        while not done.is_set():
            with decode.turn():
                t0 = time.perf_counter()
                time.sleep(0.005)
                steps.append((t0, time.perf_counter()))
            time.sleep(0.001)  # the step's bookkeeping

    ths = [threading.Thread(target=forward), threading.Thread(target=stepping)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return layers, steps, asked[0], t0, layers[-1][1], prefill.passes


def test_a_long_forward_hands_the_cpus_to_a_waiting_step_between_layers(tmp_path):
    layers, steps, asked, start, end, passes = _layers_beside_steps(tmp_path, slice_s=0.03)
    every = sorted(layers + steps)
    assert all(a[1] <= b[0] for a, b in zip(every, every[1:])), "a step ran inside a layer"
    # the first step ran within a slice and a layer of asking, not after the whole forward
    assert steps and steps[0][0] - asked < 0.03 + 0.01 + 0.05
    assert passes >= 2
    # the steps that came back to back did not keep the forward out: the turns alternated, one
    # step a pass (without a step's turn going first to a waiting forward, a 1 ms gap between
    # steps sometimes let 37 steps in while the forward polled for its turn)
    between = [s for s in steps if s[0] < end]
    assert len(between) <= passes + 1
    assert end - start < 0.2 + passes * 0.015 + 0.15


def test_a_forward_with_no_slice_keeps_its_turn(tmp_path):
    layers, steps, asked, start, end, passes = _layers_beside_steps(tmp_path, slice_s=0.0)
    assert passes == 0
    assert all(s[0] >= end for s in steps), "a step ran before the forward ended"


def _gaps_while_forward_runs(steps, end):
    """The gaps between one step's end and the next step's start, while the forward ran."""
    during = [s for s in steps if s[1] < end]
    return [b[0] - a[1] for a, b in zip(during, during[1:])]


def test_an_offered_slack_is_how_long_the_forward_keeps_the_cpus(tmp_path):
    # 60 ms of slack: the forward keeps the CPUs about that long (handing over before a 10 ms
    # layer would overrun it), far longer than its 10 ms slice, and never past the slack plus
    # the handing over
    layers, steps, _, _, end, passes = _layers_beside_steps(
        tmp_path, slice_s=0.01, offer_ms=60.0, layers_n=40
    )
    gaps = _gaps_while_forward_runs(steps, end)
    assert passes >= 3 and len(gaps) >= 2
    # held ~50-60 ms, not the 10 ms slice (on a loaded machine a descheduled forward thread now
    # and then misses its turn and two steps run back to back: the median, not every gap)
    assert statistics.median(gaps) >= 0.035, gaps
    assert max(gaps) <= 0.060 + 0.060, gaps  # the slack, plus a hand-over's scheduling noise


def test_no_slack_hands_the_cpus_over_at_the_next_layer(tmp_path):
    layers, steps, _, _, end, passes = _layers_beside_steps(tmp_path, slice_s=0.5, offer_ms=0.0)
    gaps = _gaps_while_forward_runs(steps, end)
    assert passes >= 5  # the 500 ms slice gave way to the offer
    assert gaps and statistics.median(gaps) < 0.03, gaps  # a layer, not the slice


def test_offers_bind_only_while_fresh_and_the_shortest_wins(tmp_path):
    d = str(tmp_path)
    reader = CpuTurns("prefill-0", [0, 1], 2, "on", 1.0, lock_dir=d, slice_s=0.05)
    a = CpuTurns("decode-0", [0, 1], 2, "on", 1.0, lock_dir=d)
    b = CpuTurns("decode/1", [0, 1], 2, "on", 1.0, lock_dir=d)
    offered = []
    a.on_offer = offered.append
    assert reader.granted_ms() is None
    a.offer(80.0)
    b.offer(30.0)
    time.sleep(0.01)  # past the reader's 5 ms cache
    assert reader.granted_ms() == 30.0
    b.offer(None)  # withdrawn: the other's stands
    time.sleep(0.01)
    assert reader.granted_ms() == 80.0
    a.offer(80.4)  # under a millisecond's change: not written again
    assert offered == [80.0]
    # an offer left by a worker that died expires
    with open(a.offer_path, "w") as f:
        f.write(f"10.0 {time.monotonic() - 0.001:.6f}")
    time.sleep(0.01)
    assert reader.granted_ms() is None
    with open(a.offer_path, "w") as f:
        f.write("garbage")
    time.sleep(0.01)
    assert reader.granted_ms() is None  # unreadable: no offer, never an error


def test_held_seconds_count_each_workers_share_of_the_cpus(tmp_path):
    d = str(tmp_path)
    held = []
    w = CpuTurns("w", [0, 1], 2, "on", 1.0, lock_dir=d, on_held=held.append)
    with w.turn():
        time.sleep(0.03)
    with w.turn():
        time.sleep(0.01)
    assert len(held) == 2 and 0.025 <= held[0] < 0.2 and held[1] < held[0]
    assert w.held_s == pytest.approx(sum(held))
    off = CpuTurns("x", [0, 1], 2, "off", 1.0, lock_dir=d, on_held=held.append)
    with off.turn():
        pass
    assert len(held) == 2  # no turns taken, none counted


def test_a_slice_is_never_negative(tmp_path):
    with pytest.raises(ValueError, match="slice"):
        CpuTurns("w", [0, 1], 2, "on", 1.0, lock_dir=str(tmp_path), slice_s=-0.01)
    with pytest.raises(ValueError, match="cpu_turn_slice_ms"):
        DecodeConfig(cpu_turn_slice_ms=-1)


def test_without_its_wait_file_a_worker_still_takes_turns_and_says_so_once(tmp_path, caplog):
    turns = CpuTurns("decode-0", [0, 1], 2, "on", 0.2, lock_dir=str(tmp_path), slice_s=0.01)
    os.mkdir(turns.wait_path)  # cannot be opened as a file
    other = CpuTurns("prefill-0", [0, 1], 2, "on", 0.2, lock_dir=str(tmp_path), slice_s=0.01)
    with caplog.at_level("WARNING", logger="servekit.cpus"):
        for _ in range(3):
            with turns.turn():
                time.sleep(0.02)
                assert turns.share() == 0.0  # nobody can say they wait: the turn is kept
                with other.turn():  # exclusion still holds: the other times out, counted
                    pass
    assert other.timeouts == 3 and turns.passes == 0
    said = [r for r in caplog.records if "turns at the CPUs are taken as they come" in r.message]
    assert len(said) == 2  # once each


def test_the_pace_fraction_is_a_fraction():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"DecodeConfig.tbt_pace_fraction"):
            DecodeConfig(tbt_pace_fraction=bad)
    assert DecodeConfig(tbt_pace_fraction=1.0).tbt_pace_fraction == 1.0


def test_a_decode_worker_offers_what_its_tightest_objective_leaves():
    # 100 ms objective, 80% of it for the step and the wait, a 20 ms step: 60 ms for the prefill
    assert decode_slack_ms([100.0, 250.0], 20.0, 0.8) == pytest.approx(60.0)
    assert decode_slack_ms([0.0, 250.0], 20.0, 0.8) == pytest.approx(180.0)  # 0 = none
    assert decode_slack_ms([100.0], 95.0, 0.8) == 0.0  # the step takes it all: the next layer
    assert decode_slack_ms([], 20.0, 0.8) is None  # no stream
    assert decode_slack_ms([0.0, 0.0], 20.0, 0.8) is None  # no objective: the slice stands
