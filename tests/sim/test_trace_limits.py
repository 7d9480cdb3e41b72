"""Trace loading under hostile input: refused from sizes and counts before anything large is
built, with a message naming the file, the line and the field (or the memory numbers)."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from pagedkv import HostMemoryError, memory_guard
from pagedkv.sim.inputs.traces import MAX_TRACE_BLOCKS, TraceFormatError, load_trace


def write_lines(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def peak_bytes_of(action) -> int:
    tracemalloc.start()
    try:
        action()
    finally:
        _, peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak_bytes


GOOD = '{"input_length": 600, "output_length": 1}'


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        (
            '{"input_length": 1000000000000, "output_length": 1}',
            "input_length",
            "more than 4,194,304 distinct 512-token blocks in one trace "
            r"\(2,147,483,648 prompt tokens\)",
        ),
        (
            '{"timestamp": 0, "input_length": 1000000000000, "output_length": 1, "hash_ids": [1]}',
            "hash_ids",
            r"has 1 ids; input_length 1000000000000 needs ceil\(1000000000000/512\) = 1953125000",
        ),
        (
            '{"input_length": 100, "output_length": 1, "timestamp": 1e300}',
            "timestamp",
            r"expected milliseconds in \[0, 1e\+13\], got 1e\+300",
        ),
        ("[" * 100_000 + "]" * 100_000, None, "not usable JSON .*recursion"),
        ('{"input_length": ' + "9" * 5000 + "}", None, r"not usable JSON \(Exceeds the limit"),
    ],
)
def test_hostile_lines_are_refused_before_anything_large_is_built(tmp_path, line, field, message):
    path = write_lines(tmp_path / "t.jsonl", [GOOD, line])
    caught = []

    def load() -> None:
        with pytest.raises(TraceFormatError, match=message) as error:
            load_trace(path)
        caught.append(error.value)

    assert peak_bytes_of(load) < 16 * 2**20  # from counts and lengths, not from token lists
    (error,) = caught
    assert (error.path, error.line_number, error.field) == (path, 2, field)
    assert "sys.set_int_max_str_digits" not in str(error)


def test_a_non_utf8_line_is_named_with_its_byte(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + GOOD.encode() + b"\n" + b'{"input_length": \xff}\n')
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    assert str(caught.value) == (
        f"{path}:3: not UTF-8 text (byte b'\\xff' at column 18); a trace is a JSONL text file"
    )


def test_fresh_prompts_take_consecutive_blocks_without_a_table_entry_each(tmp_path):
    # A length-only prompt takes fresh blocks: one run, numbered after the blocks before it.
    num_tokens = (MAX_TRACE_BLOCKS - 2) * 512  # the largest that still fits with the others
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [5, 6]}',
            json.dumps({"input_length": num_tokens, "output_length": 1, "timestamp": 1}),
        ],
    )
    trace = load_trace(path)
    assert [r.prompt_runs for r in trace.requests] == [((0, 1000),), ((2 * 512, num_tokens),)]
    assert trace.requests[1].num_prompt_tokens == num_tokens
    with pytest.raises(TraceFormatError, match="more than 4,194,304 distinct"):
        load_trace(write_lines(tmp_path / "u.jsonl", [GOOD, json.dumps(
            {"input_length": num_tokens + 1024, "output_length": 1})]))  # fmt: skip


def test_a_line_too_long_to_parse_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    # 25 bytes of parsed JSON per byte of line: 250,000 bytes available allow 10,000-byte lines.
    monkeypatch.setattr(memory_guard, "available_memory_bytes", lambda: 250_000)
    monkeypatch.setattr("pagedkv.sim.inputs.traces.available_memory_bytes", lambda: 250_000)
    ids = list(range(20))
    short = json.dumps({"prompt_token_ids": ids, "output_length": 1})
    long = json.dumps({"prompt_token_ids": ids * 1000, "output_length": 1})
    path = write_lines(tmp_path / "t.jsonl", [short, long])
    with pytest.raises(HostMemoryError) as caught:
        load_trace(path)
    assert str(caught.value) == (
        f"{path}:2: the line is longer than 9.8 KiB; parsing it could take more than the "
        "244.1 KiB of memory this machine has available"
    )
    assert len(load_trace(path, limit=1).requests) == 1  # the lines before it were fine


def test_a_trace_too_large_for_memory_is_refused_at_the_line_that_overflows(tmp_path, monkeypatch):
    # Every request is estimated at ~720 bytes (600 + a run); 2,000 bytes fit two of them.
    monkeypatch.setattr(memory_guard, "MIN_CHECKED_BYTES", 1)
    monkeypatch.setattr(memory_guard, "available_memory_bytes", lambda: 2_000)
    path = write_lines(tmp_path / "t.jsonl", [GOOD] * 5)
    with pytest.raises(
        HostMemoryError, match=rf"^loading {path} \(up to line 3\) needs an estimated"
    ):
        load_trace(path)
