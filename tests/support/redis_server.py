"""Test helper: a private redis-server on a free loopback port, in a temp dir, no persistence,
started, stopped, killed, paused and resumed by pid.

Tests that use it skip (with the reason) when the `redis-server` binary or redis-py is missing,
unless PAGEDKV_REQUIRE_REDIS=1 (CI), where a missing server fails them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            require_redis()
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: the server dies at once, its data with it (no persistence)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered until `resume`."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.resume()  # a stopped process cannot act on SIGTERM
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


def require_redis() -> None:
    """Fail (not skip) the calling test when PAGEDKV_REQUIRE_REDIS=1."""
    if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
        pytest.fail("PAGEDKV_REQUIRE_REDIS=1 but redis-server or redis-py is missing")


def import_redis():
    try:
        import redis
    except ImportError:
        require_redis()
        pytest.skip(
            "redis-py is not installed (pip install 'pagedkv[router]')", allow_module_level=True
        )
    return redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    import_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
