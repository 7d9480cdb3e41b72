"""Adapter (extra `[events]`): KV-event batches over ZeroMQ, the reference's protocol.

Publisher: a PUB socket sending `[topic, seq (8 bytes, big-endian, from 0), payload]` and a
ROUTER answering replay requests; a bounded queue feeds a background thread, so `publish`
never blocks. The subscriber lives in `pagedkv.wire.subscriber` (re-exported here). Contract
in docs/events.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, overload

from pagedkv.errors import InvalidArgumentError, MissingDependencyError, install_hint
from pagedkv.events import KVCacheEvent
from pagedkv.wire.codec import EventBatch, EventEncoder
from pagedkv.wire.endpoints import wants_ipv6
from pagedkv.wire.snapshot import CacheMirror
from pagedkv.wire.subscriber import (
    END_SEQ,
    SEQ_BYTES,
    SNAPSHOT_REQUEST,
    ReceivedBatch,
    ZmqEventSubscriber,
)

__all__ = [
    "END_SEQ",
    "SNAPSHOT_REQUEST",
    "ReceivedBatch",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "offset_endpoint_port",
    "should_bind",
]

try:
    import zmq
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"KV events over ZeroMQ need pyzmq: {install_hint('events')}"
    ) from exc

logger = logging.getLogger(__name__)


@overload
def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str: ...


@overload
def offset_endpoint_port(endpoint: None, data_parallel_rank: int) -> None: ...


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank `data_parallel_rank`, as the reference derives it.

    `tcp://host:PORT` -> `tcp://host:PORT+rank` (port 0 stays 0); `inproc://name` ->
    `inproc://name_dp{rank}`; rank 0 and None are unchanged; anything else is refused.
    """
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            if int(port) == 0:
                return endpoint
            return f"{host}:{int(port) + data_parallel_rank}"
    raise InvalidArgumentError(
        f"cannot offset endpoint {endpoint!r} for data-parallel rank {data_parallel_rank}: "
        "use tcp://host:port or inproc://name"
    )


def should_bind(endpoint: str) -> bool:
    """Bind (rather than connect) for wildcard hosts, ipc/inproc, and port 0 (ephemeral)."""
    if "*" in endpoint or "::" in endpoint:
        return True
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0"


def _bind_or_connect(socket: Any, endpoint: str, bind: bool | None = None) -> str:
    if wants_ipv6(endpoint):
        socket.setsockopt(zmq.IPV6, 1)
    if should_bind(endpoint) if bind is None else bind:
        socket.bind(endpoint)
        return socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    socket.connect(endpoint)
    return endpoint


