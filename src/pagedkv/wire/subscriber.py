"""Adapter (extra `[events]`): the subscriber side of KV events over ZeroMQ: batches in sequence
order, gaps filled by replay or a snapshot, losses counted, publisher restarts detected.
Protocol and contract: docs/events.md; the publisher is `pagedkv.wire.transport`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError, MissingDependencyError, install_hint
from pagedkv.events import AllBlocksCleared, KVCacheEvent
from pagedkv.wire.codec import EventBatch, EventDecoder, WireFormatError
from pagedkv.wire.endpoints import (
    check_endpoint,
    should_bind_subscriber,
    wants_ipv6,
    warn_unresolved,
)

try:
    import zmq
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"KV events over ZeroMQ need pyzmq: {install_hint('events')}"
    ) from exc

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""Sequence frame that ends a replay answer (`[b"", END_SEQ, b""]` after the topic frame)."""

SNAPSHOT_REQUEST = b"pagedkv.snapshot"
"""Replay-socket request for a snapshot (16 bytes, so never mistaken for an 8-byte seq)."""

_HANDSHAKE_SUCCEEDED = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)


@dataclass(slots=True)
class ReceivedBatch:
    """A decoded batch and its sequence number (for a snapshot, its `snapshot_next_seq`)."""

    seq: int
    batch: EventBatch
    replayed: bool = False
    num_lost_before: int = 0
    """Batches lost for good just before this one (a consumer clears before applying it)."""


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
        stale_after_s: float | None = None,
    ) -> None:
        if not replay_timeout_s > 0:
            raise InvalidArgumentError(f"replay_timeout_s must be > 0, got {replay_timeout_s!r}")
        if stale_after_s is not None and not stale_after_s > 0:
            raise InvalidArgumentError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        bind = should_bind_subscriber(endpoint)  # checks the endpoint's syntax
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        self._context = context or zmq.Context.instance()
        self._decoder = decoder or EventDecoder()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.stale_after_s = stale_after_s
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if wants_ipv6(endpoint):
            self._sub.setsockopt(zmq.IPV6, 1)
        if stale_after_s is not None:
            # ZMTP heartbeats: the peer's libzmq answers PING itself, so a publisher that
            # neither sends a batch nor answers within stale_after_s (stopped, hung, its host
            # gone) is dropped as disconnected without any cooperation from the engine.
            timeout_ms = max(1, int(stale_after_s * 1000))
            self._sub.setsockopt(zmq.HEARTBEAT_IVL, max(1, timeout_ms // 3))
            self._sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            self._sub.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
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
        self.num_tail_checks_behind = 0
        """`check_tail` calls that found batches the live stream had not delivered."""
        self.num_tail_unanswered = 0
        """`check_tail` requests in a row that got no answer (a consumer backs off)."""
        self._last_live_seq: int | None = None
        self._pending_lost = 0
        self._last_ts: float | None = None  # of batch `last_seq`: tells incarnations apart
        self._monitor: Any = None
        self.connected: bool | None = None
        """Over tcp/ipc: whether the SUB socket is connected (None until known, or inproc)."""
        self.suspect_restart = False
        """Disconnected since the last batch: the publisher may be a new one (not trusted)."""
        if endpoint.startswith(("tcp://", "ipc://")):
            # Connected means the ZMTP handshake succeeded: a TCP connection alone is accepted
            # by the kernel even for a stopped process.
            self._monitor = self._sub.get_monitor_socket(
                _HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
            )
            self.connected = False
        warn_unresolved(endpoint)
        # Connect after the monitor is attached, or a quick connection goes unseen.
        try:
            if bind:
                self._sub.bind(endpoint)  # the publisher connects (its endpoint names a host)
            else:
                self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise InvalidArgumentError(
                f"cannot {'bind' if bind else 'connect to'} the KV event endpoint "
                f"{endpoint!r}: {exc}"
            ) from exc

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

    def fill_to(self, next_seq: int) -> list[ReceivedBatch]:
        """The publisher says it sent every batch below `next_seq`: fetch by replay (else a
        snapshot) the ones not received. PUB/SUB gives no other sign of a loss at the end of
        a stream (a subscriber that connected after the last batch waits forever)."""
        out: list[ReceivedBatch] = []
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if expected < next_seq:
            self._recover(expected, next_seq, out)
        return out

    def check_tail(self) -> list[ReceivedBatch]:
        """Ask the replay buffer for anything past the last batch received; the batches to
        apply, in order (the first flagged `num_lost_before` if the buffer wrapped past ours).

        PUB/SUB shows a loss at the end of a stream only with the publisher's next batch: the
        batches in flight while the subscriber stalled or reconnected are dropped without a
        trace, and an engine that then goes quiet leaves a consumer believing a state that
        may hold blocks evicted since. A consumer calls this while a stream is quiet (the
        router: every retry interval); one replay request, answered with nothing when the
        subscriber is current. Nothing is done without a replay endpoint, while disconnected
        or while a reconnection is unresolved; an unanswered request changes nothing."""
        out: list[ReceivedBatch] = []
        if self.replay_endpoint is None or self.connected is False or self.suspect_restart:
            return out
        expected = 0 if self.last_seq is None else self.last_seq + 1
        replayed = self._request_replay(expected)
        self.num_tail_unanswered = 0 if replayed is not None else self.num_tail_unanswered + 1
        oldest = next((seq for seq, _ in replayed or () if seq >= expected), None)
        if oldest is None:
            return out
        self.num_tail_checks_behind += 1
        if oldest > expected:
            self._lose_until(expected, oldest, "replay buffer wrapped")
        self._append_replayed(replayed or [], oldest, None, out)
        if out and oldest > expected:
            out[0].num_lost_before = oldest - expected
        return out

    def _lose_until(self, expected: int, oldest: int, why: str) -> None:
        """Batches `expected..oldest-1` are lost for good: count them and move past them."""
        logger.warning("KV events %d..%d are lost (%s)", expected, oldest - 1, why)
        self.num_missed += oldest - expected
        self.num_lost += oldest - expected
        self.last_seq = oldest - 1
        self._last_ts = None

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
            if event == _HANDSHAKE_SUCCEEDED:
                self.connected = True
                if self.suspect_restart:
                    self._resolve_reconnect(out)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.num_disconnects += 1
                self.suspect_restart = True

    def _handle(self, frames: list[bytes], out: list[ReceivedBatch]) -> None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self.num_malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last_live = self._last_live_seq
        self._last_live_seq = seq
        if last_live is not None and seq < last_live:
            self._restart(out)  # a live stream never goes back: a new publisher
        elif self.suspect_restart:
            self._resolve_reconnect(out)
        if self.last_seq is not None and seq <= self.last_seq:
            self.num_duplicates += 1
            return
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected:
            self._recover(expected, seq, out, live_follows=True)
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
            out.append(ReceivedBatch(seq, batch, num_lost_before=self._pending_lost))
            self._pending_lost = 0

    def _restart(self, out: list[ReceivedBatch]) -> None:
        logger.warning("KV event publisher %s restarted: its stream starts again", self.endpoint)
        self.num_restarts += 1
        self.last_seq = None
        self._last_ts = None
        self.suspect_restart = False
        empty = EventBatch(time.time(), [AllBlocksCleared()], snapshot_next_seq=0)
        out.append(ReceivedBatch(0, empty))

    def _resolve_reconnect(self, out: list[ReceivedBatch]) -> None:
        """After a disconnection the publisher may be a new one (restarted, empty), whose
        batches published before we reconnected are gone from PUB. A snapshot settles it;
        else the replay buffer does: the same publisher still holds our last batch (same seq,
        same timestamp); a new one does not, so its stream is read again from 0."""
        self.suspect_restart = False
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

    def _recover(
        self, expected: int, upto: int, out: list[ReceivedBatch], live_follows: bool = False
    ) -> None:
        """Fill [expected, upto) by replay, else from a snapshot, else count them missed (and
        still apply what the replay buffer holds after them)."""
        self.num_gaps += 1
        replayed: list[tuple[int, bytes]] = []
        if self.replay_endpoint is not None:
            replayed = self._request_replay(expected) or []
            # Every consecutive batch the answer holds, past `upto` too: after a stall the
            # live queue is behind (PUB dropped past its HWM), and stopping at `upto` would
            # turn each later jump into one more gap and one more replay.
            next_needed = self._append_replayed(replayed, expected, None, out)
            if next_needed >= upto:
                return
            snapshot = self._request_snapshot()
            if snapshot is not None and snapshot.seq >= upto:
                out.append(snapshot)
                self.last_seq = snapshot.seq - 1
                self._last_ts = None
                return
            expected = next_needed
        # The buffer starts after `expected` (it wrapped): lost up to its oldest batch, then
        # apply the rest of the answer (entries after a loss are real: the instance stays safe).
        # Its oldest batch may be past `upto` too: the live batch at `upto` and whatever is
        # queued behind it are then older than the publisher's whole buffer (a backlog from a
        # stall), so they count as lost and are dropped as already seen. Applying them would
        # store blocks whose evictions were in the batches lost.
        oldest = next((seq for seq, _ in replayed if seq > expected), upto)
        self._lose_until(expected, oldest, "no replay or snapshot")
        first = len(out)
        self._append_replayed(replayed, oldest, None, out)
        if len(out) > first:
            out[first].num_lost_before = oldest - expected
        elif live_follows:
            self._pending_lost += oldest - expected  # marks the live batch at `upto`

    def _replay_socket(self) -> Any:
        assert self.replay_endpoint is not None
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.RCVHWM, 0)  # a whole replay answer may queue here
            if wants_ipv6(self.replay_endpoint):
                self._replay.setsockopt(zmq.IPV6, 1)
            self._replay.connect(self.replay_endpoint)
        return self._replay

    def _ask(self, request: bytes) -> list[tuple[int, bytes]] | None:
        """Send one request on the replay socket; collect `(seq, payload)` until END_SEQ."""
        if self.replay_endpoint is None:
            return None
        socket = self._replay_socket()
        socket.send_multipart([b"", request])
        answers: list[tuple[int, bytes]] = []
        # A progress deadline: replay_timeout_s for the first frame and between frames, so a
        # long answer (thousands of batches) is read whole while a silent peer costs one
        # timeout.
        timeout_ms = max(1, int(self.replay_timeout_s * 1000))
        while True:
            if not socket.poll(timeout_ms):
                # No complete answer: drop the socket so a late answer cannot be misread.
                logger.warning("no answer from the replay endpoint %s", self.replay_endpoint)
                socket.close(linger=0)
                self._replay = None
                return None
            frames = socket.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != SEQ_BYTES:
                self.num_malformed += 1
                continue
            if frames[2] == END_SEQ:
                return answers
            answers.append((int.from_bytes(frames[2], "big"), frames[3]))

    def _request_replay(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        return self._ask(start_seq.to_bytes(SEQ_BYTES, "big"))

    def _request_snapshot(self) -> ReceivedBatch | None:
        answers = self._ask(SNAPSHOT_REQUEST)
        if not answers:
            return None
        seq, payload = answers[0]
        batch = self._decode(payload)
        if batch is None or batch.snapshot_next_seq is None:
            return None
        self.num_snapshots += 1
        return ReceivedBatch(batch.snapshot_next_seq, batch, replayed=True)
