"""Fuzzing the loaders of untrusted files: arbitrary bytes and arbitrary JSON fed to the trace
loader and the model config loader. Each returns a result or raises pagedkv's own error
(`PagedKVError`), never anything else, and no input of a few kilobytes makes it allocate more
than a bounded amount (tracemalloc peak per example). The wire decoder has its own fuzzing."""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import PagedKVError
from pagedkv.sim.inputs.traces import Trace, load_trace
from pagedkv.sizing import get_kv_cache_layout
from pagedkv.sizing.model_config import ModelDescription, load_model_description

# Per example: a few KB of input may parse into a few MB, never into gigabytes.
MAX_PEAK_BYTES = 32 * 2**20

# A quick pass in CI; PAGEDKV_FUZZ_EXAMPLES=20000 fuzzes for real by hand.
FUZZ = settings(
    max_examples=int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# JSON values with the extremes that break naive code: huge and negative ints, NaN and
# infinities (Python's json reads them), deep nesting, odd strings.
BIG_INTS = st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 10**12, 10**18, 10**30, -(10**12)])
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    BIG_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.text("abk_Ü", max_size=6), children, max_size=6),
    ),
    max_leaves=8,
)


def within_bounded_memory(action: Callable[[], Any]) -> Any:
    """`action()`'s result or PagedKVError, checking the allocation peak either way."""
    tracemalloc.start()
    try:
        try:
            return action()
        except PagedKVError as error:
            return error
    finally:
        _, peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak_bytes < MAX_PEAK_BYTES, f"peak {peak_bytes:,} bytes"


# ---------------------------------------------------------------------------- traces

TRACE_KEYS = (
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "prompt_token_ids",
    "priority",
)
# A record near the formats the loader knows: known keys with arbitrary or plausible values.
TRACE_FIELD_VALUES = st.one_of(
    JSON_VALUES,
    st.integers(min_value=-5, max_value=5000),
    st.lists(st.integers(min_value=-3, max_value=50), max_size=12),
)
TRACE_RECORDS = st.one_of(
    JSON_VALUES,
    st.dictionaries(st.sampled_from(TRACE_KEYS), TRACE_FIELD_VALUES, max_size=6),
)


def load_trace_file(tmp_path: Path, content: bytes) -> Trace | PagedKVError:
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(content)
    result = within_bounded_memory(lambda: load_trace(path))
    if isinstance(result, Trace):
        assert result.requests  # an empty trace is an error, never an empty result
        for request in result.requests:  # what the simulator will build stays in bounds
            assert request.num_prompt_tokens >= 1 and request.num_output_tokens >= 1
    return result


@FUZZ
@given(content=st.binary(max_size=4096))
def test_trace_loader_on_arbitrary_bytes(tmp_path, content):
    load_trace_file(tmp_path, content)


@FUZZ
@given(records=st.lists(TRACE_RECORDS, min_size=1, max_size=8))
def test_trace_loader_on_arbitrary_json_lines(tmp_path, records):
    content = "\n".join(json.dumps(record) for record in records).encode()
    load_trace_file(tmp_path, content)


@FUZZ
@given(records=st.lists(TRACE_RECORDS, min_size=1, max_size=4), cut=st.integers(0, 400))
def test_trace_loader_on_truncated_and_spliced_json(tmp_path, records, cut):
    text = "\n".join(json.dumps(record) for record in records)
    load_trace_file(tmp_path, (text[:cut] + "\n" + text[cut:]).encode())


# ---------------------------------------------------------------------------- model configs


def shipped_config(name: str) -> dict[str, Any]:
    text = (resources.files("pagedkv") / "data" / "configs" / f"{name}.json").read_text()
    return json.loads(text)


SHIPPED = ["llama-3.1-8b", "gemma-3-12b-it", "jamba-v0.1", "llama-4-scout-17b-16e-instruct",
           "deepseek-v3", "t5-small", "qwen2.5-7b-instruct", "mistral-7b-v0.1"]  # fmt: skip
CONFIG_KEYS = sorted({key for name in SHIPPED for key in shipped_config(name)} | {
    "layer_types", "sliding_window_pattern", "no_rope_layers", "hybrid_override_pattern",
    "num_decoder_layers", "decoder_layers", "decoder_attention_heads", "d_model", "torch_dtype",
})  # fmt: skip


def load_config_file(tmp_path: Path, content: bytes) -> ModelDescription | PagedKVError:
    path = tmp_path / "config.json"
    path.write_bytes(content)

    def describe_and_lay_out() -> ModelDescription:
        description = load_model_description(path)
        get_kv_cache_layout(description.layer_to_spec)  # the specs are usable for sizing
        return description

    return within_bounded_memory(describe_and_lay_out)


@FUZZ
@given(content=st.binary(max_size=4096))
def test_config_loader_on_arbitrary_bytes(tmp_path, content):
    load_config_file(tmp_path, content)


@FUZZ
@given(config=JSON_VALUES)
def test_config_loader_on_arbitrary_json(tmp_path, config):
    load_config_file(tmp_path, json.dumps(config).encode())


@FUZZ
@given(
    base=st.sampled_from(SHIPPED),
    changes=st.dictionaries(
        st.sampled_from(CONFIG_KEYS), st.one_of(JSON_VALUES, BIG_INTS), min_size=1, max_size=4
    ),
    nested=st.booleans(),
)
def test_config_loader_on_shipped_configs_with_fields_replaced(tmp_path, base, changes, nested):
    config = shipped_config(base)
    target = config.get("text_config", config) if nested else config
    target.update(changes)
    load_config_file(tmp_path, json.dumps(config).encode())


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": ["llama"]},  # unhashable where a name is expected
        {
            "model_type": "llama",
            "num_hidden_layers": 10**12,
            "num_attention_heads": 8,
            "hidden_size": 4096,
        },  # fmt: skip
        {"model_type": "gemma3", "text_config": {"num_hidden_layers": 10**9}},
        {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "hidden_size": 8,
            "layer_types": [{"a": 1}, []],
        },  # fmt: skip
    ],
)
def test_config_loader_refuses_what_fuzzing_found(tmp_path, config):
    result = load_config_file(tmp_path, json.dumps(config).encode())
    assert isinstance(result, PagedKVError), result
