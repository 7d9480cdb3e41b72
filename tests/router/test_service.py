"""`pagedkv router serve` as operators run it: the service is a subprocess on loopback, the
instances are real KVCacheManagers in their own processes publishing over ZeroMQ (one in
pagedkv's format, one as vLLM publishes: no snapshots, "full" report-mode re-sends), and the
test kills and restarts publishers and Redis by pid. Every score is checked against the
instances' real cache contents."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.paths import SRC_DIR
from tests.support.redis_server import RedisServer, free_port, import_redis

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from pagedkv import Request, make_request_block_hasher  # noqa: E402
from pagedkv.block import to_external_hash  # noqa: E402

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ALGORITHM = "sha256_cbor"  # the one vLLM instances can be scored with
BLOCK_SIZE = 4
HASHER = make_request_block_hasher(BLOCK_SIZE, ALGORITHM)
DEADLINE_S = 20.0


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(SRC_DIR)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Publisher:
    """An instance process (tests/support/router_publisher.py) on fixed ports, restartable."""

    def __init__(self, instance_id: str, fmt: str, host: str = "127.0.0.1") -> None:
        self.instance_id, self.format, self.host = instance_id, fmt, host
        self.pub_port, self.replay_port = free_port(), free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(SUPPORT / "router_publisher.py"), str(self.pub_port),
             str(self.replay_port), self.format, ALGORITHM,
             "[::1]" if self.host == "[::1]" else "*"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        assert json.loads(self.process.stdout.readline()) == {"ready": True}

    def ask(self, command: dict) -> dict:
        assert self.process is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def admit(self, tokens: list[int]) -> int:
        return self.ask({"op": "admit", "tokens": tokens})["seq"]

    def contents(self) -> tuple[set[int], int]:
        answer = self.ask({"op": "contents"})
        return {h for h, _ in answer["contents"]}, answer["next_seq"]

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=10)
            self.process = None

    @property
    def table(self) -> dict:
        return {
            "id": self.instance_id,
            "endpoint": f"tcp://{self.host}:{self.pub_port}",
            "replay_endpoint": f"tcp://{self.host}:{self.replay_port}",
            "format": self.format,
        }


class Service:
    def __init__(self, tmp_path: Path, publishers: list[Publisher], index: str = "memory"):
        lines = [f'block_size = {BLOCK_SIZE}', f'hash_algorithm = "{ALGORITHM}"',
                 f'index = "{index}"', "retry_interval_s = 0.2", "port = 0"]  # fmt: skip
        for publisher in publishers:
            lines.append("[[instances]]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in publisher.table.items()]
        config = tmp_path / "router.toml"
        config.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", "router", "serve", "--config", str(config)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        self.banner = self.process.stdout.readline()
        listening = self.process.stdout.readline()
        assert listening.startswith("listening on http://127.0.0.1:"), (
            listening + self.process.stderr.read()
        )
        self.url = listening.split()[-1]

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                raw, status = response.read().decode(), response.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read().decode(), exc.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw

    def wait_for(self, predicate, what: str) -> dict:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            _, health = self.call("/health")
            if predicate(health):
                return health
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {health}"
            time.sleep(0.05)

    def caught_up(self, publishers: list[Publisher]) -> dict:
        targets = {p.instance_id: p.contents()[1] - 1 for p in publishers if p.process}
        return self.wait_for(
            lambda h: all(h["instances"][i]["last_seq"] == s for i, s in targets.items()),
            f"sequence numbers {targets}",
        )

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def true_length(tokens: list[int], cached: set[int]) -> int:
    """Blocks an engine would reuse: its cached run, at most (len - 1) // block_size (vLLM
    computes the last prompt token again)."""
    depth = 0
    hashes = Request("q", tokens, block_hasher=HASHER).block_hashes
    for block_hash in hashes[: (len(tokens) - 1) // BLOCK_SIZE]:
        if to_external_hash(block_hash) not in cached:
            break
        depth += 1
    return depth


def assert_scores_match(service: Service, publishers: list[Publisher], prompts) -> None:
    truth = {p.instance_id: p.contents()[0] for p in publishers if p.process}
    for tokens in prompts:
        status, answer = service.call("/score", {"token_ids": tokens})
        assert status == 200, answer
        for instance_id, cached in truth.items():
            expected = true_length(tokens, cached)
            assert answer["scores"][instance_id]["blocks"] == expected, (instance_id, tokens)
            assert answer["scores"][instance_id]["tokens"] == expected * BLOCK_SIZE


def workload(seed: int, num_prompts: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    stems = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    return [
        rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(4, 14))]
        for _ in range(num_prompts)
    ]


@pytest.fixture
def publishers():
    started = [Publisher("p0", "pagedkv"), Publisher("v1", "vllm")]
    for publisher in started:
        publisher.start()
    yield started
    for publisher in started:
        publisher.stop()


def test_scores_routes_and_publisher_restarts(tmp_path, publishers):
    service = Service(tmp_path, publishers)
    try:
        assert "hashed with sha256_cbor at block size 4" in service.banner
        p0, v1 = publishers
        service.wait_for(lambda h: all(i["connected"] for i in h["instances"].values()), "links")
        prompts = workload(1)
        for n, tokens in enumerate(prompts):
            (p0 if n % 2 else v1).admit(tokens)  # 24 blocks each: older prompts are evicted
        v1.ask({"op": "resend", "tokens": prompts[-2]})  # vLLM "full" mode: a re-sent hit
        service.caught_up(publishers)
        assert_scores_match(service, publishers, prompts + workload(2, 4))
        ready_status, ready = service.call("/ready")
        assert ready_status == 200 and ready["index_exact"] is True

        # Prefix-aware routing: the instance holding the prompt's prefix, counted in flight.
        status, decision = service.call("/route", {"token_ids": prompts[-1] + [1, 2, 3]})
        assert status == 200 and not decision["fallback"]
        assert decision["instance"] == "p0" and decision["matched_blocks"] > 0
        status, released = service.call("/release", {"instance": "p0"})
        assert (status, released) == (200, {"instance": "p0", "in_flight": 0})

        # SIGKILL the pagedkv instance: at once not scored, not routed to; ready (v1 serves).
        p0.kill()
        health = service.wait_for(lambda h: h["instances"]["p0"]["down"], "p0 down")
        assert health["instances"]["p0"]["safe"] is False and health["ready"] is True
        for tokens in prompts:
            status, answer = service.call("/score", {"token_ids": tokens})
            assert answer["scores"]["p0"]["blocks"] == 0
            assert answer["scores"]["p0"]["excluded"] == "disconnected"
            _, decision = service.call("/route", {"token_ids": tokens, "loads": {}})
            assert decision["instance"] == "v1"
        p0.start()
        service.wait_for(lambda h: h["instances"]["p0"]["connected"], "p0 reconnected")
        for tokens in workload(3, 5):
            p0.admit(tokens)
        service.caught_up(publishers)
        assert_scores_match(service, publishers, prompts + workload(3, 5))

        # The vLLM-format instance restarts too: no snapshot, the stream starts again at 0.
        v1.kill()
        v1.start()
        for tokens in workload(4, 3):
            v1.admit(tokens)
        service.caught_up(publishers)
        assert_scores_match(service, publishers, prompts + workload(4, 3))
        _, health = service.call("/health")
        assert health["ready"] is True

        status, metrics = service.call("/metrics")
        assert status == 200
        for name in ("pagedkv_router_events_applied_total", "pagedkv_router_gaps_total",
                     "pagedkv_router_publisher_restarts_total",
                     "pagedkv_router_decisions_total", "pagedkv_router_fallback_decisions_total",
                     "pagedkv_router_index_hashes",
                     "pagedkv_router_score_seconds_bucket"):  # fmt: skip
            assert name in metrics, name
    finally:
        service.stop()


def test_redis_outage_falls_back_then_recovers_exactly(tmp_path, publishers):
    import_redis()
    redis = RedisServer(tmp_path)
    redis.start()
    service = Service(tmp_path, publishers, index=redis.url)
    try:
        p0, v1 = publishers
        service.wait_for(lambda h: all(i["connected"] for i in h["instances"].values()), "links")
        prompts = workload(5)
        for n, tokens in enumerate(prompts[:6]):
            (p0 if n % 2 else v1).admit(tokens)
        service.caught_up(publishers)
        assert_scores_match(service, publishers, prompts)

        redis.kill()
        for n, tokens in enumerate(prompts[6:]):  # events Redis misses, the router keeps
            (p0 if n % 2 else v1).admit(tokens)
        status, decision = service.call("/route", {"token_ids": prompts[-1], "loads": {}})
        assert status == 200 and decision["fallback"] is True, decision
        assert decision["policy"] == "least-loaded"
        assert service.call("/score", {"token_ids": prompts[0]})[0] == 503
        assert service.call("/ready")[0] == 503

        redis.start()  # empty: the router claims it and rebuilds it from its own copy
        health = service.wait_for(lambda h: h["recoveries"] == 1, "the recovery")
        # Both exact, the vLLM-format one too (it answers no snapshot: nothing was asked).
        assert health["instances"]["p0"]["exact"] is True
        assert health["instances"]["v1"]["exact"] is True and health["ready"] is True
        assert health["instances"]["v1"]["snapshots"] == 0
        service.caught_up(publishers)
        assert_scores_match(service, publishers, prompts)
    finally:
        service.stop()
        redis.stop()


def test_ipv6_endpoints_and_ready_only_once_every_instance_connected(tmp_path):
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    p0, v1 = Publisher("p0", "pagedkv", "[::1]"), Publisher("v1", "vllm", "[::1]")
    p0.start()
    service = Service(tmp_path, [p0, v1])  # v1 is not up yet
    try:
        health = service.wait_for(lambda h: h["instances"]["p0"]["connected"], "p0")
        assert service.call("/ready")[0] == 503
        assert health["instances"]["v1"]["down"] == "not connected yet"
        v1.start()
        service.wait_for(lambda h: h["ready"], "ready once v1 connected")
        prompts = workload(7)
        for n, tokens in enumerate(prompts):
            (p0 if n % 2 else v1).admit(tokens)
        service.caught_up([p0, v1])
        assert_scores_match(service, [p0, v1], prompts)
    finally:
        service.stop()
        p0.stop()
        v1.stop()


def test_bad_requests_and_bad_configuration_are_clear(tmp_path, publishers):
    service = Service(tmp_path, publishers[:1])
    try:
        assert service.call("/score", {"instances": ["p0"]}) == (
            400,
            {
                "error": "the body needs 'token_ids' (a list of ints) or 'text'",
                "field": "token_ids",
            },
        )
        status, answer = service.call("/release", {"instance": ["p0"]})  # the 500
        assert (status, answer["field"]) == (400, "instance")
        status, answer = service.call("/score", {"text": "hello"})
        assert status == 400 and "--tokenizer" in answer["error"]
        status, answer = service.call("/route", {"token_ids": [1, 2], "policy": "random"})
        assert status == 400 and "unknown policy" in answer["error"]
        status, answer = service.call("/release", {"instance": "nope"})
        assert status == 400 and "unknown instance" in answer["error"]
    finally:
        service.stop()
    bad = subprocess.run(
        [sys.executable, "-m", "pagedkv", "router", "serve", "--instance", "a=tcp://h:1",
         "--instance-format", "vllm"],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--hash-algorithm sha256_cbor" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "pagedkv", "router", "serve", "--instance", "a"],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "ID=ENDPOINT" in bad.stderr
    for endpoint in ("tcp://::1:5557", "tcp://[::1]:x", "udp://h:1"):
        bad = subprocess.run(
            [sys.executable, "-m", "pagedkv", "router", "serve", "--instance", f"a={endpoint}"],
            capture_output=True, text=True, env=child_env(), timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert repr(endpoint) in bad.stderr


def test_simulate_through_the_service_equals_the_in_process_router(tmp_path, capsys):
    """`simulate --router-url`: the simulated instances publish where the service listens and
    every decision waits for the batches published so far, so each policy's run equals the
    in-process router's (three runs: the service also sees the publishers restart)."""
    from pagedkv.cli import main

    pagedkv_instances = [Publisher("a", "pagedkv"), Publisher("b", "pagedkv")]  # ports only
    # Ties as the in-process router breaks them (first listed), so the runs can be equal.
    lines = ["port = 0", "retry_interval_s = 0.2", 'tie_break = "first"']
    for publisher in pagedkv_instances:
        lines.append("[[instances]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in publisher.table.items()]
    (tmp_path / "sim.toml").write_text("\n".join(lines) + "\n")
    service = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", "router", "serve", "--config",
         str(tmp_path / "sim.toml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    try:
        service.stdout.readline()
        url = service.stdout.readline().split()[-1]
        argv = ["simulate", "--workload", "chat", "--num-requests", "24", "--rate", "4",
                "--capacity", "300", "--instances", "2", "--router", "all", "--json"]  # fmt: skip
        assert main([*argv, "--router-url", url]) == 0
        remote = json.loads(capsys.readouterr().out)
        assert main(argv) == 0
        local = json.loads(capsys.readouterr().out)
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=10)
    assert service.returncode == 0
    assert [r["router"] for r in remote["results"]] == ["round-robin", "least-loaded",
                                                       "prefix-aware"]  # fmt: skip
    for theirs, ours in zip(remote["results"], local["results"], strict=True):
        assert theirs["routing"]["index"] == "service" and theirs["routing"]["router_url"] == url
        assert theirs["routing"]["fallback_decisions"] == 0
        for key in ("prefix_cache", "load_balance", "ttft_s", "num_requests_completed"):
            assert theirs[key] == ours[key], key
        assert theirs["routing"]["mean_matched_blocks"] == ours["routing"]["mean_matched_blocks"]
    assert remote["results"][2]["routing"]["mean_matched_blocks"] > 0
