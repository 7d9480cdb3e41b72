"""Trace loading: token mapping of Mooncake hash ids, plain formats, errors."""

from __future__ import annotations

import json
import warnings

import pytest

from pagedkv import PagedKVError, Request, make_request_block_hasher
from pagedkv.sim.inputs.traces import OUTPUT_TOKEN_BASE, TraceFormatError, TraceWarning, load_trace


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


MOONCAKE = [
    {"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [7, 8, 9]},
    {"timestamp": 10, "input_length": 1400, "output_length": 2, "hash_ids": [7, 8, 11]},
    {"timestamp": 10, "input_length": 100, "output_length": 1, "hash_ids": [12]},
    {"timestamp": 25, "input_length": 2000, "output_length": 4, "hash_ids": [7, 8, 9, 13]},
]


def shared_blocks(a: Request, b: Request) -> int:
    count = 0
    for x, y in zip(a.block_hashes, b.block_hashes, strict=False):
        if x != y:
            break
        count += 1
    return count


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_hash_id_sharing_becomes_token_sharing(tmp_path, block_size):
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", MOONCAKE))
    hasher = make_request_block_hasher(block_size)
    r = [Request(t.request_id, t.prompt_token_ids(), block_hasher=hasher) for t in trace.requests]
    per_trace_block = 512 // block_size
    # Requests 0 and 1 share ids 7, 8: exactly 1024 tokens; id 9 vs 11 differ at every position.
    assert shared_blocks(r[0], r[1]) == 2 * per_trace_block
    tokens0, tokens1 = r[0].all_token_ids, r[1].all_token_ids
    assert tokens0[:1024] == tokens1[:1024]
    assert all(x != y for x, y in zip(tokens0[1024:], tokens1[1024:], strict=False))
    # Request 3 repeats request 0's three ids; request 0's last block (476 tokens) is partial,
    # so only its whole blocks at this block size can be shared.
    assert shared_blocks(r[0], r[3]) == 2 * per_trace_block + 476 // block_size
    assert tokens0 == r[3].all_token_ids[:1500]
    # Request 2 shares nothing with anyone.
    assert not set(r[2].all_token_ids) & (set(tokens0) | set(tokens1))


def test_mooncake_mapping_details(tmp_path):
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", MOONCAKE))
    first = trace.requests[0]
    # Ids are numbered densely by first appearance: 7 -> 0, 8 -> 1, 9 -> 2 (one merged run).
    assert first.prompt_runs == ((0, 1500),)
    assert trace.requests[1].prompt_runs == ((0, 1024), (3 * 512, 376))
    assert [t.arrival_time_s for t in trace.requests] == [0.0, 0.01, 0.01, 0.025]
    # Output ids: disjoint from prompts, consecutive runs in trace order.
    assert [t.output_token_start for t in trace.requests] == [
        OUTPUT_TOKEN_BASE,
        OUTPUT_TOKEN_BASE + 3,
        OUTPUT_TOKEN_BASE + 5,
        OUTPUT_TOKEN_BASE + 6,
    ]
    assert trace.summary() == {
        "name": "t.jsonl",
        "num_requests": 4,
        "num_prompt_tokens": 5000,
        "num_output_tokens": 10,
        "duration_s": 0.025,
    }


def test_token_id_and_length_records(tmp_path):
    path = write_jsonl(
        tmp_path / "plain.jsonl",
        [
            {"prompt_token_ids": [5, 6, 7], "output_length": 2},
            {"input_length": 600, "output_length": 1, "timestamp": 3},
            {"input_length": 600, "output_length": 1, "timestamp": 4, "priority": 2},
        ],
    )
    trace = load_trace(path)
    explicit, fresh_a, fresh_b = trace.requests
    assert explicit.prompt_token_ids() == [5, 6, 7] and explicit.arrival_time_s == 0.0
    a, b = fresh_a.prompt_token_ids(), fresh_b.prompt_token_ids()
    assert len(a) == len(b) == 600 and not set(a) & set(b)  # lengths only: nothing shared
    assert fresh_b.priority == 2


def test_unsorted_timestamps_are_sorted_with_a_warning(tmp_path):
    records = [dict(MOONCAKE[0], timestamp=50), MOONCAKE[1], MOONCAKE[2]]
    with pytest.warns(TraceWarning, match="not sorted"):
        trace = load_trace(write_jsonl(tmp_path / "u.jsonl", records))
    assert [t.request_id for t in trace.requests] == ["L2", "L3", "L1"]


def test_limit_reads_the_first_requests(tmp_path):
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", MOONCAKE), limit=2)
    assert [t.request_id for t in trace.requests] == ["L1", "L2"]


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        ("{not json", None, "not valid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
        ('{"output_length": 3}', None, "needs 'hash_ids'"),
        ('{"input_length": 600, "hash_ids": [1, 2]}', "output_length", "missing"),
        ('{"input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "timestamp", "missing"),
        (
            '{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            "timestamp",
            r"in \[0, 1e\+13\], got -1",
        ),
        (
            '{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}',
            "input_length",
            "expected an int",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            "hash_ids",
            r"has 1 ids; input_length 600 needs ceil\(600/512\) = 2",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}',
            "output_length",
            ">= 1",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-4]}',
            "hash_ids",
            "ints >= 0",
        ),
        ('{"prompt_token_ids": [1, 2.5], "output_length": 1}', "prompt_token_ids", "position 1"),
    ],
)
def test_malformed_lines_name_file_line_and_field(tmp_path, line, field, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE[0]) + "\n\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=message) as caught:
        load_trace(path)
    error = caught.value
    assert isinstance(error, PagedKVError) and isinstance(error, ValueError)
    assert (error.path, error.line_number, error.field) == (str(path), 3, field)
    assert str(error).startswith(f"{path}:3: ")


