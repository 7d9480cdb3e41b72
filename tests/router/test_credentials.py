"""Credentials never appear in a message or a log line: a Redis URL with a password (wrong or
right) given to `simulate --index` or to the router service, a router URL with user info.
Against a real redis-server that requires a password."""

from __future__ import annotations

import json
import logging

import pytest

from pagedkv.cli import main
from pagedkv.credentials import redact
from tests.support.redis_server import RedisServer, import_redis

SECRET = "s3cret-wrong"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "--index redis://:s3cret@127.0.0.1:6379: refused",
            "--index redis://***@127.0.0.1:6379: refused",
        ),
        ("redis://bob:s3cret@h:1/0", "redis://bob:***@h:1/0"),
        ("rediss://token@h", "rediss://***@h"),
        ("got 'redis//:s3cret@x'", "got 'redis//***@x'"),  # a typo in the scheme
        ("redis://h:1/0?password=s3cret&db=1", "redis://h:1/0?password=***&db=1"),
        ("http://u:p@ss@h/x", "http://u:***@h/x"),  # an unencoded "@" in the password
        ("e-mail a@b.c, http://h:1/x, no=secret", "e-mail a@b.c, http://h:1/x, no=secret"),
    ],
)
def test_redact_hides_passwords_and_keeps_the_rest(text, expected):
    assert redact(text) == expected


@pytest.fixture
def locked_redis(tmp_path):
    import_redis()
    server = RedisServer(tmp_path, password="right-one")
    server.start()
    yield server
    server.stop()


def test_simulate_index_with_a_wrong_password_says_so_without_it(locked_redis, capsys):
    url = f"redis://:{SECRET}@127.0.0.1:{locked_redis.port}/0"
    argv = ["simulate", "--workload", "chat", "--num-requests", "4", "--instances", "2",
            "--index", url]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert SECRET not in captured.err + captured.out
    assert captured.err == (
        f"pagedkv simulate: error: --index redis://***@127.0.0.1:{locked_redis.port}/0: Redis "
        "index unavailable: invalid username-password pair or user is disabled.\n"
    )


def test_simulate_index_report_hides_the_right_password(locked_redis, capsys):
    url = f"redis://:right-one@127.0.0.1:{locked_redis.port}/0"
    argv = ["simulate", "--workload", "chat", "--num-requests", "6", "--instances", "2",
            "--router", "prefix-aware", "--index", url, "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "right-one" not in captured.out + captured.err
    report = json.loads(captured.out)
    assert report["config"]["index"] == f"redis://***@127.0.0.1:{locked_redis.port}/0"
    assert report["results"][0]["routing"]["fallback_decisions"] == 0  # it did log in


def test_router_service_banner_health_errors_and_logs_hide_the_password(locked_redis, caplog):
    pytest.importorskip("aiohttp")
    pytest.importorskip("zmq")
    from pagedkv.router.index import IndexUnavailableError
    from pagedkv.router.service import RouterService
    from pagedkv.router.service_config import InstanceConfig, ServiceConfig

    url = f"redis://user:{SECRET}@127.0.0.1:{locked_redis.port}/0"
    config = ServiceConfig(instances=(InstanceConfig("a", "inproc://cred-a"),), index=url)
    service = RouterService(config)
    try:
        caplog.set_level(logging.DEBUG)
        with pytest.raises(IndexUnavailableError) as caught:
            service.score({"token_ids": list(range(32))})
        shown = [service.describe(), json.dumps(service.health()), str(caught.value)]
        shown += [record.getMessage() for record in caplog.records]
        assert any("prefix index unavailable" in line for line in shown)  # it was logged
        for line in shown:
            assert SECRET not in line, line
        assert f"redis://user:***@127.0.0.1:{locked_redis.port}/0" in shown[0]
        assert service.health()["index"] == f"redis://user:***@127.0.0.1:{locked_redis.port}/0"
    finally:
        service.feeds.close()


def test_router_serve_refusals_hide_the_password(capsys):
    pytest.importorskip("aiohttp")
    argv = ["router", "serve", "--instance", "a=tcp://127.0.0.1:1", "--index",
            f"redis//:{SECRET}@host"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "redis//***@host" in err


def test_router_client_url_with_user_info_is_hidden():
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.router.client import RouterClient

    with pytest.raises(InvalidArgumentError) as caught:
        RouterClient(f"https://bob:{SECRET}@h:1")
    assert SECRET not in str(caught.value) and "bob:***@h" in str(caught.value)
    assert RouterClient(f"http://bob:{SECRET}@h:1").url == "http://bob:***@h:1"
