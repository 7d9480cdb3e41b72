"""End to end: greedy generation through pagedkv equals transformers' `generate`, token for token.

Small seeded random models on CPU in float32. Each scenario also asserts that the mechanism it
exercises really ran (prefix hits, preemptions, prefill chunks).
"""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("pagedkv.sched")

from pagedkv.cli import main  # noqa: E402
from pagedkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from pagedkv.engine.model_runner import load_model  # noqa: E402
from pagedkv.engine.sampling import SamplingParams  # noqa: E402
from pagedkv.errors import ConfigError, InvalidArgumentError  # noqa: E402
from tests.support.engine import hf_greedy, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch

MODELS = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),
}


def random_tokens(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(num_tokens)]


def make_engine(model, **overrides) -> LLMEngine:
    settings = dict(block_size=4, num_blocks=128, max_model_len=128)
    settings.update(overrides)
    return LLMEngine(model, EngineConfig(**settings))


@pytest.mark.parametrize("model_type", list(MODELS))
def test_shared_prefix_batches_match_hf_generate_and_hit_the_cache(model_type):
    model = tiny_model(model_type, **MODELS[model_type])
    rng = random.Random(0)
    system_a, system_b = random_tokens(rng, 12), random_tokens(rng, 9)
    first_wave = [system_a + random_tokens(rng, 5), system_b + random_tokens(rng, 3)]
    second_wave = [
        system_a + random_tokens(rng, 2),
        first_wave[1] + random_tokens(rng, 4),  # a whole earlier prompt as prefix
        list(first_wave[0]),  # an identical prompt: hit capped at num_tokens - 1
        system_b + random_tokens(rng, 7),
        random_tokens(rng, 6),  # no shared prefix
    ]
    engine = make_engine(model)
    params = SamplingParams(max_tokens=10)
    outputs = engine.generate(first_wave, params)
    # Blocks of the first wave are free but still cached; the second wave reads their KV.
    outputs += engine.generate(second_wave, params)
    engine.check_invariants()
    for prompt, output in zip(first_wave + second_wave, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 10), prompt
        assert output.finish_reason == "length"
    cached = [output.num_cached_tokens for output in outputs[2:]]
    assert cached == [12, 12, 16, 8, 0]
    assert engine.stats.num_prefix_hit_tokens == sum(cached)


def test_prefix_hits_within_one_step_reuse_kv_written_in_that_step():
    model = tiny_model("llama")
    rng = random.Random(1)
    shared = random_tokens(rng, 16)
    prompts = [shared + random_tokens(rng, 3), shared + random_tokens(rng, 5)]
    engine = make_engine(model)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert engine.scheduler.step_records[0].scheduled_request_ids == ("req-0", "req-1")
    assert [output.num_cached_tokens for output in outputs] == [0, 16]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 6)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_preemption_and_recompute_match_hf_generate(model_type):
    model = tiny_model(model_type, **MODELS[model_type])
    rng = random.Random(2)
    prompts = [random_tokens(rng, 10 + i) for i in range(4)]
    # Each request ends with cdiv(10 + i + 16, 4) = 7..8 blocks; 15 usable blocks hold two.
    engine = make_engine(model, num_blocks=16, max_model_len=32)
    request_ids = [engine.add_request(prompt, SamplingParams(max_tokens=16)) for prompt in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()  # table copies survive preemption and recompute
    outputs = [engine.get_output(request_id) for request_id in request_ids]
    assert engine.stats.num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 16)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_chunked_prefill_matches_hf_generate(model_type):
    model = tiny_model(model_type, **MODELS[model_type])
    rng = random.Random(3)
    prompts = [random_tokens(rng, 23), random_tokens(rng, 17), random_tokens(rng, 9)]
    engine = make_engine(model, max_num_batched_tokens=8)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8))
    records = engine.scheduler.step_records
    assert records[0].num_scheduled_tokens == (8,)  # the 23-token prompt split into chunks
    assert all(sum(record.num_scheduled_tokens) <= 8 for record in records)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 8)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("mistral", dict(sliding_window=5)), ("qwen2", MODELS["qwen2"])],
)
def test_sliding_window_generation_matches_hf_generate(model_type, overrides):
    model = tiny_model(model_type, **overrides)
    rng = random.Random(4)
    shared = random_tokens(rng, 12)
    prompts = [shared + random_tokens(rng, 4), shared + random_tokens(rng, 2)]
    # Sequences reach 30 tokens, several times the window; chunks of 6 cross it too.
    engine = make_engine(model, max_num_batched_tokens=6)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=14))
    assert outputs[1].num_cached_tokens == 12
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_token_ids == hf_greedy(model, prompt, 14)


