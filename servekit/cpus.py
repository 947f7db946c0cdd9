"""Which CPUs a worker's process runs on, and how many torch threads it then uses."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import threading
import time

log = logging.getLogger(__name__)


def parse_cpu_list(name: str, text: str | int) -> list[int]:
    """CPU ids from a list like "0-3,6" (as taskset and cgroups write them; a YAML scalar 2 is
    CPU 2); [] for "". A ValueError names the field and what is wrong."""
    cpus: set[int] = set()
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ValueError(f"{name}: {part!r} is not a CPU id or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"{name}: {part!r} is not a range of CPU ids")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def pin_process(name: str, cpus_text: str, torch_threads: int) -> int:
    """Keep this process on the CPUs `cpus_text` names (all when ""), and return the torch
    threads it should use: `torch_threads`, or when that is 0 one per core it may run on (the
    pinned CPUs, else its affinity; one per physical core where the CPUs are hyperthreads, as
    torch's own default). Never torch's default as this process found it: Ray starts its actors
    with OMP_NUM_THREADS=1. A CPU this machine does not offer is a ValueError."""
    cpus = parse_cpu_list(name, cpus_text)
    if not cpus:
        return torch_threads or _cores(len(os.sched_getaffinity(0)))
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"{name}: CPUs {missing} are not available here (have {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    log.info("%s: pinned to CPUs %s", name, cpus)
    return torch_threads or len(cpus)


def _cores(cpus: int) -> int:
    """Of `cpus` logical CPUs, as many as there are physical cores behind them (the machine's
    ratio of logical to physical CPUs; at least one)."""
    import psutil

    logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    if not logical or not physical:
        return max(1, cpus)
    return max(1, cpus * physical // logical)


def set_omp_spin_count(count: int) -> str:
    """Set GOMP_SPINCOUNT in this process's environment for the server processes it starts
    (their OpenMP runtime reads it as it loads: this process's own is not changed), unless it is
    set already or `count` is 0. The value they get ("" = libgomp's default)."""
    if count > 0:
        os.environ.setdefault("GOMP_SPINCOUNT", str(count))
    return os.environ.get("GOMP_SPINCOUNT", "")


CPU_TURN_MODES = ("auto", "on", "off")
# An offered slack stands this long unless renewed: a worker that died or went idle without
# withdrawing it binds nobody for longer.
OFFER_TTL_S = 2.0


def check_cpu_turns(owner: str, config) -> None:
    """ValueError naming the field unless `config.cpu_turns` is a mode, its timeout positive and
    its slice not negative."""
    if config.cpu_turns not in CPU_TURN_MODES:
        raise ValueError(f"{owner}.cpu_turns: 'auto', 'on' or 'off', not {config.cpu_turns!r}")
    if config.cpu_turn_timeout_s <= 0:
        raise ValueError(f"{owner}.cpu_turn_timeout_s must be positive")
    if config.cpu_turn_slice_ms < 0:
        raise ValueError(f"{owner}.cpu_turn_slice_ms must be 0 (never hand a turn over) or more")


class CpuTurns:
    """Forwards of the workers on one host that share CPUs, taken one at a time.

    A prefill and a decode worker that each run as many OpenMP threads as the host has cores
    would, computing at once, put twice the threads on the cores: every parallel region's
    barrier then waits for a descheduled thread, and both forwards run several times slower than
    one after the other (a burst of 16 streams on a 2-core host: decode steps of 95 ms instead of
    38). So each forward holds a lock on a file in /dev/shm named by the CPU set (an flock: the
    kernel drops it with the process that held it). A holder that hangs must not stop the host:
    past `timeout_s` a forward runs without its turn, counted and logged.

    A worker waiting for its turn says so with a shared lock on a second file beside it (the
    kernel drops that too with the process). Two things follow from it:
    - a long forward hands the CPUs over mid-way (`share`, between layers) once it has held them
      `slice_s`: a prefill of 1,024 tokens took ~700 ms on 2 cores, and every decode stream on
      the host waited that long for its next token;
    - a worker whose turn just ended lets a waiting one go first, so that a decode worker stepping
      back to back does not take every turn from a prefill that polls for it.

    How long a forward keeps the CPUs while another waits is the objectives' call: a decode worker
    `offer`s the slack its streams have under their TBT objective (a file beside the lock, with an
    expiry), and a forward sharing its turn keeps the CPUs that long, handing them over before a
    layer would overrun it. So the decode steps take what their objective needs and the prefill
    the rest; where no worker offers one, `slice_s` stands. Either worker has every core while
    the other is idle (nobody waits).
    """

    def __init__(self, name: str, cpus: list[int], threads: int, mode: str, timeout_s: float,
                 lock_dir: str = "/dev/shm", on_timeout=None, slice_s: float = 0.0,
                 on_pass=None, on_held=None, on_offer=None):  # fmt: skip
        if mode not in CPU_TURN_MODES:
            raise ValueError(f"{name}: cpu_turns is 'auto', 'on' or 'off', not {mode!r}")
        if slice_s < 0:
            raise ValueError(f"{name}: a turn's slice must be 0 (never shared) or positive")
        cpus = cpus or sorted(os.sched_getaffinity(0))
        # auto: when two such workers would put more threads than CPUs on them
        on = mode == "on" or (mode == "auto" and 2 * max(threads, 1) > len(cpus))
        self.name, self.timeout_s, self.on_timeout = name, timeout_s, on_timeout
        self.slice_s, self.on_pass = slice_s, on_pass
        self.path = f"{lock_dir}/halfmoon-cpus-{_cpu_set_name(cpus)}.lock" if on else ""
        self.wait_path = self.path[: -len(".lock")] + ".wait" if on else ""
        stem = self.path[: -len(".lock")]
        # this worker's offered slack, and the pattern of every worker's on these CPUs
        self.offer_path = f"{stem}.slack.{_file_part(name)}" if on else ""
        self._offers_glob = f"{stem}.slack.*"
        self.on_held, self.on_offer = on_held, on_offer  # seconds a turn was held; slack offered
        self.held_s = 0.0  # seconds this worker held turns in all
        self._offered: float | None = None  # the slack (ms) this worker offers now
        self._offered_at = 0.0
        self._granted: tuple[float, float | None] = (-1.0, None)  # (read at, shortest slack ms)
        self.timeouts = 0  # forwards that ran without their turn
        self.passes = 0  # turns handed to a waiting worker mid-forward (`share`)
        self._stuck = False  # the last turn was not had: the holder may be hung
        self._wait_file_failed = False  # the wait file could not be used (logged once)
        # per thread: the lock file of the turn it holds, and when it was had
        self._mine = threading.local()

    @contextlib.contextmanager
    def turn(self):
        """Hold this worker's turn at the CPUs for the duration (at once where turns are off);
        gives the seconds waited for it (a forward's time model leaves them out)."""
        t0 = time.perf_counter()
        if self.path and self._others_wait():
            self._let_waiters_in()
        self._take()
        try:
            yield time.perf_counter() - t0
        finally:
            self._drop()

    def _take(self) -> None:
        self._mine.held = self._acquire()
        self._mine.since = self._mine.mark = time.monotonic()

    def _drop(self) -> None:
        """Give the turn up (closing the file drops the lock), its time counted."""
        held, self._mine.held = self._mine.held, None
        if held is not None:
            held.close()
            seconds = time.monotonic() - self._mine.since
            self.held_s += seconds
            if self.on_held is not None:
                self.on_held(seconds)

    def share(self) -> float:
        """Inside a turn, at a point where the forward may pause (between layers): once the
        turn has been held as long as the host's decode workers offer (`slice_s` where none
        does), hand the CPUs to a worker waiting for them and take them back after its forward.
        The seconds spent without them (0.0 where it kept them)."""
        if getattr(self._mine, "held", None) is None or not self.slice_s:
            return 0.0
        now = time.monotonic()
        layer_s, self._mine.mark = now - self._mine.mark, now
        granted_ms = self.granted_ms()
        if granted_ms is None:
            keep_s, ahead_s = self.slice_s, 0.0
        else:  # an offer is a bound: hand over before the next layer (as long as the last) ends
            keep_s, ahead_s = granted_ms / 1000.0, layer_s
        if now - self._mine.since + ahead_s < keep_s or not self._others_wait():
            return 0.0
        t0 = time.perf_counter()
        self._drop()
        self._let_waiters_in()
        self._take()
        self.passes += 1
        if self.on_pass is not None:
            self.on_pass()
        return time.perf_counter() - t0

    def offer(self, slack_ms: float | None) -> None:
        """Say how long the host's other workers may keep the CPUs once this one waits for them
        (the slack its streams have under their objective; 0 = hand them over at the next
        layer), or None: it binds nobody (no stream of its own waits on a step). Written only
        when it changes by a millisecond or more, or half its expiry has passed."""
        if not self.offer_path:
            return
        now = time.monotonic()
        if slack_ms is None:
            if self._offered is not None:
                self._offered = None
                with contextlib.suppress(OSError):
                    os.unlink(self.offer_path)
                if self.on_offer is not None:
                    self.on_offer(-1.0)
            return
        slack_ms = max(0.0, float(slack_ms))
        fresh = now - self._offered_at < OFFER_TTL_S / 2
        if self._offered is not None and abs(slack_ms - self._offered) < 1.0 and fresh:
            return
        tmp = f"{self.offer_path}.tmp"  # not matched by the readers' pattern
        try:
            with open(tmp, "w") as f:
                f.write(f"{slack_ms:.3f} {now + OFFER_TTL_S:.6f}")
            os.replace(tmp, self.offer_path)  # readers see the old offer or the new, whole
        except OSError as exc:
            self._no_wait_file(exc)
            return
        self._offered, self._offered_at = slack_ms, now
        if self.on_offer is not None:
            self.on_offer(slack_ms)

    def granted_ms(self) -> float | None:
        """The shortest slack a worker on these CPUs offers now (ms), None when none does
        (CLOCK_MONOTONIC is one clock for every process: the expiries compare). Read at most
        every 5 ms: a forward asks between each pair of layers."""
        now = time.monotonic()
        read_at, granted = self._granted
        if now - read_at < 0.005:
            return granted
        granted = None
        for path in glob.glob(self._offers_glob):
            try:
                with open(path) as f:
                    slack_ms, until = (float(x) for x in f.read().split())
            except (OSError, ValueError):
                continue  # withdrawn while read, or not this format: no offer
            if until >= now:
                granted = slack_ms if granted is None else min(granted, slack_ms)
        self._granted = (now, granted)
        return granted

    def _others_wait(self) -> bool:
        """Whether a worker is waiting for a turn (holds the wait file shared)."""
        try:
            with open(self.wait_path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False  # (closing the file drops the probe's lock)
        except BlockingIOError:
            return True
        except OSError as exc:
            self._no_wait_file(exc)
            return False  # turns go as they come

    def _let_waiters_in(self) -> None:
        """Wait until the workers waiting for a turn have had it (at most 50 ms: one that gave
        up waiting, or died, keeps nobody out for longer)."""
        deadline = time.monotonic() + 0.05
        while self._others_wait() and time.monotonic() < deadline:
            time.sleep(0.0002)

    def _acquire(self):
        """The open lock file holding the turn; None when off or given up."""
        if not self.path:
            return None
        try:
            f = open(self.path, "a")  # an open file per turn: threads of one process exclude too
        except OSError as exc:
            self.timeouts += 1
            log.warning(
                "%s: cannot open %s (%s): computing without turns", self.name, self.path, exc
            )
            if self.on_timeout is not None:
                self.on_timeout()
            return None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._stuck = False
            return f
        except BlockingIOError:
            pass
        waiting = self._say_waiting()
        try:
            return self._wait_for(f)
        finally:
            if waiting is not None:
                waiting.close()

    def _say_waiting(self):
        """The wait file, held shared while this worker waits (None where it cannot be)."""
        try:
            w = open(self.wait_path, "a")
            fcntl.flock(w, fcntl.LOCK_SH)
            return w
        except OSError as exc:
            self._no_wait_file(exc)
            return None

    def _no_wait_file(self, exc: OSError) -> None:
        """Said once: without the wait file, turns are neither shared nor given way."""
        if not self._wait_file_failed:
            self._wait_file_failed = True
            log.warning(
                "%s: cannot use %s (%s): turns at the CPUs are taken as they come, never "
                "handed over mid-forward",
                self.name,
                self.wait_path,
                exc,
            )

    def _wait_for(self, f):
        # after a turn not had, one try each until the lock is seen free: a neighbour stuck
        # holding it costs one wait of timeout_s, not one per forward
        wait_s = 0.0 if self._stuck else self.timeout_s
        deadline, pause = time.monotonic() + wait_s, 0.0002
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._stuck = False
                return f
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self._stuck = True
                    f.close()
                    self.timeouts += 1
                    if wait_s:  # once per stuck spell; every skipped turn is counted
                        log.warning(
                            "%s: no turn at the CPUs after %.1f s (%s): computing without "
                            "turns until it is free again",
                            self.name,
                            self.timeout_s,
                            self.path,
                        )
                    if self.on_timeout is not None:
                        self.on_timeout()
                    return None
                # short naps: a holder between decode steps gives its turn up for ~1 ms
                time.sleep(pause)
                pause = min(pause * 2, 0.002)


def decode_slack_ms(
    tbt_objectives_ms: list[float], next_step_ms: float, fraction: float
) -> float | None:
    """What a decode worker offers a prefill on its CPUs (CpuTurns.offer): `fraction` of the
    shortest TBT objective among its streams, less its next step (0 when the step alone takes
    it: the prefill hands the CPUs over at its next layer); None when no stream has an objective
    (the prefill's own slice stands)."""
    objectives = [t for t in tbt_objectives_ms if t > 0]
    if not objectives:
        return None
    return max(0.0, min(objectives) * fraction - next_step_ms)


def _file_part(name: str) -> str:
    """A worker id as a file-name part (anything but letters, digits, - and _ becomes _)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _cpu_set_name(cpus: list[int]) -> str:
    """ "0-3,6" as a file-name part: 0-3_6."""
    runs, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            runs.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return "_".join(runs)


def cpu_turns(config, registry=None, device=None) -> CpuTurns:
    """The CpuTurns of a worker config (its `cpus`, `cpu_turns`, `cpu_turn_timeout_s` and
    `worker_id`; this process's torch threads), its turns shared after `cpu_turn_slice_ms`, with
    its skipped turns counted in `registry` as halfmoon_cpu_turn_timeouts_total and the turns it
    handed over mid-forward as halfmoon_cpu_turn_passes_total, the seconds it held turns as
    halfmoon_cpu_turn_held_seconds_total and the slack it offers as a gauge. A worker computing
    on a GPU takes no turns unless `on` says so: its forwards barely use the CPUs."""
    import torch
    from prometheus_client import Counter, Gauge

    name = config.worker_id
    counter = passes = held = offered = None
    if registry is not None:
        # rate() of it per worker is the host's CPU split over time
        held = Counter(
            "halfmoon_cpu_turn_held_seconds",
            "Seconds this worker held its turn at the shared CPUs (computing)",
            ["worker"],
            registry=registry,
        ).labels(name)
        offered = Gauge(
            "halfmoon_cpu_turn_offered_slack_ms",
            "How long this worker lets a neighbour keep the shared CPUs while it waits: its "
            "streams' slack under their TBT objective (-1 = it binds nobody)",
            ["worker"],
            registry=registry,
        ).labels(name)
        offered.set(-1.0)
        counter = Counter(
            "halfmoon_cpu_turn_timeouts",
            "Forwards that ran without their turn at the shared CPUs (a neighbour held it)",
            ["worker"],
            registry=registry,
        ).labels(name)
        passes = Counter(
            "halfmoon_cpu_turn_passes",
            "Turns at the shared CPUs handed to a waiting worker in the middle of a forward",
            ["worker"],
            registry=registry,
        ).labels(name)
    cpus = parse_cpu_list(f"{type(config).__name__}.cpus", config.cpus)
    mode = config.cpu_turns
    if mode == "auto" and device is not None and torch.device(device).type != "cpu":
        mode = "off"
    return CpuTurns(
        name,
        cpus,
        torch.get_num_threads(),
        mode,
        config.cpu_turn_timeout_s,
        on_timeout=counter.inc if counter is not None else None,
        slice_s=config.cpu_turn_slice_ms / 1000.0,
        on_pass=passes.inc if passes is not None else None,
        on_held=held.inc if held is not None else None,
        on_offer=offered.set if offered is not None else None,
    )
