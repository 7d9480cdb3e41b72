"""The feeds' threading model (issue 24): once the feed thread runs, the subscribers' ZeroMQ
sockets are its own. A snapshot asked for from another thread (an HTTP handler) is refused
instead of racing the thread's polls, while the router's own calls from that thread still work
(they use no socket). Real threads, real sockets on loopback."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("zmq")

from pagedkv.errors import ThreadOwnershipError  # noqa: E402
from pagedkv.router import Router  # noqa: E402
from pagedkv.router.feeds import EventFeeds  # noqa: E402
from pagedkv.router.service_config import InstanceConfig  # noqa: E402
from tests.support.redis_server import free_port  # noqa: E402


def make_feeds() -> tuple[Router, EventFeeds]:
    port, replay_port = free_port(), free_port()
    instance = InstanceConfig(
        "gpu0", f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    router = Router(["gpu0"])
    feeds = EventFeeds(router, [instance], replay_timeout_s=0.2)
    router.snapshot_source = feeds.snapshot_source
    return router, feeds


def test_before_start_any_thread_may_recover():
    router, feeds = make_feeds()
    try:
        # Not started: the caller is the only user of the sockets; no publisher answers.
        assert feeds.snapshot_source("gpu0") is None
    finally:
        feeds.close()


def test_after_start_another_thread_is_refused_and_calls_do_not_recover():
    router, feeds = make_feeds()
    feeds.start()
    try:
        errors: list[BaseException] = []

        def handler() -> None:  # what an HTTP handler thread would do
            try:
                feeds.snapshot_source("gpu0")
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        thread = threading.Thread(target=handler, name="http-handler")
        thread.start()
        thread.join(timeout=10)
        assert len(errors) == 1 and isinstance(errors[0], ThreadOwnershipError)
        assert errors[0].owner_thread == "pagedkv-router-feeds"
        assert errors[0].calling_thread == "http-handler"
        assert "'gpu0'" in str(errors[0])
        with pytest.raises(ThreadOwnershipError):
            feeds.snapshot_source("gpu0")  # the main thread is not the owner either
        # The router's own calls from this thread (claiming the index included) use no socket.
        with feeds.lock:
            assert router.score([1, 2], ["gpu0"]) == {"gpu0": 0}
    finally:
        feeds.close()