def test_hybrid_kv_cache_frees_out_of_window_blocks_and_matches_hf_generate():
    # Qwen2 with layer 0 full and layer 1 windowed (7 tokens): two KV-cache groups, the
    # sliding-window manager swapping blocks behind the window for the null block.
    model = tiny_model("qwen2", **MODELS["qwen2"])
    rng = random.Random(8)
    shared = random_tokens(rng, 16)
    prompts = [shared + random_tokens(rng, 5), shared + random_tokens(rng, 3)]
    engine = make_engine(model, hybrid_kv_cache=True)
    assert len(engine.kv_cache_config.kv_cache_groups) == 2
    engine.generate([prompts[0]], SamplingParams(max_tokens=12))
    request_id = engine.add_request(prompts[1], SamplingParams(max_tokens=12))
    window_tables = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()  # the engine's table copies agree with the manager's
        if engine.has_unfinished_requests():
            window_tables.append(engine.kv_cache_manager.get_block_ids(request_id)[1])
    engine.check_invariants()
    # The window group's table starts with null blocks once tokens leave the window.
    assert window_tables[-1][:4] == [0, 0, 0, 0]
    output = engine.get_output(request_id)
    assert output.num_cached_tokens == 16
    assert output.output_token_ids == hf_greedy(model, prompts[1], 12)


def test_prefix_hit_logits_match_a_cold_run():
    model = tiny_model("qwen2")
    rng = random.Random(5)
    shared = random_tokens(rng, 20)
    prompt = shared + random_tokens(rng, 3)
    warm = make_engine(model, record_logits=True)
    warm.generate([shared + random_tokens(rng, 1)], SamplingParams(max_tokens=2))
    (hit,) = warm.generate([prompt], SamplingParams(max_tokens=5))
    cold = make_engine(model, record_logits=True, enable_prefix_caching=False)
    (fresh,) = cold.generate([prompt], SamplingParams(max_tokens=5))
    assert hit.num_cached_tokens == 20 and fresh.num_cached_tokens == 0
    assert hit.output_token_ids == fresh.output_token_ids
    assert len(hit.logits) == 5
    for hit_logits, fresh_logits in zip(hit.logits, fresh.logits, strict=True):
        torch.testing.assert_close(hit_logits, fresh_logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(hit.logits[0], expected, rtol=1e-4, atol=1e-5)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    model = tiny_model("llama")
    rng = random.Random(6)
    prompts = [random_tokens(rng, 8), random_tokens(rng, 11)]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    alone = make_engine(model).generate([prompts[0]], sampled)[0].output_token_ids
    batched = make_engine(model).generate(prompts, sampled)[0].output_token_ids
    assert alone == batched
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=8)
    assert make_engine(model).generate([prompts[0]], other_seed)[0].output_token_ids != alone
    # top_p so small that only the most likely token survives: greedy.
    nucleus = SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-9, seed=7)
    assert make_engine(model).generate([prompts[0]], nucleus)[0].output_token_ids == hf_greedy(
        model, prompts[0], 12
    )


