"""Router layer (extra `[events]`): feed a `Router` from N instances' ZeroMQ event streams in a
background thread, sequence-aware, reporting losses and connection state.

The router and index are shared with the HTTP handlers: every access holds `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from pagedkv.errors import ThreadOwnershipError
from pagedkv.router.router import NEVER_CONNECTED, NOT_CONNECTED_YET, Router
from pagedkv.router.service_config import InstanceConfig

logger = logging.getLogger(__name__)

_IDLE_WAIT_MS = 50
_HEALTH_TIMEOUT_S = 1.0


class EventFeeds:
    """One `ZmqEventSubscriber` per instance, polled by one thread that applies what arrives.

    Contract: batches are applied in sequence order, each once (`Router.apply_batch`), a loss
    (`num_lost` grew) marks the instance lost, and `Router.maybe_recover` runs between polls.
    A stream quiet for `retry_interval_s` is asked for its tail (`check_tail`: one replay
    request), so batches lost at a stream's end (dropped in a stall or a reconnection) are
    found within an interval even if the engine publishes nothing more.
    Liveness, decided after every poll: an instance is down (`Router.set_down`) while its
    stream is disconnected (the socket monitor; ZMTP heartbeats make a silent peer a
    disconnection after `stale_after_s`), while a reconnection is not yet resolved (same
    publisher or a restart: the subscriber settles it before any new batch is handed over),
    while its optional `health_url` fails, and until it first connects (declared down for good,
    so `/ready` need not wait for it, `stale_after_s` after the start). `applied_seq[i]` is the
    last sequence number of instance i the router has seen (applied, skipped as contained in a
    snapshot, or lost).
    """

    def __init__(
        self,
        router: Router,
        instances: Sequence[InstanceConfig],
        replay_timeout_s: float = 1.0,
        context: Any = None,
        stale_after_s: float | None = None,
    ) -> None:
        from pagedkv.wire.transport import ZmqEventSubscriber

        self.router = router
        self.lock = threading.Lock()
        self.stale_after_s = stale_after_s
        self.subscribers: dict[str, Any] = {}
        try:
            for inst in instances:
                self.subscribers[inst.instance_id] = ZmqEventSubscriber(
                    inst.endpoint,
                    inst.replay_endpoint,
                    topic=inst.topic,
                    replay_timeout_s=replay_timeout_s,
                    context=context,
                    stale_after_s=stale_after_s,
                )
        except Exception:
            for subscriber in self.subscribers.values():
                subscriber.close()
            raise
        self.health_urls = {i.instance_id: i.health_url for i in instances if i.health_url}
        self.health_failures: dict[str, str] = {}
        self._started_s = time.monotonic()
        for instance_id, subscriber in self.subscribers.items():
            if subscriber.connected is not None:  # tcp/ipc: watched; inproc: live at once
                router.states[instance_id].ever_live = False
                router.set_down(instance_id, NOT_CONNECTED_YET)
        self.applied_seq: dict[str, int | None] = dict.fromkeys(self.subscribers)
        self._last_heard_s = dict.fromkeys(self.subscribers, self._started_s)
        """When each stream last delivered a batch, or was last asked for its tail."""
        self.num_events_applied: dict[str, int] = dict.fromkeys(self.subscribers, 0)
        self._last_resync_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-router-feeds", daemon=True)
        self._health_thread: threading.Thread | None = None

    def snapshot_source(self, instance_id: str) -> Any:
        """The router's `snapshot_source`: ask the instance's publisher for a snapshot.

        Threading: once `start` ran, the subscribers' sockets belong to the feed thread (ZeroMQ
        sockets are not thread-safe), so a call from any other thread is refused with
        `ThreadOwnershipError` instead of racing the thread's polls."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            caller = threading.current_thread().name
            raise ThreadOwnershipError(
                f"the subscriber of {instance_id!r} is owned by thread {self._thread.name!r}; "
                f"thread {caller!r} may not use its sockets",
                owner_thread=self._thread.name,
                calling_thread=caller,
            )
        return self.subscribers[instance_id].sync_batch()

    def start(self) -> None:
        self._thread.start()
        if self.health_urls:
            self._health_thread = threading.Thread(
                target=self._check_health, name="pagedkv-router-health", daemon=True
            )
            self._health_thread.start()

    def close(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._health_thread):
            if thread is not None and thread.is_alive():
                thread.join(timeout=5)
        for subscriber in self.subscribers.values():
            subscriber.close()

    def poll_once(self, timeout_ms: int = _IDLE_WAIT_MS) -> int:
        """Apply what every subscriber has ready (waiting up to `timeout_ms` if none has);
        returns the number of batches seen."""
        num_batches = 0
        router = self.router
        now = time.monotonic()
        for instance_id, subscriber in self.subscribers.items():
            num_lost = subscriber.num_lost
            items = subscriber.poll(0)
            if items:
                self._last_heard_s[instance_id] = now
            elif now - self._last_heard_s[instance_id] >= self._tail_interval_s(subscriber):
                # A quiet stream: batches lost at its very end show no gap until the next
                # one, which an idle engine may never send (subscriber.check_tail).
                self._last_heard_s[instance_id] = now
                items = subscriber.check_tail()
            with self.lock:
                accounted = 0
                for item in items:
                    if item.num_lost_before:
                        router.mark_lost(instance_id)  # clear first: what follows is real
                        accounted += item.num_lost_before
                    router.apply_batch(instance_id, item.seq, item.batch)
                    self.num_events_applied[instance_id] += len(item.batch.events)
                if subscriber.num_lost - num_lost > accounted:
                    router.mark_lost(instance_id)
                router.set_connected(instance_id, subscriber.connected is not False)
                router.set_down(instance_id, self._down_reason(instance_id, subscriber))
                self.applied_seq[instance_id] = subscriber.last_seq
            num_batches += len(items)
        with self.lock:
            router.expire_down()
            router.maybe_recover(resync_inexact=False)
            inexact = [i for i, state in router.states.items() if not state.exact]
        if inexact and not router.degraded:
            self._resync(inexact)
        if not num_batches and timeout_ms:
            self._wait(timeout_ms)
        return num_batches

    def _tail_interval_s(self, subscriber: Any) -> float:
        """How long a stream stays quiet before its tail is checked: the retry interval (at
        least one idle wait), doubled per unanswered check up to 32x, so a replay endpoint
        that does not answer costs the feed one timeout per 32 intervals, not per interval."""
        base_s = max(self.router.retry_interval_s, _IDLE_WAIT_MS / 1000)
        return base_s * 2 ** min(subscriber.num_tail_unanswered, 5)

    def _down_reason(self, instance_id: str, subscriber: Any) -> str | None:
        if subscriber.connected is False:
            if self.router.states[instance_id].ever_live:
                return "disconnected"
            waited = time.monotonic() - self._started_s
            return NOT_CONNECTED_YET if waited < (self.stale_after_s or 5.0) else NEVER_CONNECTED
        if subscriber.suspect_restart:
            return "reconnected; restart not yet resolved"
        failure = self.health_failures.get(instance_id)
        if failure is not None:
            return f"health check failed: {failure}"
        return None

    def _check_health(self) -> None:
        """Poll every instance's `health_url` (its own thread: a slow engine costs no feed
        time); a failure is reported to the feed, which declares the instance down."""
        import urllib.error
        import urllib.request

        interval = min(1.0, self.stale_after_s or 1.0)
        while not self._stop.wait(interval):
            for instance_id, url in self.health_urls.items():
                try:
                    with urllib.request.urlopen(url, timeout=_HEALTH_TIMEOUT_S) as response:
                        failure = None if response.status == 200 else f"HTTP {response.status}"
                except urllib.error.HTTPError as exc:
                    failure = f"HTTP {exc.code}"
                except (OSError, ValueError) as exc:
                    failure = str(getattr(exc, "reason", exc))
                if failure is None:
                    self.health_failures.pop(instance_id, None)
                else:
                    self.health_failures[instance_id] = f"{url}: {failure}"

    def _resync(self, inexact: list[str]) -> None:
        """Ask inexact instances for a snapshot (at most once per retry interval), off the
        lock: a publisher that does not answer costs the feed its timeout, not the API."""
        now = time.monotonic()
        if now - self._last_resync_s < self.router.retry_interval_s:
            return
        self._last_resync_s = now
        for instance_id in inexact:
            snapshot = self.subscribers[instance_id].sync_batch()
            if snapshot is not None and snapshot.snapshot_next_seq is not None:
                with self.lock:
                    self.router.apply_batch(instance_id, snapshot.snapshot_next_seq, snapshot)

    def _wait(self, timeout_ms: int) -> None:
        import zmq

        poller = zmq.Poller()
        for subscriber in self.subscribers.values():
            for socket in subscriber.poll_sockets:
                poller.register(socket, zmq.POLLIN)
        poller.poll(timeout_ms)

    def caught_up(self, targets: dict[str, int]) -> bool:
        """Whether the router has seen every instance's batches up to `targets[i]`."""
        applied = self.applied_seq
        for instance_id, seq in targets.items():
            last = applied.get(instance_id)
            if last is None or last < seq:
                return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the feed must outlive one bad iteration
                logger.exception("router event feed: an iteration failed; continuing")
                time.sleep(0.1)
