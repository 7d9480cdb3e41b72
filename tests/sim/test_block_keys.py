"""Block keys from token runs (`pagedkv.sim.inputs.block_keys`) against hashing every token.

Keys must be equal exactly when the token-hash keys are, so replay gives the same hits with
either; the shipped sample's hit counts were recorded with the token-hash replay before the
keyed one existed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.hashing import make_request_block_hasher
from pagedkv.request import Request
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import DEFAULT_PROFILE, get_profile
from pagedkv.sim.inputs.block_keys import TraceBlockKeys, canonical_runs, runs_of_token_ids
from pagedkv.sim.inputs.traces import OUTPUT_TOKEN_BASE, Trace, TraceRequest, load_trace
from pagedkv.sim.replay import replay
from pagedkv.sim.serve import ServeConfig, simulate_serving
from pagedkv.specs import cdiv
from tests.support.paths import DATA_DIR

DATA = DATA_DIR

# Hit tokens and requests not fit on the shipped 1,000-request Mooncake sample, from the
# token-hash replay at commit 1ad8b8a: (block size, capacity, hit tokens, not fit).
SAMPLE_POINTS = [
    (16, 1000, 368_640, 279),
    (16, 5000, 502_272, 18),
    (16, 100_000, 881_728, 0),
    (16, None, 2_962_688, 0),
    (48, 2000, 475_680, 8),
    (48, None, 2_934_336, 0),
]


@pytest.fixture(scope="module")
def sample_trace() -> Trace:
    from importlib import resources

    with resources.as_file(
        resources.files("pagedkv") / "data" / "mooncake_conversation_sample.jsonl"
    ) as path:
        return load_trace(path)


def test_canonical_runs_join_and_drop():
    runs = [(0, 4), (4, 2), (10, 0), (7, 1), (8, 3), (20, 1)]
    assert list(canonical_runs(runs)) == [(0, 6), (7, 4), (20, 1)]
    assert runs_of_token_ids([5, 6, 7, 1, 2, 9]) == [(5, 3), (1, 2), (9, 1)]


def test_keys_mark_block_ends_inside_runs():
    keyer = TraceBlockKeys(4)
    a = _request("a", [(0, 6), (100, 5)])  # tokens 0..5, 100..104: blocks end at 4, 8
    b = _request("b", [(0, 9)])  # shares tokens 0..3 only
    c = _request("c", [(0, 6), (100, 3), (50, 2)])  # shares a's first 8 tokens
    keys_a, keys_b, keys_c = (keyer.get_keys(r) for r in (a, b, c))
    assert len(keys_a) == 2 and len(keys_b) == 2 and len(keys_c) == 2
    assert keys_a[0] == keys_b[0] == keys_c[0]
    assert keys_a[1] == keys_c[1] != keys_b[1]


def _request(request_id: str, runs, explicit=None) -> TraceRequest:
    num_tokens = len(explicit) if explicit else sum(n for _, n in runs)
    return TraceRequest(request_id, 0.0, num_tokens, 1, tuple(runs), OUTPUT_TOKEN_BASE, 0, explicit)


# Runs drawn from a few starting ids so prompts share, split and rejoin them.
_RUN = st.tuples(st.sampled_from([0, 3, 5, 8, 512, 1000]), st.integers(0, 12))
_PROMPT = st.one_of(
    st.lists(_RUN, min_size=1, max_size=5).filter(lambda runs: sum(n for _, n in runs) > 0),
    st.lists(st.sampled_from([0, 1, 2, 3, 4, 9]), min_size=1, max_size=30).map(tuple),
)


def _trace(prompts) -> Trace:
    requests = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, tuple):
            requests.append(_request(f"r{index}", (), explicit=prompt))
        else:
            requests.append(_request(f"r{index}", prompt))
    return Trace("random", tuple(requests), "test")


@settings(max_examples=80, deadline=None)
@given(prompts=st.lists(_PROMPT, min_size=1, max_size=12), block_size=st.sampled_from([1, 2, 3]))
def test_keys_equal_iff_token_hashes_equal(prompts, block_size):
    trace = _trace(prompts)
    keyer = TraceBlockKeys(block_size)
    hasher = make_request_block_hasher(block_size)
    key_to_hash: dict[int, bytes] = {}
    hash_to_key: dict[bytes, int] = {}
    for trace_request in trace.requests:
        keys = keyer.get_keys(trace_request)
        hashes = Request("r", trace_request.prompt_token_ids(), block_hasher=hasher).block_hashes
        assert len(keys) == len(hashes) == trace_request.num_prompt_tokens // block_size
        for key, block_hash in zip(keys, hashes, strict=True):
            assert key_to_hash.setdefault(key, block_hash) == block_hash
            assert hash_to_key.setdefault(block_hash, key) == key


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(_PROMPT, min_size=1, max_size=15),
    block_size=st.sampled_from([1, 2, 4]),
    capacities=st.lists(st.integers(1, 30), min_size=1, max_size=3),
)
def test_replay_by_keys_equals_replay_by_token_hashes(prompts, block_size, capacities):
    trace = _trace(prompts)
    capacities = [*capacities, None]
    by_hashes = replay(trace, capacities, block_size, hash_tokens=True)
    assert replay(trace, capacities, block_size) == by_hashes


def test_shipped_sample_hits_are_unchanged(sample_trace):
    for block_size in (16, 48):
        points = [p for p in SAMPLE_POINTS if p[0] == block_size]
        results = replay(sample_trace, [p[1] for p in points], block_size)
        assert [(r.capacity_blocks, r.num_hit_tokens, r.num_requests_not_fit) for r in results] == [
            p[1:] for p in points
        ]


def test_process_sweep_equals_one_pass(sample_trace):
    head = Trace("head", sample_trace.requests[:150], "test")
    total_blocks = sum(cdiv(r.num_prompt_tokens, 16) for r in head.requests)
    capacities = [total_blocks, total_blocks // 10, None, 2 * total_blocks, total_blocks // 40]
    one_pass = replay(head, capacities, 16)
    seen: list[int] = []
    assert replay(head, capacities, 16, progress=seen.append, max_workers=2) == one_pass
    assert seen[-1] == 150 and seen == sorted(seen)
    # A pool holding every prompt block never evicts: the same hits as unlimited.
    assert one_pass[0].num_hit_tokens == one_pass[2].num_hit_tokens == one_pass[3].num_hit_tokens
    assert one_pass[4].num_hit_tokens < one_pass[1].num_hit_tokens < one_pass[0].num_hit_tokens


def _serve_config(num_blocks: int, hash_tokens: bool, **scheduler) -> ServeConfig:
    model = get_profile(DEFAULT_PROFILE).cost_model()
    config = SchedulerConfig(
        max_num_batched_tokens=2048, max_model_len=num_blocks * 16, **scheduler
    )
    return ServeConfig(
        num_blocks=num_blocks,
        cost_model=model,
        scheduler=config,
        max_model_len=num_blocks * 16,
        time_scale=0.05,
        hash_tokens=hash_tokens,
    )


@pytest.mark.parametrize("num_blocks", [600, 3000])
def test_serve_by_keys_equals_serve_by_token_hashes(num_blocks):
    # 600 blocks: preemptions, so re-admitted requests look up prompt and output blocks.
    trace = load_trace(DATA / "mooncake_conversations46.jsonl")
    by_hashes = simulate_serving(trace, _serve_config(num_blocks, hash_tokens=True)).summary
    by_keys = simulate_serving(trace, _serve_config(num_blocks, hash_tokens=False)).summary
    assert by_keys == by_hashes
    assert by_keys["prefix_cache"]["hits"] > 0
    if num_blocks == 600:
        assert by_keys["preemptions"]["num_preemptions"] > 0
        assert by_keys["prefix_cache"]["preempted_hits"] > 0


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(_PROMPT, min_size=1, max_size=10), num_blocks=st.integers(4, 12))
def test_serve_keys_cover_output_blocks(prompts, num_blocks):
    # Block size 16 would rarely fill an output block of these short prompts; 2 does.
    trace = _trace(prompts)
    results = []
    for hash_tokens in (True, False):
        config = ServeConfig(
            num_blocks=num_blocks,
            cost_model=get_profile(DEFAULT_PROFILE).cost_model(),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=2 * num_blocks),
            block_size=2,
            max_model_len=2 * num_blocks,
            hash_tokens=hash_tokens,
        )
        results.append(simulate_serving(trace, config).summary)
    assert results[0] == results[1]
