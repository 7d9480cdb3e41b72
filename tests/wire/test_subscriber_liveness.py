"""The subscriber against real sockets: IPv6 and hostname endpoints (connected, never bound),
bad endpoints as one clear error, a stopped publisher dropped by ZMTP heartbeats and resumed
without a restart, and a replay that keeps up (a progress deadline per batch, one replay for a
whole stall)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv import BlockStored, InvalidArgumentError  # noqa: E402
from pagedkv.wire.transport import ZmqEventPublisher, ZmqEventSubscriber  # noqa: E402
from tests.support.paths import SRC_DIR  # noqa: E402
from tests.support.redis_server import free_port  # noqa: E402

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def poll_until(subscriber: ZmqEventSubscriber, until, timeout_s: float = 20.0) -> list:
    received: list = []
    deadline = time.monotonic() + timeout_s
    while not until(received):
        assert time.monotonic() < deadline, f"timed out; got {[r.seq for r in received]}"
        received.extend(subscriber.poll(0.02))
    return received


def event(n: int) -> list:
    return [BlockStored([n], None, [], 4, None, "GPU", group_idx=0)]


@pytest.mark.parametrize("host", ["[::1]", "localhost"])
def test_ipv6_and_hostname_endpoints_are_connected_to(host):
    if host == "[::1]" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    bind_host = "[::1]" if host == "[::1]" else "127.0.0.1"
    port, replay_port = free_port(), free_port()
    with ZmqEventPublisher(
        f"tcp://{bind_host}:{port}", f"tcp://{bind_host}:{replay_port}", bind=True
    ) as publisher:
        for n in range(3):
            publisher.publish(event(n))
        time.sleep(0.1)  # sent before anyone subscribed: gone from PUB
        with ZmqEventSubscriber(f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}") as sub:
            got = poll_until(sub, lambda _: sub.connected)
            publisher.publish(event(3))
            got += poll_until(sub, lambda r: r and r[-1].seq == 3)
            # Joined late: 0..2 (and 3, in the same answer) came by replay over the same kind
            # of endpoint; the live copy of 3 was a duplicate.
            assert [r.seq for r in got] == [0, 1, 2, 3] and sub.num_replayed == 4


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://[::1:5557", "tcp://::1:5557", "tcp://host", "tcp://host:99999", "udp://h:1", ""],
)
def test_a_bad_endpoint_is_one_clear_error(endpoint):
    with pytest.raises(InvalidArgumentError) as caught:
        ZmqEventSubscriber(endpoint)
    assert repr(endpoint) in str(caught.value) and "\n" not in str(caught.value)


def test_a_host_that_does_not_resolve_is_one_warning_and_stays_disconnected(caplog):
    with caplog.at_level("WARNING", logger="pagedkv.wire.subscriber"):
        with ZmqEventSubscriber("tcp://no-such-host.invalid:1") as sub:
            assert sub.poll(0.05) == [] and sub.connected is False
    [record] = caplog.records
    assert "'tcp://no-such-host.invalid:1'" in record.getMessage()
    assert "does not resolve" in record.getMessage()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_a_stopped_publisher_is_dropped_by_heartbeats_and_resumes_without_a_restart():
    port, replay_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, str(SUPPORT / "router_publisher.py"), str(port), str(replay_port),
         "vllm", "sha256_cbor"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip

    def admit(tokens: list[int]) -> int:
        process.stdin.write(json.dumps({"op": "admit", "tokens": tokens}) + "\n")
        process.stdin.flush()
        return json.loads(process.stdout.readline())["seq"]

    try:
        assert json.loads(process.stdout.readline()) == {"ready": True}
        sub = ZmqEventSubscriber(
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", stale_after_s=0.5
        )
        with sub:
            poll_until(sub, lambda _: sub.connected)
            seq = admit(list(range(8)))
            poll_until(sub, lambda r: r and r[-1].seq == seq)
            process.send_signal(signal.SIGSTOP)  # alive, its TCP connection open, silent
            poll_until(sub, lambda _: sub.connected is False, timeout_s=20)
            assert sub.suspect_restart
            process.send_signal(signal.SIGCONT)
            poll_until(sub, lambda _: sub.connected and not sub.suspect_restart, timeout_s=20)
            seq = admit(list(range(100, 108)))
            got = poll_until(sub, lambda r: r and r[-1].seq == seq)
            assert [r.seq for r in got] == [seq] and sub.num_restarts == 0
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


def test_a_long_replay_is_read_whole_and_one_replay_covers_a_stall():
    port, replay_port = free_port(), free_port()
    with ZmqEventPublisher(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", bind=True, hwm=32
    ) as publisher:
        sub = ZmqEventSubscriber(
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", replay_timeout_s=1.0
        )
        with sub:
            sub._sub.setsockopt(zmq.RCVHWM, 32)  # noqa: SLF001 - a small queue, as vLLM's HWM
            poll_until(sub, lambda _: sub.connected)
            num_batches = 4000
            for n in range(num_batches):  # a stall: nobody reads while 4,000 batches go out
                publisher.publish(event(n))
            deadline = time.monotonic() + 10
            while publisher.sent_batches < num_batches:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            got = poll_until(sub, lambda r: r and r[-1].seq == num_batches - 1)
            assert [r.seq for r in got] == list(range(num_batches))
            # One gap, one replay answer of thousands of batches (longer than 1 s would be fine:
            # the deadline is per batch), the rest of the live queue skipped as duplicates.
            assert sub.num_lost == 0, (sub.num_gaps, sub.num_replayed, sub.num_duplicates)
            assert sub.num_gaps == 1, (
                sub.num_gaps,
                sub.num_replayed,
                sub.num_duplicates,
                sub.num_received,
            )
            assert sub.num_replayed > num_batches - 200


@pytest.mark.parametrize("buffer_steps", [100, 5000])
def test_a_lost_tail_is_found_by_check_tail_without_another_batch(buffer_steps):
    # PUB/SUB drops what passes the pipe's HWM without a trace; when the publisher then goes
    # quiet no later batch reveals the gap. inproc makes the pipe's capacity exact.
    context = zmq.Context()
    try:
        with ZmqEventPublisher(
            "inproc://tail", "inproc://tail-replay", bind=True, hwm=4,
            buffer_steps=buffer_steps, context=context,
        ) as publisher:  # fmt: skip
            sub = ZmqEventSubscriber("inproc://tail", "inproc://tail-replay", context=context)
            with sub:
                assert sub.check_tail() == []  # nothing published: nothing behind
                publisher.publish(event(0))
                poll_until(sub, lambda r: r and r[-1].seq == 0)
                num_batches = 2000
                for n in range(1, num_batches):  # nobody reads: the pipe fills, the rest drops
                    publisher.publish(event(n))
                deadline = time.monotonic() + 10
                while publisher.sent_batches < num_batches:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                live = []
                while batch := sub.poll(0.05):
                    live.extend(batch)
                last = live[-1].seq
                assert [r.seq for r in live] == list(range(1, last + 1))  # no gap to see
                assert last < num_batches - 1 and sub.num_lost == 0

                tail = sub.check_tail()
                oldest = num_batches - buffer_steps
                first = max(last + 1, oldest)
                assert [r.seq for r in tail] == list(range(first, num_batches))
                assert tail[0].num_lost_before == max(0, oldest - (last + 1))
                assert sub.num_lost == max(0, oldest - (last + 1))
                assert [e.block_hashes for r in tail for e in r.batch.events] == [
                    [n] for n in range(first, num_batches)
                ]
                assert sub.check_tail() == [] and sub.num_tail_checks_behind == 1
                publisher.publish(event(num_batches))  # the live stream goes on from there
                got = poll_until(sub, lambda r: r and r[-1].seq == num_batches)
                assert [r.seq for r in got] == [num_batches] and got[0].num_lost_before == 0
    finally:
        context.destroy(linger=0)


def test_check_tail_asks_nothing_without_a_replay_endpoint_or_while_disconnected():
    port = free_port()
    with ZmqEventPublisher(f"tcp://127.0.0.1:{port}", bind=True) as publisher:
        sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{port}")
        with sub:
            poll_until(sub, lambda _: sub.connected)
            publisher.publish(event(0))
            assert sub.check_tail() == [] and publisher.replay_requests == 0
    lonely = ZmqEventSubscriber(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    with lonely:
        assert lonely.connected is False
        assert lonely.check_tail() == [] and lonely.num_tail_unanswered == 0


def test_a_live_backlog_older_than_the_replay_buffer_is_not_applied():
    # After a stall the live queue still holds old batches, PUB dropped the ones after them,
    # and newer ones follow; when the gap shows, the replay buffer has moved past even the
    # newer live batches. Those are older than anything the publisher still holds: the
    # subscriber jumps to the buffer instead of applying them one by one. No snapshots (as
    # vLLM's publisher), so the replay buffer is all there is.
    context = zmq.Context()
    try:
        with ZmqEventPublisher(
            "inproc://backlog", "inproc://backlog-replay", bind=True, hwm=4,
            buffer_steps=100, track_state=False, context=context,
        ) as publisher:  # fmt: skip
            sub = ZmqEventSubscriber("inproc://backlog", "inproc://backlog-replay", context=context)
            with sub:

                def publish(start: int, stop: int) -> None:
                    for n in range(start, stop):
                        publisher.publish(event(n))
                    deadline = time.monotonic() + 10
                    while publisher.sent_batches < stop:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)

                publish(0, 10)
                poll_until(sub, lambda r: r and r[-1].seq == 9)
                publish(10, 2010)  # nobody reads: the pipe fills, the rest is dropped
                got = sub.poll(0.05, max_batches=500)  # room for newer live batches
                assert [r.seq for r in got] == list(range(10, 510))
                publish(2010, 2510)  # some enter the pipe behind the old backlog
                while batch := sub.poll(0.05):
                    got.extend(batch)
                seqs = [r.seq for r in got]
                # The backlog, then straight to the buffer (2410..2509): none of the newer
                # live batches (from 2010) is applied, they are dropped as already seen.
                jump = seqs.index(2410)
                backlog_end = seqs[jump - 1]
                assert seqs[:jump] == list(range(10, backlog_end + 1)) and backlog_end < 2010
                assert seqs[jump:] == list(range(2410, 2510))
                assert got[jump].num_lost_before == 2410 - (backlog_end + 1)
                assert sub.num_gaps == 1 and sub.num_duplicates > 0
                assert sub.num_lost == 2410 - (backlog_end + 1)
    finally:
        context.destroy(linger=0)
