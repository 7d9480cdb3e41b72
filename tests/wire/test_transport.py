"""ZeroMQ transport: endpoints, publish/subscribe over TCP loopback, a gap filled by replay,
drops under back-pressure, a late consumer syncing from a snapshot, malformed frames."""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, InvalidArgumentError  # noqa: E402
from pagedkv.wire import EventBatch, EventEncoder  # noqa: E402
from pagedkv.wire.snapshot import CacheMirror  # noqa: E402
from pagedkv.wire.transport import (  # noqa: E402
    END_SEQ,
    SNAPSHOT_REQUEST,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    offset_endpoint_port,
    should_bind,
)
from tests.support.kv_workload import RandomDriver, make_manager, pool_contents  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:0"


def loopback(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def collect(subscriber: ZmqEventSubscriber, until, timeout_s: float = 5.0) -> list:
    """Poll until `until(received)` holds (or fail after timeout_s)."""
    received: list = []
    deadline = time.monotonic() + timeout_s
    while not until(received):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; got seqs {[r.seq for r in received]}")
        received.extend(subscriber.poll(0.02))
    return received


def wait_sent(publisher: ZmqEventPublisher, num_batches: int) -> None:
    deadline = time.monotonic() + 5
    while publisher.sent_batches < num_batches:
        assert time.monotonic() < deadline, "the publisher thread did not send in time"
        time.sleep(0.005)


def removed(i: int) -> EventBatch:
    return EventBatch(float(i), [BlockRemoved([i], "GPU", 0)])


def test_endpoint_rules_and_data_parallel_offsets():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint_port("tcp://10.0.0.1:6000", 3) == "tcp://10.0.0.1:6003"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(InvalidArgumentError, match="ipc:///tmp/x"):
        offset_endpoint_port("ipc:///tmp/x", 1)
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557")
    assert should_bind("ipc:///tmp/kv") and should_bind("inproc://kv")
    assert should_bind("tcp://127.0.0.1:0")
    assert not should_bind("tcp://127.0.0.1:5557")


def test_publish_subscribe_over_tcp_with_gap_filled_by_replay():
    """A forwarder between publisher and subscriber drops seqs 3 and 4; replay restores them."""
    context = zmq.Context.instance()
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, topic="kv", buffer_steps=100) as publisher:
        upstream = context.socket(zmq.SUB)
        upstream.setsockopt(zmq.SUBSCRIBE, b"")
        upstream.connect(loopback(publisher.endpoint))
        downstream = context.socket(zmq.XPUB)
        downstream.bind(LOOPBACK)
        subscriber = ZmqEventSubscriber(
            loopback(downstream.getsockopt(zmq.LAST_ENDPOINT).decode()),
            loopback(publisher.replay_endpoint),
            topic="kv",
            replay_timeout_s=2.0,
        )
        try:
            assert downstream.poll(2000)  # the subscriber's subscription arrived
            downstream.recv()
            time.sleep(0.1)  # let the upstream SUB connect too (losses there are replayed)
            for i in range(8):
                publisher.publish(removed(i))
            forwarded = 0
            deadline = time.monotonic() + 5
            while forwarded < 8 and time.monotonic() < deadline:
                if upstream.poll(50):
                    frames = upstream.recv_multipart()
                    seq = int.from_bytes(frames[1], "big")
                    forwarded = seq + 1
                    if seq not in (3, 4):
                        downstream.send_multipart(frames)
            received = collect(subscriber, lambda r: r and r[-1].seq == 7)
        finally:
            subscriber.close()
            upstream.close(linger=0)
            downstream.close(linger=0)
    assert [r.seq for r in received] == list(range(8))
    assert [r.batch.events for r in received] == [[BlockRemoved([i], "GPU", 0)] for i in range(8)]
    assert received[3].replayed and received[4].replayed
    assert all(r.batch.data_parallel_rank == 0 for r in received)
    assert subscriber.num_gaps >= 1 and subscriber.num_replayed >= 2
    assert subscriber.num_missed == 0 and subscriber.num_malformed == 0


