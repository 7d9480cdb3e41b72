"""One conformance suite for every prefix-index backend: in-memory and Redis (a real server)."""

from __future__ import annotations

import itertools

import pytest

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, InvalidArgumentError
from pagedkv.router import InMemoryPrefixIndex
from tests.support.redis_server import redis_server  # noqa: F401 - fixture

_namespaces = itertools.count()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def index(request):
    if request.param == "memory":
        yield InMemoryPrefixIndex()
        return
    server = request.getfixturevalue("redis_server")
    from pagedkv.router import RedisPrefixIndex

    backend = RedisPrefixIndex(server.url, namespace=f"conformance{next(_namespaces)}")
    yield backend
    backend.drop_namespace()


def stored(hashes, medium="GPU", group=0, parent=None):
    return BlockStored(list(hashes), parent, [], 4, None, medium, group_idx=group)


def test_stores_removes_and_counts_copies(index):
    index.apply_events(
        "a",
        [
            stored([1, 2, 3]),
            stored([1], medium="CPU"),
            stored([2]),  # a second block with hash 2
            BlockRemoved([3], "GPU", 0),
            stored([7], group=1),
        ],
    )
    assert index.instance_contents("a") == {
        ("GPU", 0, 1): 1,
        ("GPU", 0, 2): 2,
        ("CPU", 0, 1): 1,
        ("GPU", 1, 7): 1,
    }
    index.apply_events("a", [BlockRemoved([2], "GPU", 0), BlockRemoved([7], "GPU", 1)])
    assert index.instance_contents("a") == {("GPU", 0, 1): 1, ("GPU", 0, 2): 1, ("CPU", 0, 1): 1}
    assert index.num_unknown_removals == 0
    index.apply_events("a", [BlockRemoved([99], "GPU", 0), BlockRemoved([1], "GPU", 5)])
    assert index.num_unknown_removals == 2
    assert index.instance_contents("a") == {("GPU", 0, 1): 1, ("GPU", 0, 2): 1, ("CPU", 0, 1): 1}


def test_match_lengths_count_consecutive_leading_hits(index):
    index.apply_events("a", [stored([1, 2, 3])])
    index.apply_events("b", [stored([1, 2]), stored([4])])
    index.apply_events("c", [stored([2, 3]), stored([1], medium="CPU")])
    assert index.match_lengths([1, 2, 3, 4], ["a", "b", "c", "d"]) == {
        "a": 3,
        "b": 2,
        "c": 3,
        "d": 0,
    }
    assert index.match_lengths([1, 2, 3, 4], ["a", "b", "c"], media={"GPU"}) == {
        "a": 3,
        "b": 2,
        "c": 0,
    }
    assert index.match_lengths([1, 2, 3], ["c"], media={"CPU"}) == {"c": 1}
    assert index.match_lengths([5, 1], ["a", "b"]) == {"a": 0, "b": 0}
    assert index.match_lengths([], ["a"]) == {"a": 0}


def test_long_requests_are_scored_across_lookup_chunks(index):
    hashes = list(range(1000, 1200))
    index.apply_events("a", [stored(hashes)])
    index.apply_events("b", [stored(hashes[:130])])
    assert index.match_lengths(hashes, ["a", "b"]) == {"a": 200, "b": 130}


def test_all_blocks_cleared_clears_one_instance(index):
    index.apply_events("a", [stored([1, 2])])
    index.apply_events("b", [stored([1, 2])])
    index.apply_events("a", [AllBlocksCleared(), stored([9])])
    assert index.instance_contents("a") == {("GPU", 0, 9): 1}
    assert index.instance_contents("b") == {("GPU", 0, 1): 1, ("GPU", 0, 2): 1}
    assert index.match_lengths([1, 2], ["a", "b"]) == {"a": 0, "b": 2}
    index.clear_instance("b")
    assert index.instance_contents("b") == {}
    assert index.match_lengths([1], ["a", "b"]) == {"a": 0, "b": 0}


def test_digest_hashes_and_none_medium_or_group(index):
    digest = bytes(range(32))
    index.apply_events("a", [BlockStored([digest], None, [], 4, None, None)])
    assert index.instance_contents("a") == {(None, None, digest): 1}
    assert index.match_lengths([digest], ["a"]) == {"a": 1}


def test_bad_instance_ids_are_rejected(index):
    for bad in ("", "a|b", 3):
        with pytest.raises(InvalidArgumentError, match="instance id"):
            index.apply_events(bad, [stored([1])])
    assert index.match_lengths([1], ["a"]) == {"a": 0}


def test_copies_survive_a_second_table_and_a_clear(index):
    # One table with a duplicate, then a second (medium, group): the in-memory index changes
    # layout there; the contents must not change with it.
    index.apply_events("a", [stored([1, 2]), stored([2]), BlockRemoved([9], "GPU", 0)])
    assert index.instance_contents("a") == {("GPU", 0, 1): 1, ("GPU", 0, 2): 2}
    index.apply_events("a", [BlockRemoved([2], "CPU", 0), stored([2, 3], medium="CPU")])
    index.apply_events("a", [BlockRemoved([2], "GPU", 0)])
    assert index.instance_contents("a") == {
        ("GPU", 0, 1): 1,
        ("GPU", 0, 2): 1,
        ("CPU", 0, 2): 1,
        ("CPU", 0, 3): 1,
    }
    assert index.match_lengths([1, 2, 3], ["a"], media={"CPU"}) == {"a": 0}
    assert index.num_unknown_removals == 2
    index.apply_events("a", [AllBlocksCleared(), stored([5], group=1), stored([5], group=1)])
    assert index.instance_contents("a") == {("GPU", 1, 5): 2}
    index.apply_events("a", [BlockRemoved([5], "GPU", 1), BlockRemoved([5], "GPU", 1)])
    assert index.instance_contents("a") == {} and index.match_lengths([5], ["a"]) == {"a": 0}
    if isinstance(index, InMemoryPrefixIndex):
        index.check_invariants()
