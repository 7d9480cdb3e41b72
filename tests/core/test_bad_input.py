"""Misuse: every case raises a specific PagedKVError naming the bad value, and leaves the whole
manager state (free order, every block, every table, pending events, stats) exactly as it was."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pagedkv import (
    BlockPool,
    ConfigError,
    ForeignBlockError,
    FullAttentionSpec,
    GroupIndexError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MultiModalFeature,
    PagedKVError,
    Request,
    RequestStateError,
    RequestStatus,
    UnknownHashAlgorithmError,
    make_request_block_hasher,
)
from tests.support.builders import admit, full_config, make_manager, make_request, snapshot

COMMON = [i for i in range(3) for _ in range(16)]
MAX_MODEL_LEN = 256


@dataclass
class Ctx:
    """A busy manager: a live request, a freed cached request, pending events, stats."""

    manager: KVCacheManager
    live: Request  # holds blocks 1..4 (1..3 cached)
    done: Request  # freed; its blocks 5, 6 are cached and free

    @property
    def pool(self) -> BlockPool:
        return self.manager.block_pool


@pytest.fixture
def ctx() -> Ctx:
    manager = make_manager(
        11, 16, max_model_len=MAX_MODEL_LEN, enable_kv_cache_events=True, log_stats=True
    )
    live = make_request("live", COMMON + [3] * 7)
    _, hits = admit(manager, live)
    manager.record_prefix_cache_stats(live, hits)
    done = make_request("done", [9] * 40)
    admit(manager, done)
    manager.free(done)
    done.status = RequestStatus.FINISHED_STOPPED
    assert manager.block_pool.kv_event_queue  # events are pending
    manager.check_invariants()
    return Ctx(manager, live, done)


def fresh(request_id: str = "new", tokens=None, **kwargs) -> Request:
    return make_request(request_id, COMMON + [5] if tokens is None else tokens, **kwargs)


# ---------------------------------------------------------------------------- the cases
# Each case: (name, exception type, regex the message must match, action(ctx)).


def other_requests_hits(c: Ctx):
    other = fresh("other", COMMON + [6])
    hits, num_hit_tokens, _ = c.manager.get_computed_blocks(other)
    assert num_hit_tokens == 48
    c.manager.allocate_slots(fresh("mine", [4] * 60), 12, num_hit_tokens, hits)


def foreign_pool_hits(c: Ctx):
    other_manager = make_manager(11, 16, max_model_len=MAX_MODEL_LEN)
    admit(other_manager, make_request("x", COMMON + [1]))
    req = fresh()
    hits, num_hit_tokens, _ = other_manager.get_computed_blocks(req)
    assert num_hit_tokens == 48
    c.manager.allocate_slots(req, 1, num_hit_tokens, hits)


def too_many_hit_blocks(c: Ctx):
    req = fresh()
    hits, num_hit_tokens, _ = c.manager.get_computed_blocks(req)
    assert num_hit_tokens == 48
    c.manager.allocate_slots(req, 33, 16, hits)  # 3 hit blocks but only 16 hit tokens


def too_few_hit_blocks(c: Ctx):
    req = fresh()
    hits, _, _ = c.manager.get_computed_blocks(req)
    c.manager.allocate_slots(req, 1, 64, hits)


def hits_for_running_request(c: Ctx):
    hits, num_hit_tokens, _ = c.manager.get_computed_blocks(c.live)
    c.manager.allocate_slots(c.live, 1, num_hit_tokens, hits)


def hit_tokens_without_blocks(c: Ctx):
    c.manager.allocate_slots(fresh(), 1, 48)


def wrong_group_count(c: Ctx):
    req = fresh()
    hits, num_hit_tokens, _ = c.manager.get_computed_blocks(req)
    two_groups = KVCacheBlocks((hits.blocks[0], ()))
    c.manager.allocate_slots(req, 1, num_hit_tokens, two_groups)


def reused_request_id(c: Ctx):
    impostor = make_request("live", [1] * 20)
    c.manager.allocate_slots(impostor, 20)


def set_status_and_allocate(status):
    def action(c: Ctx):
        c.done.status = status
        c.manager.allocate_slots(c.done, 1)

    return action


def no_block_hasher(c: Ctx):
    c.manager.allocate_slots(fresh("plain", hashed=False), 10)


def hasher_block_size_mismatch(c: Ctx):
    req = Request("mismatch", [1] * 20, block_hasher=make_request_block_hasher(8))
    c.manager.allocate_slots(req, 20)


def append_and_check_request_unchanged(bad) -> Callable[[Ctx], None]:
    def action(c: Ctx):
        tokens, hashes = list(c.live.all_token_ids), list(c.live.block_hashes)
        num_tokens = c.live.num_tokens
        try:
            c.live.append_output_token_ids(bad)
        finally:
            assert c.live.all_token_ids == tokens and c.live.block_hashes == hashes
            assert c.live.num_tokens == num_tokens

    return action


def evict_out_of_range(c: Ctx):
    c.manager.evict_blocks({5, 11})


def evict_negative(c: Ctx):
    c.manager.evict_blocks([6, -1])


def cache_past_num_tokens(c: Ctx):
    c.manager.cache_blocks(c.live, 56)


def cache_unknown_request(c: Ctx):
    c.manager.cache_blocks(fresh("ghost"), 16)


def group_index_out_of_range(index):
    def action(c: Ctx):
        c.manager.get_blocks("live").get_block_ids(group_ids=[0, index])

    return action


CASES = [
    # (name, exception, message regex, action)
    (
        "zero tokens",
        InvalidArgumentError,
        r"num_new_tokens must be greater than 0",
        lambda c: c.manager.allocate_slots(fresh(), 0),
    ),
    (
        "negative num_new_tokens",
        InvalidArgumentError,
        r"num_new_tokens.*-5",
        lambda c: c.manager.allocate_slots(fresh(), -5),
    ),
    (
        "negative num_new_computed_tokens",
        InvalidArgumentError,
        r"num_new_computed_tokens.*-16",
        lambda c: c.manager.allocate_slots(fresh(), 1, -16),
    ),
    (
        "negative lookahead",
        InvalidArgumentError,
        r"num_lookahead_tokens.*-2",
        lambda c: c.manager.allocate_slots(c.live, 1, num_lookahead_tokens=-2),
    ),
    (
        "negative external",
        InvalidArgumentError,
        r"num_external_computed_tokens.*-3",
        lambda c: c.manager.allocate_slots(fresh(), 1, num_external_computed_tokens=-3),
    ),
    (
        "negative encoder tokens",
        InvalidArgumentError,
        r"num_encoder_tokens.*-1",
        lambda c: c.manager.allocate_slots(fresh(), 1, num_encoder_tokens=-1),
    ),
    (
        "negative reserved_blocks",
        InvalidArgumentError,
        r"reserved_blocks.*-1",
        lambda c: c.manager.allocate_slots(fresh(), 10, reserved_blocks=-1),
    ),
    (
        "float num_new_tokens",
        InvalidTypeError,
        r"num_new_tokens.*2\.5",
        lambda c: c.manager.allocate_slots(fresh(), 2.5),
    ),
    (
        "bool num_new_tokens",
        InvalidTypeError,
        r"num_new_tokens.*True",
        lambda c: c.manager.allocate_slots(fresh(), True),
    ),
    ("not a request", InvalidTypeError, r"str", lambda c: c.manager.allocate_slots("live", 1)),
    (
        "past max_model_len (new)",
        InvalidArgumentError,
        r"300 tokens.*max_model_len 256",
        lambda c: c.manager.allocate_slots(fresh("long", [1] * 300), 300),
    ),
    (
        "past max_model_len (running)",
        InvalidArgumentError,
        r"'live': 257 tokens.*256",
        lambda c: c.manager.allocate_slots(c.live, 202),
    ),
    (
        "past max_model_len (external)",
        InvalidArgumentError,
        r"external 250.*max_model_len 256",
        lambda c: c.manager.allocate_slots(fresh(), 10, num_external_computed_tokens=250),
    ),
    (
        "hits from another pool",
        ForeignBlockError,
        r"hit block 1 .*not belong to this",
        foreign_pool_hits,
    ),
    ("another request's hits", ForeignBlockError, r"hit block 1 .*'mine'", other_requests_hits),
    (
        "more hit blocks than hit tokens",
        InvalidArgumentError,
        r"num_new_computed_tokens=16",
        too_many_hit_blocks,
    ),
    (
        "fewer hit blocks than hit tokens",
        InvalidArgumentError,
        r"num_new_computed_tokens=64",
        too_few_hit_blocks,
    ),
    (
        "hits for a running request",
        RequestStateError,
        r"'live' already has computed tokens",
        hits_for_running_request,
    ),
    (
        "hit tokens without blocks",
        InvalidArgumentError,
        r"num_new_computed_tokens=48",
        hit_tokens_without_blocks,
    ),
    ("hits with the wrong group count", GroupIndexError, r"2 groups", wrong_group_count),
    (
        "finished (stopped) request",
        RequestStateError,
        r"'done' is FINISHED_STOPPED",
        set_status_and_allocate(RequestStatus.FINISHED_STOPPED),
    ),
    (
        "finished (aborted) request",
        RequestStateError,
        r"'done' is FINISHED_ABORTED",
        set_status_and_allocate(RequestStatus.FINISHED_ABORTED),
    ),
    ("reused request id", RequestStateError, r"'live' is reused", reused_request_id),
    (
        "no block hasher with caching on",
        RequestStateError,
        r"'plain' has no block hasher",
        no_block_hasher,
    ),
    (
        "hasher block size mismatch",
        ConfigError,
        r"blocks of 8 tokens.*needs 16",
        hasher_block_size_mismatch,
    ),
    ("append a float token", InvalidTypeError, r"1\.5", append_and_check_request_unchanged(1.5)),
    (
        "append a str token in a list",
        InvalidTypeError,
        r"position 1 is 'x'",
        append_and_check_request_unchanged([3, "x"]),
    ),
    (
        "append None in a list",
        InvalidTypeError,
        r"position 2 is None",
        append_and_check_request_unchanged([3, 4, None]),
    ),
    ("append a bool", InvalidTypeError, r"True", append_and_check_request_unchanged(True)),
    (
        "append a bool in a list",
        InvalidTypeError,
        r"position 1 is True \(bool\)",
        append_and_check_request_unchanged([1, True]),
    ),
    ("append a str", InvalidTypeError, r"'abc'", append_and_check_request_unchanged("abc")),
    (
        "append a negative token",
        InvalidArgumentError,
        r"-1",
        append_and_check_request_unchanged(-1),
    ),
    (
        "append a too-large token",
        InvalidArgumentError,
        r"4294967296",
        append_and_check_request_unchanged([1, 2**32]),
    ),
    (
        "append to a finished request",
        RequestStateError,
        r"'done' is FINISHED_STOPPED",
        lambda c: c.done.append_output_token_ids(1),
    ),
    ("evict an out-of-range id", InvalidArgumentError, r"block id 11 ", evict_out_of_range),
    ("evict a negative id", InvalidArgumentError, r"block id -1 ", evict_negative),
    (
        "cache past num_tokens",
        InvalidArgumentError,
        r"cannot cache 56 tokens.*has 55",
        cache_past_num_tokens,
    ),
    (
        "cache for a request without blocks",
        RequestStateError,
        r"'ghost' holds no blocks",
        cache_unknown_request,
    ),
    (
        "negative remove_skipped_blocks",
        InvalidArgumentError,
        r"processed_computed_tokens.*-4",
        lambda c: c.manager.remove_skipped_blocks("live", -4),
    ),
    ("group index too large", GroupIndexError, r"group index 1 ", group_index_out_of_range(1)),
    ("negative group index", GroupIndexError, r"group index -1 ", group_index_out_of_range(-1)),
    ("pool: negative allocation", InvalidArgumentError, r"-2", lambda c: c.pool.get_new_blocks(-2)),
    (
        "pool: allocation past free",
        InvalidArgumentError,
        r"cannot allocate 7 blocks: only 6",
        lambda c: c.pool.get_new_blocks(7),
    ),
]


@pytest.mark.parametrize(
    ("exc_type", "pattern", "action"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_misuse_raises_and_leaves_state_unchanged(ctx, exc_type, pattern, action):
    before = snapshot(ctx.manager)
    with pytest.raises(exc_type, match=pattern) as info:
        action(ctx)
    assert isinstance(info.value, PagedKVError)
    assert snapshot(ctx.manager) == before
    ctx.manager.check_invariants()


def test_stale_hits_evicted_since_lookup(ctx):
    """A lookup result whose blocks were reused (and re-cached) before allocation is refused."""
    manager = ctx.manager
    manager.free(ctx.live)
    req = fresh("late", COMMON + [8])
    hits, num_hit_tokens, _ = manager.get_computed_blocks(req)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hit_tokens == 48
    # Another request takes every free block: 1, 2 and 3 are evicted and re-cached.
    hog = fresh("hog", [77] * 160)
    assert len(admit(manager, hog)[0]) == 10
    assert manager.block_pool.blocks[1].block_hash not in req.block_hashes
    before = snapshot(manager)
    with pytest.raises(ForeignBlockError, match=r"hit block \d+ \(position \d, group 0\).*stale"):
        manager.allocate_slots(req, 1, num_hit_tokens, hits)
    assert snapshot(manager) == before
    manager.check_invariants()


def test_stale_hits_evicted_but_not_reused(ctx):
    """Hits dropped from the cache by evict_blocks since the lookup are refused too."""
    manager = ctx.manager
    req = fresh("late", COMMON + [8])
    hits, num_hit_tokens, _ = manager.get_computed_blocks(req)
    manager.evict_blocks({2})
    before = snapshot(manager)
    with pytest.raises(ForeignBlockError, match=r"hit block 2 \(position 1"):
        manager.allocate_slots(req, 1, num_hit_tokens, hits)
    assert snapshot(manager) == before


def test_there_are_at_least_fifteen_cases():
    assert len(CASES) >= 15


# ---------------------------------------------------------------------------- silent no-ops


def test_free_unknown_request_is_silent(ctx):
    before = snapshot(ctx.manager)
    ctx.manager.free(fresh("nobody"))
    assert snapshot(ctx.manager) == before


def test_free_with_impostor_object_is_silent(ctx):
    """A different Request reusing a live id does not free the live request's blocks."""
    before = snapshot(ctx.manager)
    ctx.manager.free(make_request("live", [1, 2, 3]))
    assert snapshot(ctx.manager) == before