def test_engine_stops_at_stop_tokens_and_validates_input():
    model = tiny_model("llama")
    prompt = random_tokens(random.Random(7), 9)
    reference = hf_greedy(model, prompt, 8)
    stop = reference[3]
    engine = make_engine(model, stop_token_ids=(stop,))
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=8))
    assert output.output_token_ids == reference[: reference.index(stop) + 1]
    assert output.finish_reason == "stop"
    with pytest.raises(InvalidArgumentError, match="exceed max_model_len=128"):
        engine.add_request(list(range(3, 120)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidArgumentError, match=r"\[256, -1\] are outside the vocabulary"):
        engine.add_request([5, 256, -1], SamplingParams(max_tokens=2))

    with pytest.raises(ConfigError, match="exactly one of num_blocks"):
        EngineConfig(num_blocks=8, kv_cache_memory_bytes=1 << 20)


def test_generate_cli_on_the_shipped_tiny_model(capsys):
    code = main(
        ["generate", "--model", "tiny-llama", "--prompt", "5,6,7,8,9", "--prompt", "5 6 7 8 10"]
        + ["--max-tokens", "6", "--block-size", "4", "--json"]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    model = load_model(
        __import__("pagedkv.cli.generate", fromlist=["x"]).resolve_model_path("tiny-llama"),
        seed=0,
    )
    outputs = result["outputs"]
    assert outputs[0]["output_token_ids"] == hf_greedy(model, [5, 6, 7, 8, 9], 6)
    assert outputs[1]["output_token_ids"] == hf_greedy(model, [5, 6, 7, 8, 10], 6)
    assert outputs[1]["num_cached_tokens"] == 4
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hello world"]) == 2
    assert "is not token ids" in capsys.readouterr().err


def test_generate_cli_on_a_checkpoint_with_a_local_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    word_level = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>")
    model = tiny_model("llama", seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--max-tokens", "5", "--json"]
    assert main(argv + ["--prompt", "w1 w2 w3 w4"]) == 0
    (output,) = json.loads(capsys.readouterr().out)["outputs"]
    assert output["prompt_token_ids"] == [4, 5, 6, 7]
    assert output["output_token_ids"] == hf_greedy(model, [4, 5, 6, 7], 5)
    assert output["text"] == tokenizer.decode(output["output_token_ids"])
    assert main(argv + ["--token-ids", "--prompt", "4,5,6,7"]) == 0
    (by_ids,) = json.loads(capsys.readouterr().out)["outputs"]
    assert by_ids["output_token_ids"] == output["output_token_ids"] and "text" not in by_ids


def test_the_model_eos_stops_generation_unless_ignored():
    model = tiny_model("llama")
    prompt = random_tokens(random.Random(7), 9)
    free_run = make_engine(model, ignore_eos=True).generate([prompt], SamplingParams(8))[0]
    eos = free_run.output_token_ids[2]
    model.generation_config.eos_token_id = eos
    (stopped,) = make_engine(model).generate([prompt], SamplingParams(max_tokens=8))
    assert stopped.output_token_ids == free_run.output_token_ids[:3] == hf_greedy(model, prompt, 8)
    assert stopped.finish_reason == "stop" and free_run.finish_reason == "length"


def test_a_llama_config_with_a_sliding_window_field_gets_no_window():
    # transformers' Llama attention ignores `sliding_window`; only the Mistral family applies
    # it. (transformers' `generate` does not: its DynamicCache builds sliding-window cache
    # layers from the field and drops keys during decoding, which the model's own forward
    # never does; so the yardstick here is greedy decoding by full forwards.)
    model = tiny_model("llama", sliding_window=3)
    assert model.config.sliding_window == 3
    engine = make_engine(model)
    assert [plan.sliding_window for plan in engine.runner.layer_plans] == [None, None]
    prompt = random_tokens(random.Random(10), 12)
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=6))
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    assert output.output_token_ids == sequence[12:]


@pytest.mark.parametrize(
    ("rope", "name"),
    [
        (dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), "dynamic"),
        (
            dict(
                rope_type="longrope",
                short_factor=[1.0] * 8,
                long_factor=[2.0] * 8,
                factor=2.0,
                original_max_position_embeddings=128,
                rope_theta=10000.0,
            ),
            "longrope",
        ),
    ],
)
def test_batch_dependent_rope_is_refused(rope, name):
    model = tiny_model("llama", rope_parameters=rope)
    with pytest.raises(ConfigError, match=f"RoPE type '{name}' rescales frequencies"):
        make_engine(model)
