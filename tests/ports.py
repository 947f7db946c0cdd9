"""Free TCP ports for tests that must name a port before a server binds it."""

import random
import socket


def free_port_run(n: int) -> int:
    """A port p with p..p+n-1 all free on 127.0.0.1 now, below the kernel's ephemeral range.

    A port found by binding port 0 lies in the ephemeral range, so a server the test starts
    next on port 0 (a store, a worker, Redis) may be handed the same one before the test binds
    it (seen in CI as "Address already in use"). Ports below that range are never handed out.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, low - 8000), low - n)
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports below the ephemeral range ({low})")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