def test_pop_blocks_for_free_with_impostor_object_is_silent(ctx):
    """As `free`: a different Request reusing a live id pops nothing of the live request."""
    before = snapshot(ctx.manager)
    assert ctx.manager.pop_blocks_for_free(make_request("live", [1, 2, 3])) == []
    assert snapshot(ctx.manager) == before


def test_reused_id_after_free_is_allowed(ctx):
    ctx.manager.free(ctx.live)
    again = make_request("live", [4] * 20)
    assert ctx.manager.allocate_slots(again, 20) is not None
    ctx.manager.check_invariants()


# ---------------------------------------------------------------------------- construction


def spec(block_size=16):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=1)


@pytest.mark.parametrize("num_blocks", [1, 0, -1])
def test_too_few_blocks(num_blocks):
    with pytest.raises(ConfigError, match=f"num_blocks={num_blocks}"):
        KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l",), spec()),))
    with pytest.raises(ConfigError, match=f"num_blocks={num_blocks}"):
        BlockPool(num_blocks)


@pytest.mark.parametrize("num_blocks", [2.0, "11", True])
def test_non_int_num_blocks(num_blocks):
    with pytest.raises(ConfigError, match=re.escape(repr(num_blocks))):
        KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l",), spec()),))


@pytest.mark.parametrize("block_size", [0, -16, 1.5, None])
def test_bad_block_size(block_size):
    with pytest.raises(
        ConfigError, match=re.escape(f"block_size must be a positive int, got {block_size!r}")
    ):
        spec(block_size)