class BlockingEncoder(EventEncoder):
    """Holds the publisher thread inside encode() until released (back-pressure on demand)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def encode(self, batch):
        self.release.wait(10)
        return super().encode(batch)


def test_full_queue_drops_never_blocks_and_snapshot_resyncs():
    encoder = BlockingEncoder()
    manager = make_manager()
    driver = RandomDriver(manager, seed=3)
    with ZmqEventPublisher(
        "inproc://drops", "inproc://drops-replay", max_queue_size=2, encoder=encoder
    ) as publisher:
        subscriber = ZmqEventSubscriber(
            "inproc://drops", "inproc://drops-replay", replay_timeout_s=2.0
        )
        mirror = CacheMirror()
        try:
            for _ in range(40):  # the thread is stuck: 2 queued (+ 1 in flight) survive
                for _ in range(5):
                    driver.step()
                publisher.publish(manager.take_events())
            assert publisher.dropped_batches >= 37
            encoder.release.set()
            # The queue drained (2 or 3 batches survived): the next batch is not dropped.
            wait_sent(publisher, 40 - publisher.dropped_batches)
            for _ in range(5):
                driver.step()
            last = publisher.publish(manager.take_events())
            received = collect(subscriber, lambda r: r and r[-1].seq >= last)
        finally:
            subscriber.close()
    for item in received:
        mirror.apply(item.batch.events)
    assert subscriber.num_snapshots >= 1
    assert pool_contents(manager) == mirror.block_counts()


def test_late_consumer_syncs_from_snapshot():
    manager = make_manager()
    driver = RandomDriver(manager, seed=11)
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=4) as publisher:
        for _ in range(30):
            for _ in range(10):
                driver.step()
            publisher.publish(manager.take_events())
        subscriber = ZmqEventSubscriber(
            loopback(publisher.endpoint), loopback(publisher.replay_endpoint), replay_timeout_s=2.0
        )
        try:
            snapshot = subscriber.sync()
            assert snapshot is not None and snapshot.batch.is_snapshot
            assert snapshot.seq == publisher.next_seq == 30
            assert isinstance(snapshot.batch.events[0], AllBlocksCleared)
            assert all(isinstance(e, BlockStored) for e in snapshot.batch.events[1:])
            consumer = CacheMirror()
            consumer.apply(snapshot.batch.events)
            assert consumer.block_counts() == pool_contents(manager)
            time.sleep(0.1)
            for _ in range(5):
                for _ in range(10):
                    driver.step()
                last = publisher.publish(manager.take_events())
            for item in collect(subscriber, lambda r: r and r[-1].seq >= last):
                consumer.apply(item.batch.events)
            resynced = CacheMirror()
            resynced.apply(subscriber.sync_events())  # a router's snapshot_source
            assert resynced.block_counts() == pool_contents(manager)
        finally:
            subscriber.close()
    assert consumer.block_counts() == pool_contents(manager)
    assert publisher.snapshot_requests >= 1


def test_joiner_outside_replay_window_falls_back_to_snapshot():
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3) as publisher:
        for i in range(10):
            publisher.publish(EventBatch(0.0, [BlockStored([i], None, [i], 1, None, "GPU")]))
        wait_sent(publisher, 10)  # all ten went out before the subscriber connects
        subscriber = ZmqEventSubscriber(
            loopback(publisher.endpoint), loopback(publisher.replay_endpoint), replay_timeout_s=2.0
        )
        try:
            time.sleep(0.1)
            publisher.publish(EventBatch(0.0, [BlockRemoved([0], "GPU")]))
            received = collect(subscriber, lambda r: r and r[-1].seq >= 10)
        finally:
            subscriber.close()
    consumer = CacheMirror()
    for item in received:
        consumer.apply(item.batch.events)
    assert received[0].batch.is_snapshot and received[0].seq in (10, 11)
    assert consumer.block_counts() == {("GPU", None, i): 1 for i in range(1, 10)}


def test_malformed_frames_and_payloads_are_counted_and_skipped():
    context = zmq.Context.instance()
    pub = context.socket(zmq.XPUB)
    pub.bind(LOOPBACK)
    subscriber = ZmqEventSubscriber(loopback(pub.getsockopt(zmq.LAST_ENDPOINT).decode()))
    encoder = EventEncoder()
    good = encoder.encode(removed(1))
    try:
        assert pub.poll(5000)  # the subscription arrived: nothing sent below is lost
        pub.recv()
        pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
        pub.send_multipart([b"", (0).to_bytes(8, "big"), good])  # duplicate
        pub.send_multipart([b"", b"\x00\x01", good])  # short seq frame
        pub.send_multipart([b"", (1).to_bytes(8, "big")])  # two frames
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1garbage"])  # bad payload
        pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\x93\x01\x02\x03"])  # not a batch
        pub.send_multipart([b"", (3).to_bytes(8, "big"), good])
        received = collect(subscriber, lambda r: r and r[-1].seq == 3, timeout_s=3)
    finally:
        subscriber.close()
        pub.close(linger=0)
    assert [r.seq for r in received] == [0, 3]
    assert subscriber.num_malformed == 4
    assert subscriber.num_duplicates == 1
    assert subscriber.num_gaps == 0


def test_replay_router_protocol_with_a_raw_client():
    with ZmqEventPublisher("inproc://raw", "inproc://raw-replay", topic="t") as publisher:
        for i in range(3):
            publisher.publish(removed(i))
        wait_sent(publisher, 3)
        client = zmq.Context.instance().socket(zmq.DEALER)
        client.connect("inproc://raw-replay")
        try:
            client.send_multipart([b"", (1).to_bytes(8, "big")])
            frames = [client.recv_multipart() for _ in range(3)]
            assert [f[:3] for f in frames] == [
                [b"", b"t", (1).to_bytes(8, "big")],
                [b"", b"t", (2).to_bytes(8, "big")],
                [b"", b"", END_SEQ],
            ]
            client.send_multipart([b"", b"bogus"])  # not 8 bytes: just the end marker
            assert client.recv_multipart() == [b"", b"", END_SEQ, b""]
            client.send_multipart([b"", SNAPSHOT_REQUEST])
            snapshot = client.recv_multipart()
            assert snapshot[2] == (3).to_bytes(8, "big")
            assert client.recv_multipart()[2] == END_SEQ
        finally:
            client.close(linger=0)


def test_shutdown_and_startup_errors():
    publisher = ZmqEventPublisher("inproc://closing")
    publisher.publish([BlockRemoved([1], "GPU")])
    publisher.shutdown()
    publisher.shutdown()  # idempotent
    assert not publisher._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([])
    with ZmqEventPublisher(LOOPBACK) as first:
        port_endpoint = loopback(first.endpoint).replace("127.0.0.1", "*")
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(port_endpoint)
    with pytest.raises(InvalidArgumentError, match="max_queue_size"):
        ZmqEventPublisher("inproc://bad", max_queue_size=0)


def test_data_parallel_rank_offsets_inproc_and_stamps_batches():
    with ZmqEventPublisher("inproc://dp", "inproc://dp-replay", data_parallel_rank=2) as publisher:
        assert publisher.endpoint == "inproc://dp_dp2"
        assert publisher.replay_endpoint == "inproc://dp-replay_dp2"
        subscriber = ZmqEventSubscriber("inproc://dp_dp2", "inproc://dp-replay_dp2")
        try:
            publisher.publish([BlockRemoved([9], "GPU")])
            received = collect(subscriber, lambda r: len(r) == 1)
        finally:
            subscriber.close()
    assert received[0].batch.data_parallel_rank == 2


def test_fill_to_fetches_batches_sent_before_the_subscription_arrived():
    # ZeroMQ's slow joiner: these go out before any subscriber exists, and no later batch
    # reveals the gap; the publisher's count does (`fill_to`).
    with ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as publisher:
        for i in range(3):
            publisher.publish(removed(i))
        wait_sent(publisher, 3)
        subscriber = ZmqEventSubscriber(
            loopback(publisher.endpoint), loopback(publisher.replay_endpoint), replay_timeout_s=2
        )
        try:
            assert subscriber.poll(0.2) == []
            filled = subscriber.fill_to(publisher.next_seq)
            assert [item.seq for item in filled] == [0, 1, 2]
            assert all(item.replayed for item in filled) and subscriber.last_seq == 2
            assert subscriber.fill_to(publisher.next_seq) == [] and subscriber.num_lost == 0
        finally:
            subscriber.close()
