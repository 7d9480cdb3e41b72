"""Replay mode: capacity parsing and exact hit counts on a small trace."""

from __future__ import annotations

import json

import pytest

from pagedkv import InvalidArgumentError
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.replay import default_capacities, parse_capacities, replay

RECORDS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [7, 8, 9]},
    {"timestamp": 10, "input_length": 1400, "output_length": 2, "hash_ids": [7, 8, 11]},
    {"timestamp": 10, "input_length": 100, "output_length": 1, "hash_ids": [12]},
    {"timestamp": 25, "input_length": 2000, "output_length": 4, "hash_ids": [7, 8, 9, 13]},
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return load_trace(path)


def test_parse_capacities():
    assert parse_capacities("1000,5000,20000", 16) == [1000, 5000, 20000]
    assert parse_capacities("1M, 4Mtok ,20k,2.5k", 16) == [1_000_000, 250_000, 20_000, 2_500]
    assert parse_capacities("64tokens,3blocks,unlimited,inf", 16) == [4, 3, None, None]
    for bad in ("abc", "12x", "8tok", ","):
        with pytest.raises(InvalidArgumentError):
            parse_capacities(bad, 16)


def test_default_capacities_are_fractions_of_all_prompt_blocks(trace):
    # Prompt blocks at 16 tokens: 94 + 88 + 7 + 125 = 314.
    assert default_capacities(trace, 16) == [3, 9, 31, 94, 314]


def test_replay_hits_exactly(trace):
    points = replay(trace, [125, 100, None], block_size=16)
    unlimited = points[2]
    # Request 2 reuses ids 7, 8 (1024 tokens); request 4 reuses request 1's 93 full blocks.
    assert (unlimited.capacity_blocks, unlimited.num_hit_tokens) == (None, 1024 + 1488)
    assert unlimited.num_prompt_tokens == 5000 and unlimited.hit_rate == pytest.approx(0.5024)
    # 125 blocks hold request 4 (125 blocks) and nothing it needs was evicted before it.
    assert (points[0].num_hit_tokens, points[0].num_requests_not_fit) == (2512, 0)
    # 100 blocks: request 4 never fits, so only request 2's hit counts.
    assert (points[1].num_hit_tokens, points[1].num_requests_not_fit) == (1024, 1)


def test_eviction_lowers_the_hit_rate(tmp_path):
    records = [
        {"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1536, "output_length": 1, "hash_ids": [4, 5, 6]},
        {"timestamp": 2, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
    ]
    path = tmp_path / "evict.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    points = replay(load_trace(path), [4, 6, None], block_size=512)
    # The third request may hit 2 blocks (one token is always computed). With 4 blocks the
    # second request takes the free block and then evicts the first one's tail (blocks 3, 2).
    assert [p.num_hit_tokens for p in points] == [512, 1024, 1024]


def test_replay_needs_a_capacity(trace):
    with pytest.raises(InvalidArgumentError):
        replay(trace, [], block_size=16)