@pytest.mark.parametrize("block_size", [0, -4])
def test_bad_pool_hash_block_size(block_size):
    with pytest.raises(ConfigError, match=str(block_size)):
        BlockPool(4, hash_block_size=block_size)


@pytest.mark.parametrize("name", ["md5", "sha512", "xxh64"])
def test_unknown_hash_algorithm(name):
    with pytest.raises(UnknownHashAlgorithmError, match=repr(name)) as info:
        make_request_block_hasher(16, name)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("watermark", [-0.1, 1.0, 1.5, math.nan, "0.1", None])
def test_watermark_outside_unit_interval(watermark):
    with pytest.raises(InvalidArgumentError, match=re.escape(f"got {watermark!r}")):
        make_manager(11, 16, watermark=watermark)


@pytest.mark.parametrize("max_model_len", [0, -1])
def test_bad_max_model_len(max_model_len):
    with pytest.raises(
        InvalidArgumentError, match=f"max_model_len must be >= 1, got {max_model_len}"
    ):
        make_manager(11, 16, max_model_len=max_model_len)


def test_hash_block_size_must_equal_block_size_with_one_group():
    with pytest.raises(
        ConfigError, match=r"hash_block_size \(8\) must equal the block size \(16\)"
    ):
        KVCacheManager(full_config(11, 16), 128, hash_block_size=8)


