"""`simulate --router-url` against servers that are not `pagedkv router serve` (issue 24 item 6):
an HTML page, another service's JSON, a server that accepts and never answers. Each ends in one
line on stderr and exit 2, never a traceback, and the silent one within its timeout."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pagedkv.cli import main
from pagedkv.errors import InvalidArgumentError
from pagedkv.router.client import NotARouterError, RouterClient
from pagedkv.sim.cluster.remote_router import check_health

ARGV = ["simulate", "--workload", "chat", "--num-requests", "4", "--capacity", "300",
        "--instances", "2", "--json"]  # fmt: skip


@contextmanager
def answering(body: bytes, content_type: str) -> Iterator[str]:
    """A real HTTP server on loopback answering every GET with `body`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_simulate(url: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main([*ARGV, "--router-url", url, *extra])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


def test_an_html_page_is_one_line_naming_what_answered(capsys):
    with answering(b"<!doctype html><html><body>It works</body></html>", "text/html") as url:
        code, err = run_simulate(url, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "Traceback" not in err and "text/html" in err and "not JSON" in err
    assert url in err and "pagedkv router serve" in err


@pytest.mark.parametrize(
    ("health", "named"),
    [
        ({"status": "ok"}, "has no 'instances'"),
        ([1, 2], "is list, not an object"),
        ({"instances": {"gpu0": {"endpoint": "tcp://x:1"}}, "block_size": 16,
          "hash_algorithm": "sha256", "index_available": True, "index_exact": True,
          "outages": 0, "recoveries": 0, "policy": "prefix-aware"},
         "without a valid 'replay_endpoint'"),
        ({"instances": {}, "block_size": "16"}, "has 'block_size' = '16', not int"),
    ],
)  # fmt: skip
def test_another_services_json_is_one_line_naming_the_field(capsys, health, named):
    with answering(json.dumps(health).encode(), "application/json") as url:
        code, err = run_simulate(url, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "Traceback" not in err and named in err and "is not `pagedkv router serve`" in err


def test_a_silent_server_times_out_within_the_timeout(capsys):
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog), never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        start = time.monotonic()
        code, err = run_simulate(url, capsys, "--router-timeout-s", "0.5")
        elapsed_s = time.monotonic() - start
    finally:
        listener.close()
    assert code == 2 and err.count("\n") == 1, err
    assert "no answer to GET /health within 0.5 s" in err and "Traceback" not in err
    # One wait, not one per retry (the simulation's own set-up is what else this includes).
    assert elapsed_s < 0.5 * 2


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), True])
def test_a_bad_timeout_is_refused_naming_it(timeout_s):
    with pytest.raises(InvalidArgumentError, match="router timeout must be > 0 seconds, got"):
        RouterClient("http://127.0.0.1:1", timeout_s)


def test_not_a_router_error_is_an_invalid_argument():
    assert issubclass(NotARouterError, InvalidArgumentError)
    assert check_health("u", _health()) == _health()


def _health() -> dict[str, object]:
    return {"instances": {"a": {"endpoint": "tcp://h:1", "replay_endpoint": None,
            "connected": True}}, "block_size": 16, "hash_algorithm": "sha256",
            "index_available": True, "index_exact": True, "outages": 0, "recoveries": 0,
            "policy": "prefix-aware"}  # fmt: skip
