"""Adapter (extra `[events]`): KV-event batches over ZeroMQ, the reference's protocol.

Publisher: a PUB socket sending `[topic, seq (8 bytes, big-endian, from 0), payload]` and a
ROUTER answering replay requests; a bounded queue feeds a background thread, so `publish`
never blocks. Subscriber: fills sequence gaps through replay, or resynchronises from a
snapshot (our extension). Contract in docs/events.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError, MissingDependencyError
from pagedkv.events import AllBlocksCleared, KVCacheEvent
from pagedkv.wire.codec import EventBatch, EventDecoder, EventEncoder, WireFormatError
from pagedkv.wire.snapshot import CacheMirror

try:
    import zmq
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "KV events over ZeroMQ need pyzmq: pip install 'pagedkv[events]'"
    ) from exc

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame that ends a replay answer (`[b"", END_SEQ, b""]` after the topic frame)."""

SNAPSHOT_REQUEST = b"pagedkv.snapshot"
"""Replay-socket request for a snapshot (16 bytes, so never mistaken for an 8-byte seq)."""

_SEQ_BYTES = 8


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
        self.endpoint: str | None = None
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
        if self._mirror is None:
            return None
        with self._lock:
            events = self._mirror.snapshot_events()
            next_seq = self._next_seq
        return EventBatch(time.time(), events, self.data_parallel_rank, snapshot_next_seq=next_seq)

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
                pub.send_multipart([self._topic_bytes, seq.to_bytes(_SEQ_BYTES, "big"), payload])
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
            snapshot = self.snapshot()
            if snapshot is not None:
                seq_frame = snapshot.snapshot_next_seq.to_bytes(_SEQ_BYTES, "big")
                payload = self.encoder.encode(snapshot)
                router.send_multipart([client_id, b"", topic, seq_frame, payload])
        elif len(request) == _SEQ_BYTES:
            self.replay_requests += 1
            start_seq = int.from_bytes(request, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    router.send_multipart(
                        [client_id, b"", topic, seq.to_bytes(_SEQ_BYTES, "big"), payload]
                    )
        else:
            logger.warning("replay socket: ignoring a %d-byte request", len(request))
        router.send_multipart([client_id, b"", b"", END_SEQ, b""])


@dataclass(slots=True)
class ReceivedBatch:
    """A decoded batch and its sequence number (for a snapshot, its `snapshot_next_seq`)."""

    seq: int
    batch: EventBatch
    replayed: bool = False


class ZmqEventSubscriber:
    """Receive batches in sequence order, filling gaps by replay or from a snapshot.

    `poll` returns batches to apply, in order, each once: duplicates (seq already seen) are
    dropped; a gap triggers a replay request from the first missing seq; if the replay does
    not cover the gap (the publisher dropped batches, or they left its replay window), a
    snapshot request; a snapshot batch (apply it: it starts with `AllBlocksCleared`) moves
    the position past every batch it covers. Malformed frames and payloads are counted in
    `num_malformed` and skipped; a malformed payload still consumes its sequence number.
    Without a replay endpoint, or when the publisher does not answer, the missing batches
    are counted in `num_missed` and skipped. `num_lost` counts every batch lost for good
    (missed, or a payload that did not decode): a consumer whose state must be exact compares
    it across `poll` calls (the router's `mark_lost`).

    Publisher restarts: a live sequence number below the last one received (or at it, across
    a reconnection) means a new publisher, which starts again at 0 with an empty cache (as a
    vLLM engine does). `poll` then yields a synthetic snapshot `[AllBlocksCleared]` with
    `snapshot_next_seq = 0` and reads the new stream from 0 (`num_restarts`). Over tcp and ipc
    the subscriber also watches its connection (`connected`): on reconnecting it asks for a
    snapshot, and without one (a vLLM publisher) asks the replay buffer for its last batch: the
    same publisher still has it (same seq and timestamp), a restarted one does not, and its
    stream is then read again from 0 after the synthetic snapshot.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        context: Any = None,
        replay_timeout_s: float = 1.0,
        decoder: EventDecoder | None = None,
    ) -> None:
        self._context = context or zmq.Context.instance()
        self._decoder = decoder or EventDecoder()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay: Any = None
        self.last_seq: int | None = None
        self.num_received = 0
        self.num_malformed = 0
        self.num_duplicates = 0
        self.num_gaps = 0
        self.num_replayed = 0
        self.num_snapshots = 0
        self.num_missed = 0
        self.num_lost = 0
        self.num_restarts = 0
        self.num_disconnects = 0
        self._last_live_seq: int | None = None
        self._last_ts: float | None = None  # of batch `last_seq`: tells incarnations apart
        self._suspect_restart = False
        self._monitor: Any = None
        self.connected: bool | None = None
        """Over tcp/ipc: whether the SUB socket is connected (None until known, or inproc)."""
        if endpoint.startswith(("tcp://", "ipc://")):
            self._monitor = self._sub.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
            )
            self.connected = False
        # Connect after the monitor is attached, or a quick connection goes unseen.
        if "*" in endpoint or "::" in endpoint:
            self._sub.bind(endpoint)  # the publisher connects (its endpoint names a host)
        else:
            self._sub.connect(endpoint)

    def poll(self, timeout_s: float = 0.0, max_batches: int = 10_000) -> list[ReceivedBatch]:
        """Wait up to `timeout_s` for data, then return every batch ready to apply."""
        out: list[ReceivedBatch] = []
        if self._monitor is not None:
            self._watch_connection(out)
            if not self._sub.poll(0):
                poller = zmq.Poller()
                poller.register(self._sub, zmq.POLLIN)
                poller.register(self._monitor, zmq.POLLIN)
                ready = dict(poller.poll(int(timeout_s * 1000)))
                if self._monitor in ready:
                    self._watch_connection(out)
                if self._sub not in ready and not self._sub.poll(0):
                    return out
        elif not self._sub.poll(int(timeout_s * 1000)):
            return out
        while len(out) < max_batches:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(frames, out)
        return out

    @property
    def poll_sockets(self) -> list[Any]:
        """The sockets to wait on (with a `zmq.Poller`) before calling `poll` on several
        subscribers at once."""
        return [self._sub] if self._monitor is None else [self._sub, self._monitor]

    def sync(self) -> ReceivedBatch | None:
        """Resynchronise from a snapshot now (a late joiner); None if none is available."""
        snapshot = self._request_snapshot()
        if snapshot is not None:
            self.last_seq = snapshot.seq - 1
            self._last_ts = None
        return snapshot

    def sync_events(self) -> list[KVCacheEvent] | None:
        """`sync()`, returning the snapshot's events."""
        snapshot = self.sync()
        return None if snapshot is None else snapshot.batch.events

    def sync_batch(self) -> EventBatch | None:
        """`sync()`, returning the snapshot batch (a router's `snapshot_source`: its
        `snapshot_next_seq` tells the router which stream batches it already contains)."""
        snapshot = self.sync()
        return None if snapshot is None else snapshot.batch

    def close(self) -> None:
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _watch_connection(self, out: list[ReceivedBatch]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.connected = True
                if self._suspect_restart:
                    self._resolve_reconnect(out)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.num_disconnects += 1
                self._suspect_restart = True

    def _handle(self, frames: list[bytes], out: list[ReceivedBatch]) -> None:
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            self.num_malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last_live = self._last_live_seq
        self._last_live_seq = seq
        if last_live is not None and seq < last_live:
            self._restart(out)  # a live stream never goes back: a new publisher
        elif self._suspect_restart:
            self._resolve_reconnect(out)
        if self.last_seq is not None and seq <= self.last_seq:
            self.num_duplicates += 1
            return
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected:
            self._recover(expected, seq, out)
            if self.last_seq is not None and seq <= self.last_seq:
                self.num_duplicates += 1
                return
        self.last_seq = seq
        self.num_received += 1
        batch = self._decode(frames[2])
        if batch is None:
            self.num_lost += 1
            self._last_ts = None
        else:
            self._last_ts = batch.ts
            out.append(ReceivedBatch(seq, batch))

    def _restart(self, out: list[ReceivedBatch]) -> None:
        logger.warning("KV event publisher %s restarted: its stream starts again", self.endpoint)
        self.num_restarts += 1
        self.last_seq = None
        self._last_ts = None
        self._suspect_restart = False
        empty = EventBatch(time.time(), [AllBlocksCleared()], snapshot_next_seq=0)
        out.append(ReceivedBatch(0, empty))

    def _resolve_reconnect(self, out: list[ReceivedBatch]) -> None:
        """After a disconnection the publisher may be a new one (restarted, empty), whose
        batches published before we reconnected are gone from PUB. A snapshot settles it;
        else the replay buffer does: the same publisher still holds our last batch (same seq,
        same timestamp); a new one does not, so its stream is read again from 0."""
        self._suspect_restart = False
        self._last_live_seq = None
        snapshot = self._request_snapshot()
        if snapshot is not None:
            out.append(snapshot)
            self.last_seq = snapshot.seq - 1
            self._last_ts = None
            return
        if self.last_seq is None:
            return  # nothing applied yet: the live stream and replay from 0 tell all
        answers = self._request_replay(self.last_seq)
        if answers is None:
            logger.warning("cannot tell whether %s restarted: counted as a loss", self.endpoint)
            self.num_lost += 1
            return
        ours = [payload for seq, payload in answers if seq == self.last_seq]
        last = self._decode(ours[0]) if ours else None
        if last is not None and self._last_ts is not None and last.ts == self._last_ts:
            self._append_replayed(answers, self.last_seq + 1, None, out)  # same publisher
            return
        self._restart(out)
        self._append_replayed(self._request_replay(0) or [], 0, None, out)

    def _append_replayed(
        self,
        answers: list[tuple[int, bytes]],
        next_needed: int,
        upto: int | None,
        out: list[ReceivedBatch],
    ) -> int:
        """Append the consecutive replayed batches from `next_needed` (below `upto`); returns
        the first sequence number not appended."""
        for seq, payload in answers:
            if seq < next_needed:
                continue
            if seq != next_needed or (upto is not None and seq >= upto):
                break
            self.last_seq = seq
            self.num_replayed += 1
            batch = self._decode(payload)
            if batch is None:
                self.num_lost += 1
            else:
                self._last_ts = batch.ts
                out.append(ReceivedBatch(seq, batch, replayed=True))
            next_needed += 1
        return next_needed

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return self._decoder.decode(payload)
        except WireFormatError as exc:
            self.num_malformed += 1
            logger.warning("skipping a malformed KV event payload: %s", exc)
            return None

    def _recover(self, expected: int, upto: int, out: list[ReceivedBatch]) -> None:
        """Fill [expected, upto) by replay, else from a snapshot, else count them missed."""
        self.num_gaps += 1
        if self.replay_endpoint is not None:
            replayed = self._request_replay(expected) or []
            next_needed = self._append_replayed(replayed, expected, upto, out)
            if next_needed == upto:
                return
            snapshot = self._request_snapshot()
            if snapshot is not None and snapshot.seq >= upto:
                out.append(snapshot)
                self.last_seq = snapshot.seq - 1
                self._last_ts = None
                return
            expected = next_needed
        logger.warning("KV events %d..%d are lost (no replay or snapshot)", expected, upto - 1)
        self.num_missed += upto - expected
        self.num_lost += upto - expected
        self.last_seq = upto - 1
        self._last_ts = None

    def _replay_socket(self) -> Any:
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.replay_endpoint)
        return self._replay

    def _ask(self, request: bytes) -> list[tuple[int, bytes]] | None:
        """Send one request on the replay socket; collect `(seq, payload)` until END_SEQ."""
        if self.replay_endpoint is None:
            return None
        socket = self._replay_socket()
        socket.send_multipart([b"", request])
        answers: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not socket.poll(remaining_ms):
                # No complete answer: drop the socket so a late answer cannot be misread.
                logger.warning("no answer from the replay endpoint %s", self.replay_endpoint)
                socket.close(linger=0)
                self._replay = None
                return None
            frames = socket.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != _SEQ_BYTES:
                self.num_malformed += 1
                continue
            if frames[2] == END_SEQ:
                return answers
            answers.append((int.from_bytes(frames[2], "big"), frames[3]))

    def _request_replay(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        return self._ask(start_seq.to_bytes(_SEQ_BYTES, "big"))

    def _request_snapshot(self) -> ReceivedBatch | None:
        answers = self._ask(SNAPSHOT_REQUEST)
        if not answers:
            return None
        seq, payload = answers[0]
        batch = self._decode(payload)
        if batch is None or not batch.is_snapshot:
            return None
        self.num_snapshots += 1
        return ReceivedBatch(batch.snapshot_next_seq, batch, replayed=True)