class ZmqEventPublisher:
    """Publish event batches on a PUB socket; answer replay and snapshot requests.

    Ordering: sequence numbers are assigned in `publish` call order and batches go out in
    that order. Drop policy (unlike the reference, whose `publish` blocks when the queue is
    full): when `max_queue_size` batches are waiting, `publish` drops the new batch, counts it
    in `dropped_batches` and logs a warning; its sequence number is still consumed, so
    subscribers see a gap that replay cannot fill and resynchronise from a snapshot. PUB
    itself drops messages for a subscriber past `hwm`; a vanished consumer never blocks.

    Endpoint: bound or connected as `should_bind` decides, unless `bind` says (a service that
    connects to `tcp://host:port` needs the publisher to bind that named address).

    Snapshots: with `track_state` (default), `publish` also applies the batch to a
    `CacheMirror`, and a snapshot request on the replay socket is answered with a batch that
    rebuilds the producer's cache contents as of every batch published so far.

    The sockets live in the background thread; `shutdown()` drains the queue (up to
    `shutdown_timeout_s`), then closes them with linger 0.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        encoder: EventEncoder | None = None,
        track_state: bool = True,
        context: Any = None,
        startup_timeout_s: float = 5.0,
        bind: bool | None = None,
    ) -> None:
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.data_parallel_rank = data_parallel_rank
        self.topic = topic
        self._topic_bytes = topic.encode()
        self._requested_endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._requested_replay = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        # The address bound or connected to: set by the thread before the constructor returns.
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self.encoder = encoder or EventEncoder()
        self._hwm = hwm
        self._bind = bind
        self._context = context or zmq.Context.instance()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._mirror = CacheMirror() if track_state else None
        self._lock = threading.Lock()
        self._next_seq = 0
        self._closed = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.dropped_batches = 0
        self.sent_batches = 0
        self.replay_requests = 0
        self.snapshot_requests = 0
        self.send_errors = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-zmq-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(startup_timeout_s):
            raise RuntimeError("the ZeroMQ publisher thread did not start")
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error

    # ------------------------------------------------------------------ caller side

    def publish(self, batch: EventBatch | Sequence[KVCacheEvent]) -> int:
        """Queue one batch (or a list of events, stamped now) and return its sequence number.

        Never blocks; see the class docstring for the drop policy. Raises `RuntimeError`
        after `shutdown()`.
        """
        if self._closed:
            raise RuntimeError("Publisher is closed")
        if not isinstance(batch, EventBatch):
            batch = EventBatch(time.time(), list(batch))
        batch.data_parallel_rank = self.data_parallel_rank
        with self._lock:
            seq = self._next_seq
            self._next_seq = seq + 1
            if self._mirror is not None:
                self._mirror.apply(batch.events)
            try:
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self.dropped_batches += 1
                if self.dropped_batches == 1 or self.dropped_batches % 1000 == 0:
                    logger.warning(
                        "KV event queue full (%d batches): dropped batch %d (%d dropped so far); "
                        "subscribers will resynchronise from a snapshot",
                        self._queue.maxsize,
                        seq,
                        self.dropped_batches,
                    )
        return seq

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def snapshot(self) -> EventBatch | None:
        """The current snapshot batch (None without `track_state`)."""
        taken = self._take_snapshot()
        return None if taken is None else taken[0]

    def _take_snapshot(self) -> tuple[EventBatch, int] | None:
        """The snapshot batch and its `snapshot_next_seq` (None without `track_state`)."""
        if self._mirror is None:
            return None
        with self._lock:
            events = self._mirror.snapshot_events()
            next_seq = self._next_seq
        batch = EventBatch(time.time(), events, self.data_parallel_rank, snapshot_next_seq=next_seq)
        return batch, next_seq

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Stop accepting batches, send what is queued (up to `timeout_s`), close the sockets."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stop.set()
        self._thread.join(max(0.1, deadline - time.monotonic()) + 1.0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        pub = router = None
        try:
            pub = self._context.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind_or_connect(pub, self._requested_endpoint, self._bind)
            if self._requested_replay is not None:
                router = self._context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what passes its send HWM (1,000 by default) without a word: a
                # replay answer (at most buffer_steps batches) would come with holes.
                router.setsockopt(zmq.SNDHWM, 0)
                if wants_ipv6(self._requested_replay):
                    router.setsockopt(zmq.IPV6, 1)
                router.bind(self._requested_replay)
                self.replay_endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._startup_error = exc
            for socket in (pub, router):
                if socket is not None:
                    socket.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, router)
        finally:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)

    def _loop(self, pub: Any, router: Any) -> None:
        get = self._queue.get
        while not self._stop.is_set():  # shutdown() has already waited for the queue to drain
            if router is not None:
                while router.poll(0):
                    self._serve_request(router)
            try:
                item = get(timeout=0.05)
            except queue.Empty:
                continue
            seq, batch = item
            try:
                payload = self.encoder.encode(batch)
                pub.send_multipart([self._topic_bytes, seq.to_bytes(SEQ_BYTES, "big"), payload])
                self._buffer.append((seq, payload))
                self.sent_batches += 1
            except Exception:  # noqa: BLE001 - one bad batch must not stop the thread
                self.send_errors += 1
                logger.exception("failed to publish KV event batch %d", seq)
                time.sleep(0.1)

    def _serve_request(self, router: Any) -> None:
        frames = router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            logger.warning("replay socket: ignoring a request of %d frames", len(frames))
            return
        client_id, _, request = frames
        topic = self._topic_bytes
        if request == SNAPSHOT_REQUEST:
            self.snapshot_requests += 1
            taken = self._take_snapshot()
            if taken is not None:
                snapshot, next_seq = taken
                seq_frame = next_seq.to_bytes(SEQ_BYTES, "big")
                payload = self.encoder.encode(snapshot)
                router.send_multipart([client_id, b"", topic, seq_frame, payload])
        elif len(request) == SEQ_BYTES:
            self.replay_requests += 1
            start_seq = int.from_bytes(request, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    router.send_multipart(
                        [client_id, b"", topic, seq.to_bytes(SEQ_BYTES, "big"), payload]
                    )
        else:
            logger.warning("replay socket: ignoring a %d-byte request", len(request))
        router.send_multipart([client_id, b"", b"", END_SEQ, b""])
