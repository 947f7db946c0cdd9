"""Hosts on one machine, kept apart by the kernel: each host is a network namespace with its own IP
on a private bridge, its own hostname (UTS namespace) and its own /dev/shm (a tmpfs in its own
mount namespace), so two hosts share no memory and no loopback address. The link between a host
and the bridge can be shaped with `tc` (a tbf rate, a netem delay where the kernel has netem).

`with Hosts(["head", "hostb"]) as hosts: hosts.popen(hosts["hostb"], argv)` - everything made
(processes in the namespaces, veths, the bridge, the namespaces) is removed on exit, also when the
body raises. Needs root and `ip netns`; `netns_problem()` says why not, for a test to skip on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import NamedTuple

log = logging.getLogger("halfmoon.netns")

# private /24s the bridge may take, tried in turn from one picked by the pid (10.231.0.0/16)
SUBNET_PREFIX = "10.231"
SHM_BYTES = 1 << 30  # each host's /dev/shm (store slabs and Ray's object store live there)


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip netns`, no permission)."""


class Host(NamedTuple):
    """One host: the namespaces its processes run in and the link it reaches the others by."""

    name: str  # its hostname
    netns: str  # its network namespace (`ip netns` name)
    ip: str  # its address on the bridge
    veth: str  # the root namespace's end of its link (shaped for traffic towards it)
    peer: str  # its own end of the link, inside the namespace (shaped for traffic from it)
    anchor_pid: int  # a process that holds its mount and UTS namespaces; others join them