def test_scheduler_block_size_must_be_a_multiple():
    with pytest.raises(ConfigError, match="block size 16 does not divide scheduler_block_size 24"):
        KVCacheManager(full_config(11, 16), 128, scheduler_block_size=24, hash_block_size=8)


def test_config_must_be_a_kv_cache_config():
    with pytest.raises(ConfigError, match="'not a config'"):
        KVCacheManager("not a config", 128)


# ---------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("tokens", "exc_type", "pattern"),
    [
        ([1, 2.0], InvalidTypeError, r"position 1 is 2\.0 \(float\)"),
        ([1, "2"], InvalidTypeError, r"position 1 is '2'"),
        ([None], InvalidTypeError, r"position 0 is None"),
        ([5, -1], InvalidArgumentError, r"position 1 is -1"),
        ([2**32], InvalidArgumentError, r"position 0 is 4294967296"),
        ([], InvalidArgumentError, r"'r': the prompt has no tokens"),
        ([True, False, True], InvalidTypeError, r"position 0 is True \(bool\)"),
        ([7, 1, 0, False], InvalidTypeError, r"position 3 is False \(bool\)"),
        # Many 0s and 1s (ids a bool could hide among), then a bool far down the prompt.
        ([0, 1] * 5000 + [True], InvalidTypeError, r"position 10000 is True \(bool\)"),
        ([256, 0] + [5] * 10 + [False], InvalidTypeError, r"position 12 is False"),
    ],
)
def test_bad_prompt_tokens(tokens, exc_type, pattern):
    with pytest.raises(exc_type, match=pattern):
        Request("r", tokens, block_hasher=make_request_block_hasher(16))


