"""`pagedkv events listen`: prints live events (gaps filled by replay) and stops on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pagedkv.cli import main  # noqa: E402
from pagedkv.wire.transport import ZmqEventPublisher  # noqa: E402
from tests.support.paths import SRC_DIR

SRC = SRC_DIR


def test_listen_prints_one_line_per_event_with_replayed_gap(capsys):
    with ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as publisher:
        publisher.publish([BlockStored([0xABC, 0xDEF], None, [1] * 8, 4, None, "GPU", group_idx=0)])
        publisher.publish([BlockRemoved([0xABC], "GPU", 0)])
        deadline = time.monotonic() + 5
        while publisher.sent_batches < 2:  # both gone before the listener subscribes
            assert time.monotonic() < deadline
            time.sleep(0.005)

        def late() -> None:  # sent after the listener subscribed: reveals the gap 0..1
            time.sleep(0.4)
            publisher.publish([AllBlocksCleared()])

        thread = threading.Thread(target=late)
        thread.start()
        code = main(
            [
                "events", "listen", publisher.endpoint.replace("0.0.0.0", "127.0.0.1"),
                "--replay", publisher.replay_endpoint, "--max-batches", "3", "--timeout-s", "5",
            ]
        )  # fmt: skip
        thread.join()
    out, err = capsys.readouterr()
    assert code == 0
    assert out.splitlines() == [
        "seq=0 BlockStored group=0 medium=GPU block_size=4 parent=- "
        "hashes=[0000000000000abc,0000000000000def] num_tokens=8",
        "seq=1 BlockRemoved group=0 medium=GPU hashes=[0000000000000abc]",
        "seq=2 AllBlocksCleared",
    ]
    assert "3 batches; gaps 1, replayed 3" in err  # the replay answer holds batch 2 too


def test_listen_exits_cleanly_on_ctrl_c():
    env = dict(os.environ, PYTHONPATH=str(SRC))
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", "events", "listen", "tcp://127.0.0.1:1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr.readline().startswith("listening to tcp://127.0.0.1:1")
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert "0 batches" in err and "Traceback" not in err