class LinkShape(NamedTuple):
    """What a host's link was shaped to (0 = not limited / no delay)."""

    rate_gbit: float
    delay_ms: float


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_problem() -> str:
    """Why hosts cannot be made here ("" = they can): not root, no `ip`, or `ip netns` refused."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths and tc)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"hm-probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return ""


def _used_subnets() -> set[str]:
    """The first three octets of every IPv4 address and route here, so the bridge takes a free
    /24."""
    out = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route"]).stdout
    used = set()
    for word in out.split():
        head = word.split("/")[0]
        try:
            ipaddress.IPv4Address(head)
        except ValueError:
            continue
        used.add(head.rsplit(".", 1)[0])
    return used


def remove_stale(log_to: logging.Logger = log) -> list[str]:
    """Remove the namespaces and bridges of earlier runs whose process is gone (a run killed by
    SIGKILL never cleans up); only names this module makes (`hm<pid>...`) are looked at."""
    removed = []

    def owner_gone(name: str) -> bool:
        digits = name[2:].split("-", 1)[0].removesuffix("br")
        if not (name.startswith("hm") and digits.isdigit()):
            return False
        return not os.path.exists(f"/proc/{digits}")

    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name and owner_gone(name):
            for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for line in _run(
        ["ip", "-o", "link", "show", "type", "bridge"], check=False
    ).stdout.splitlines():
        name = line.split(":")[1].strip() if ":" in line else ""
        if name and owner_gone(name):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    if removed:
        log_to.warning("removed hosts left by dead runs: %s", ", ".join(removed))
    return removed


class Hosts:
    """Hosts named `names` on one bridge; `hosts[name]` is a `Host`. Names are hostnames, so they
    must be distinct and valid ones."""

    def __init__(self, names: Sequence[str], tag: str = "", shm_bytes: int = SHM_BYTES):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"Hosts: names must be distinct and non-empty, got {list(names)}")
        if len(names) > 250:
            raise ValueError("Hosts: at most 250 hosts on one /24")
        self.names = list(names)
        self.tag = tag or f"hm{os.getpid()}"  # unique per process: parallel runs never collide
        if len(self.tag) > 10:
            raise ValueError(f"Hosts: tag {self.tag!r} longer than 10 characters (link names)")
        self.shm_bytes = shm_bytes
        self.bridge = f"{self.tag}br"
        self.subnet = ""
        self.hosts: dict[str, Host] = {}
        self.fallbacks = 0  # shaping asked for but not applied (no netem): logged and counted
        self._anchors: list[subprocess.Popen] = []
        self._bridge_made = False

    # ------------------------------------------------------------------ make

    def start(self) -> Hosts:
        problem = netns_problem()
        if problem:
            raise NetnsUnavailable(problem)
        remove_stale()
        try:
            self._make_bridge()
            for i, name in enumerate(self.names):
                self.hosts[name] = self._make_host(i, name)
        except BaseException:
            self.close()
            raise
        return self

    def _make_bridge(self) -> None:
        used = _used_subnets()
        start = os.getpid() % 200 + 20
        for k in range(256):
            third = (start + k) % 256
            candidate = f"{SUBNET_PREFIX}.{third}"
            if candidate not in used:
                self.subnet = candidate
                break
        else:
            raise RuntimeError(f"no free /24 in {SUBNET_PREFIX}.0.0/16")
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._bridge_made = True
        _run(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

    def _make_host(self, i: int, name: str) -> Host:
        netns = f"{self.tag}-{name}"
        veth, peer = f"{self.tag}-{i}r", f"{self.tag}-{i}h"
        ip = f"{self.subnet}.{i + 2}"
        _run(["ip", "netns", "add", netns])
        # registered before it is complete, so close() removes whatever part of it exists
        self.hosts[name] = Host(name, netns, ip, veth, peer, 0)
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", netns])
        _run(["ip", "link", "set", veth, "master", self.bridge])
        _run(["ip", "link", "set", veth, "up"])
        _run(["ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", peer])
        _run(["ip", "-n", netns, "link", "set", peer, "up"])
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        # The anchor owns the host's mount and UTS namespaces (a private /dev/shm, its hostname);
        # every process of the host joins them with nsenter, so they all see one /dev/shm.
        setup = (
            f"mount -t tmpfs -o size={self.shm_bytes} tmpfs /dev/shm && hostname {name} "
            "&& exec sleep infinity"
        )
        anchor = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation",
             "private", "sh", "-c", setup],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        self._anchors.append(anchor)
        deadline = time.monotonic() + 10
        while not _is_sleeping(anchor.pid):
            if anchor.poll() is not None:
                err = anchor.stderr.read().decode(errors="replace").strip()
                raise RuntimeError(f"host {name}: namespace set-up failed: {err}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {name}: namespace set-up did not finish in 10 s")
            time.sleep(0.02)
        host = Host(name, netns, ip, veth, peer, anchor.pid)
        self.hosts[name] = host
        return host

    # ------------------------------------------------------------------ use

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def enter(self, host: Host) -> list[str]:
        """The argv prefix that runs a command on `host` (its network, mount and UTS namespaces)."""
        return ["nsenter", "-t", str(host.anchor_pid), "-n", "-m", "-u", "--"]

    def popen(self, host: Host, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start `argv` on `host`; Popen's keyword arguments pass through."""
        return subprocess.Popen(self.enter(host) + list(argv), **kw)

    def run(
        self, host: Host, argv: Sequence[str], timeout: float = 120, env: dict | None = None
    ) -> str:
        """Run `argv` on `host` to completion; its stdout, or an error naming the command."""
        proc = subprocess.run(
            self.enter(host) + list(argv), capture_output=True, text=True, timeout=timeout, env=env
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise RuntimeError(
                f"on {host.name}: {' '.join(argv)} failed ({proc.returncode}):\n{tail}"
            )
        return proc.stdout

    def shape(
        self, host: Host, rate_gbit: float = 0.0, delay_ms: float = 0.0, direction: str = "both"
    ) -> LinkShape:
        """Shape `host`'s link: at most `rate_gbit` (tbf) after `delay_ms` (netem); 0 and 0 =
        unshaped. `direction`: "both", "out" (what the host sends: its side of the link) or "in"
        (what it receives); the other way is left unshaped. A kernel without netem gets the rate
        alone (logged, counted)."""
        if rate_gbit < 0 or delay_ms < 0:
            raise ValueError(
                f"shape: rate_gbit and delay_ms must be >= 0, got {rate_gbit}, {delay_ms}"
            )
        ends = {"in": [(None, host.veth)], "out": [(host.netns, host.peer)]}
        if direction not in (*ends, "both"):
            raise ValueError(f"shape: direction must be both, in or out, got {direction!r}")
        shaped = ends["in"] + ends["out"] if direction == "both" else ends[direction]
        applied = LinkShape(0.0, 0.0)
        for where, dev in ends["in"] + ends["out"]:
            ns = ["-n", where] if where else []
            _run(["tc", *ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if (not rate_gbit and not delay_ms) or (where, dev) not in shaped:
                continue
            parent = ["root"]
            if delay_ms:
                made = _run(
                    ["tc", *ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                     "delay", f"{delay_ms}ms"],
                    check=False,
                )  # fmt: skip
                if made.returncode == 0:
                    parent = ["parent", "1:"]
                    applied = applied._replace(delay_ms=delay_ms)
                else:
                    self.fallbacks += 1
                    if self.fallbacks == 1:  # counted every time, said once
                        log.warning(
                            "no %.1f ms delay on %s's link (netem: %s): the rate alone is "
                            "shaped, here and on every link after it",
                            delay_ms, host.name, made.stderr.strip(),
                        )  # fmt: skip
            if rate_gbit:
                # 256 KB of burst at 1 Gbit/s and up (about 2 ms of the rate); less on a thin
                # link, where 256 KB would cross at line rate and hide the limit
                burst = min(256 << 10, max(32 << 10, int(rate_gbit * 1e9 / 8 * 0.002)))
                _run(
                    ["tc", *ns, "qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf",
                     "rate", f"{rate_gbit * 1000:g}mbit", "burst", str(burst),
                     "latency", "50ms"]
                )  # fmt: skip
                applied = applied._replace(rate_gbit=rate_gbit)
        return applied

    def pids(self, host: Host) -> list[int]:
        """Every process in `host`'s network namespace (the anchor included)."""
        out = _run(["ip", "netns", "pids", host.netns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill(self, host: Host, keep_anchor: bool = True, timeout_s: float = 10.0) -> int:
        """SIGKILL every process on `host` (a host losing power), until none is left; with
        `keep_anchor` its namespaces stay, so the host can be started again. Returns how many."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            left = [p for p in self.pids(host) if not (keep_anchor and p == host.anchor_pid)]
            if not left:
                return len(killed)
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {host.name}: processes {left} survive SIGKILL")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    # ------------------------------------------------------------------ remove

    def close(self) -> None:
        """Kill every process on every host, then delete the links, the bridge and the namespaces;
        each step goes on whatever the one before did. The tmpfs of a host goes with its last
        process (its mount namespace dies with it)."""
        for host in list(self.hosts.values()):
            try:
                self.kill(host, keep_anchor=False)
            except Exception as e:  # noqa: BLE001 - clean-up goes on
                log.warning("host %s: %s", host.name, e)
        for anchor in self._anchors:
            try:
                anchor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                anchor.kill()
        self._anchors.clear()
        for host in list(self.hosts.values()):
            _run(["ip", "link", "del", host.veth], check=False)  # deletes its peer too
            _run(["ip", "netns", "del", host.netns], check=False)
        self.hosts.clear()
        if self._bridge_made:
            _run(["ip", "link", "del", self.bridge], check=False)
            self._bridge_made = False

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _is_sleeping(pid: int) -> bool:
    """Whether `pid` has reached the anchor's final exec (its namespaces are set up)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "sleep"
    except OSError:
        return False