@pytest.mark.parametrize("request_id", ["", None, 7])
def test_bad_request_id(request_id):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(request_id))):
        Request(request_id, [1])


def test_bad_max_tokens():
    with pytest.raises(InvalidArgumentError, match="max_tokens=-1"):
        Request("r", [1], max_tokens=-1)


def test_mm_feature_past_prompt():
    with pytest.raises(InvalidArgumentError, match="'img' ends at 12, past the 10-token prompt"):
        Request("r", list(range(10)), mm_features=[MultiModalFeature("img", 8, 4)])


@pytest.mark.parametrize(("offset", "length"), [(-1, 4), (0, 0)])
def test_bad_mm_feature(offset, length):
    with pytest.raises(InvalidArgumentError, match="'img'"):
        MultiModalFeature("img", offset, length)


def test_prompt_embeds_not_a_buffer():
    with pytest.raises(InvalidTypeError, match="list"):
        Request("r", [1, 2], prompt_embeds=[[0.0], [1.0]])


def test_zeros_and_ones_are_token_ids_not_bools():
    prompt = [0, 1, 256, 0, 65536, 1] * 50  # aligned and misaligned 0/1 byte patterns
    request = Request("r", prompt, block_hasher=make_request_block_hasher(16))
    assert request.prompt_token_ids == prompt