def test_an_empty_trace_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with warnings.catch_warnings():
        with pytest.raises(TraceFormatError, match="no requests"):
            load_trace(path)


def test_mooncake_sessions_are_derived_from_prefix_extension(tmp_path):
    """A request extending all full blocks (>= 2) of an earlier one is its next turn; the
    first extender wins; one shared block alone (a system prompt) is no session."""
    records = [
        # S1: 3 full blocks + a partial one.
        {"timestamp": 0, "input_length": 1600, "output_length": 3, "hash_ids": [1, 2, 3, 4]},
        # Only block 1 in common: a session of its own (S2), 2 full blocks.
        {"timestamp": 1, "input_length": 1100, "output_length": 3, "hash_ids": [1, 5, 6]},
        # Extends S1's full blocks 1 2 3: turn 1 of S1 (its output moved into block 7).
        {"timestamp": 2, "input_length": 2100, "output_length": 3, "hash_ids": [1, 2, 3, 7, 8]},
        # Extends S1's first turn again: a retry, a session of its own (S4).
        {"timestamp": 3, "input_length": 2000, "output_length": 3, "hash_ids": [1, 2, 3, 9]},
        # Extends turn 1 (full blocks 1 2 3 7): turn 2 of S1.
        {
            "timestamp": 4,
            "input_length": 3000,
            "output_length": 3,
            "hash_ids": [1, 2, 3, 7, 10, 11],
        },
        # Extends S2's full blocks 1 5: S2's turn 1.
        {"timestamp": 5, "input_length": 1600, "output_length": 3, "hash_ids": [1, 5, 12, 13]},
        # Explicit session ids win over the derivation.
        {
            "timestamp": 6,
            "input_length": 2100,
            "output_length": 3,
            "hash_ids": [1, 2, 3, 7, 14],
            "session_id": 42,
            "turn_index": 5,
        },
    ]
    trace = load_trace(write_jsonl(tmp_path / "sessions.jsonl", records))
    assert [(r.session_id, r.turn_index) for r in trace.requests] == [
        ("S1", 0),
        ("S2", 0),
        ("S1", 1),
        ("S4", 0),
        ("S1", 2),
        ("S2", 1),
        ("42", 5),
    ]
    again = load_trace(write_jsonl(tmp_path / "again.jsonl", records))
    assert again.requests == trace.requests  # deterministic


def test_records_without_hash_ids_have_no_session_unless_given(tmp_path):
    trace = load_trace(
        write_jsonl(
            tmp_path / "plain.jsonl",
            [
                {"input_length": 10, "output_length": 1},
                {"prompt_token_ids": [1, 2], "output_length": 1, "session_id": "chat-1"},
            ],
        )
    )
    assert [(r.session_id, r.turn_index) for r in trace.requests] == [(None, 0), ("chat-1", 0)]


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ('"session_id": [1]', "session_id", "expected a string or an int"),
        ('"session_id": true', "session_id", "expected a string or an int"),
        ('"session_id": "a", "turn_index": -1', "turn_index", ">= 0"),
    ],
)
def test_bad_session_fields_name_the_line(tmp_path, extra, field, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 10, "output_length": 1, ' + extra + "}\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    assert info.value.field == field and info.value.line_number == 1


def test_shipped_mooncake_traces_get_sessions(tmp_path):
    """The rule on the shipped conversation trace's first 46 conversations (tests/data)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "data" / "mooncake_conversations46.jsonl"
    trace = load_trace(path)
    sessions = {r.session_id for r in trace.requests}
    turns = [r.turn_index for r in trace.requests]
    assert len(trace.requests) > len(sessions) > 1 and max(turns) >= 1
    # A next turn's prompt starts with all its previous turn's full blocks.
    by_session: dict[str, list] = {}
    for request in trace.requests:
        by_session.setdefault(request.session_id, []).append(request)
    for turns_of in by_session.values():
        for before, after in zip(turns_of, turns_of[1:], strict=False):
            num_full = before.num_prompt_tokens // 512 * 512
            assert after.prompt_token_ids()[:num_full] == before.prompt_token_ids()[:num_full]
            assert after.turn_index == before.turn_index + 1
