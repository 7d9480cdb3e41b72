"""The engine on the Triton backend (interpreted on CPU) equals transformers' `generate`.

Decode steps go through the CUDA-graph path (padded to a batch-size bucket; on CPU the
captured function reruns eagerly), prefill chunks through the eager kernels.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.engine import hf_greedy, require_triton, tiny_model  # noqa: E402

require_triton()

from pagedkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from pagedkv.engine.sampling import SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

pytestmark = pytest.mark.torch


def test_triton_backend_and_decode_graphs_match_hf_generate():
    # Qwen2, layer 1 windowed (5 tokens): prefix hits, chunked prefill and decode all cross
    # the window; three requests decode in a bucket of 4 (one padding sequence).
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    rng = random.Random(9)
    shared = [rng.randrange(3, 256) for _ in range(8)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (3, 6, 1)]
    config = EngineConfig(
        block_size=4,
        num_blocks=32,
        max_model_len=32,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        attention_backend="triton",
    )
    engine = LLMEngine(model, config)
    assert engine.graphs is not None and engine.graphs.buckets == (1, 2, 4)
    with pytest.raises(InvalidArgumentError, match="no decode step has run"):
        engine.graphs.replay_last()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6))
    engine.check_invariants()
    assert 4 in engine.graphs.captured_buckets  # three sequences and one padding sequence
    assert [output.num_cached_tokens for output in outputs] == [0, 8, 8]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 6)


def test_one_token_prefill_chunks_in_a_graph_step_sample_only_finished_prompts():
    # A token budget of 2: while A decodes, B's prompt advances one token a step, so steps of
    # one token a sequence (graph-shaped) include a chunk that must not be sampled.
    model = tiny_model("llama")
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    config = EngineConfig(
        block_size=4,
        num_blocks=16,
        max_model_len=16,
        max_num_batched_tokens=2,
        max_num_seqs=2,
        attention_backend="triton",
    )
    engine = LLMEngine(model, config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=3))
    shapes = [record.num_scheduled_tokens for record in engine.scheduler.step_records]
    assert (1, 1) in shapes[:4]  # A decoding next to one of B's prompt tokens
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 3)
