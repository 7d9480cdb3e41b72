"""Model descriptions from Hugging Face config.json files: shipped ones and edge cases."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from pagedkv.errors import ConfigError
from pagedkv.sizing.model_config import (
    describe_model,
    get_dtype_bytes,
    load_model_description,
    shipped_config_names,
)
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

SHIPPED = [
    "deepseek-v3",
    "gemma-2-9b",
    "gemma-3-12b-it",
    "jamba-v0.1",
    "llama-3.1-8b",
    "llama-4-scout-17b-16e-instruct",
    "mistral-7b-v0.1",
    "qwen2.5-7b-instruct",
    "qwen3-8b",
    "t5-small",
]


def kinds(description) -> Counter:
    return Counter(spec.kind for spec in description.layer_to_spec.values())


def test_shipped_config_names():
    assert shipped_config_names() == SHIPPED


# --------------------------------------------------------------------------- shipped configs


def test_llama_3_1_8b():
    d = load_model_description("llama-3.1-8b")
    assert (d.model_type, d.dtype, d.dtype_bytes) == ("llama", "bfloat16", 2)
    assert d.max_position_embeddings == 131072
    assert set(d.layer_to_spec.values()) == {FullAttentionSpec(16, 8, 128, 2)}
    assert list(d.layer_to_spec)[:2] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert len(d.layer_to_spec) == 32


def test_mistral_7b_every_layer_windowed():
    d = load_model_description("mistral-7b-v0.1")
    assert set(d.layer_to_spec.values()) == {SlidingWindowSpec(16, 8, 128, 2, sliding_window=4096)}
    assert len(d.layer_to_spec) == 32


def test_qwen2_5_sliding_window_disabled():
    d = load_model_description("qwen2.5-7b-instruct")
    # head_dim = 3584 / 28; use_sliding_window is false, so sliding_window=131072 is ignored.
    assert set(d.layer_to_spec.values()) == {FullAttentionSpec(16, 4, 128, 2)}
    assert len(d.layer_to_spec) == 28


def test_qwen3_8b():
    d = load_model_description("qwen3-8b")
    assert set(d.layer_to_spec.values()) == {FullAttentionSpec(16, 8, 128, 2)}
    assert (len(d.layer_to_spec), d.max_position_embeddings) == (36, 40960)


def test_gemma_2_even_layers_windowed():
    d = load_model_description("gemma-2-9b")
    assert d.dtype_bytes == 4  # the base checkpoint's config says float32
    specs = list(d.layer_to_spec.values())
    assert specs[0] == SlidingWindowSpec(16, 8, 256, 4, sliding_window=4096)
    assert specs[1] == FullAttentionSpec(16, 8, 256, 4)
    assert kinds(d) == {"sliding_window": 21, "full_attention": 21}


def test_gemma_3_every_sixth_layer_global_with_text_config_defaults():
    d = load_model_description("gemma-3-12b-it")
    full_layers = [i for i, s in enumerate(d.layer_to_spec.values()) if s.kind == "full_attention"]
    assert full_layers == [5, 11, 17, 23, 29, 35, 41, 47]
    # head_dim 256 (Gemma3TextConfig default, not 3840 / 16), window 1024 from the config.
    assert d.layer_to_spec["layers.0.self_attn"] == SlidingWindowSpec(
        16, 8, 256, 2, sliding_window=1024
    )
    assert d.max_position_embeddings == 131072


def test_llama_4_scout_chunked_with_every_fourth_layer_global():
    d = load_model_description("llama-4-scout-17b-16e-instruct")
    specs = list(d.layer_to_spec.values())
    assert [i for i, s in enumerate(specs) if s.kind == "full_attention"] == list(range(3, 48, 4))
    assert specs[0] == ChunkedLocalAttentionSpec(16, 8, 128, 2, attention_chunk_size=8192)
    assert d.max_position_embeddings == 10485760


def test_jamba_attention_every_eighth_layer():
    d = load_model_description("jamba-v0.1")
    attention = [n for n, s in d.layer_to_spec.items() if s.kind == "full_attention"]
    assert attention == [f"layers.{i}.self_attn" for i in (4, 12, 20, 28)]
    assert d.layer_to_spec["layers.0.mamba"] == MambaSpec(16, ((8192, 3), (8192, 16)), 2)
    assert kinds(d) == {"mamba": 28, "full_attention": 4}


def test_deepseek_v3_mla():
    d = load_model_description("deepseek-v3")
    assert set(d.layer_to_spec.values()) == {MLAAttentionSpec(16, 1, 512 + 64, 2)}
    assert len(d.layer_to_spec) == 61  # the MTP layer is not counted


def test_t5_small_self_and_cross_attention():
    d = load_model_description("t5-small")
    assert list(d.layer_to_spec)[:2] == [
        "decoder.layers.0.self_attn",
        "decoder.layers.0.encoder_attn",
    ]
    assert d.layer_to_spec["decoder.layers.5.self_attn"] == FullAttentionSpec(16, 8, 64, 4)
    assert d.layer_to_spec["decoder.layers.5.encoder_attn"] == CrossAttentionSpec(16, 8, 64, 4)
    assert (d.max_position_embeddings, d.max_num_encoder_input_tokens) == (None, 512)
    assert d.dtype == "float32"  # no dtype field: Hugging Face's default


def test_block_size_and_dtype_override():
    d = load_model_description("llama-3.1-8b", block_size=32, dtype="fp8")
    assert (d.dtype, d.dtype_bytes) == ("fp8", 1)
    assert set(d.layer_to_spec.values()) == {FullAttentionSpec(32, 8, 128, 1)}


def test_path_and_model_directory(tmp_path):
    config = json.loads(load_config_text("qwen3-8b"))
    (tmp_path / "Qwen3-8B").mkdir()
    path = tmp_path / "Qwen3-8B" / "config.json"
    path.write_text(json.dumps(config))
    by_file = load_model_description(path)
    by_dir = load_model_description(tmp_path / "Qwen3-8B")
    assert by_file.name == by_dir.name == "Qwen3-8B"
    assert by_file.source == str(path)
    assert by_file.layer_to_spec == load_model_description("qwen3-8b").layer_to_spec


def load_config_text(name: str) -> str:
    from importlib import resources

    return resources.files("pagedkv").joinpath("data", "configs", f"{name}.json").read_text()


# --------------------------------------------------------------------------- family rules


LLAMA_LIKE = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "torch_dtype": "float16",
}


def test_defaults_head_dim_and_kv_heads():
    d = describe_model(LLAMA_LIKE)
    # head_dim = 256 / 4; no num_key_value_heads: one KV head per query head.
    assert set(d.layer_to_spec.values()) == {FullAttentionSpec(16, 4, 64, 2)}


def test_layer_types_win():
    config = LLAMA_LIKE | {
        "model_type": "qwen3",
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    d = describe_model(config)
    assert [s.kind for s in d.layer_to_spec.values()] == ["sliding_window", "full_attention"] * 2


def test_qwen2_use_sliding_window_from_max_window_layers():
    config = LLAMA_LIKE | {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 2,
    }
    d = describe_model(config)
    assert [s.kind for s in d.layer_to_spec.values()] == ["full_attention"] * 2 + [
        "sliding_window"
    ] * 2


def test_gemma3_text_config_with_layer_types_and_pattern():
    text = {
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 4,
        "sliding_window": 512,
        "sliding_window_pattern": 2,
    }
    d = describe_model({"model_type": "gemma3", "text_config": text, "torch_dtype": "bfloat16"})
    assert [s.kind for s in d.layer_to_spec.values()] == ["sliding_window", "full_attention"] * 2
    text["layer_types"] = ["full_attention"] * 3 + ["sliding_attention"]
    d = describe_model({"model_type": "gemma3", "text_config": text})
    assert [s.kind for s in d.layer_to_spec.values()] == ["full_attention"] * 3 + ["sliding_window"]
    assert d.dtype == "float32"


def test_llama4_explicit_no_rope_layers():
    text = LLAMA_LIKE | {"attention_chunk_size": 64, "no_rope_layers": [1, 0, 0, 1]}
    d = describe_model({"model_type": "llama4", "text_config": text})
    assert [s.kind for s in d.layer_to_spec.values()] == [
        "chunked_local_attention",
        "full_attention",
        "full_attention",
        "chunked_local_attention",
    ]
    assert d.dtype == "float16"  # from text_config


def test_nemotron_h_pattern():
    config = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M*-",
        "num_hidden_layers": 5,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_head_dim": 32,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 32,
        "n_groups": 2,
        "conv_kernel": 4,
        "torch_dtype": "bfloat16",
    }
    d = describe_model(config)
    assert list(d.layer_to_spec) == ["layers.0.mamba", "layers.2.mamba", "layers.3.self_attn"]
    # conv dim = 8 × 16 + 2 × 2 × 32 = 256.
    assert d.layer_to_spec["layers.0.mamba"] == MambaSpec(16, ((256, 3), (8, 16, 32)), 2)
    assert d.layer_to_spec["layers.3.self_attn"] == FullAttentionSpec(16, 2, 32, 2)
    # Mode "align": vLLM 0.33's Mamba-2 layers take one prefill checkpoint block a request.
    aligned = describe_model(config, mamba_cache_mode="align").layer_to_spec["layers.0.mamba"]
    assert (aligned.num_prefill_checkpoint_blocks, aligned.prefill_checkpoint_alignment) == (1, 1)
    assert aligned.max_state_blocks_per_request() == 3


def test_whisper_and_bart():
    whisper = {
        "model_type": "whisper",
        "d_model": 768,
        "decoder_attention_heads": 12,
        "decoder_layers": 12,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "torch_dtype": "float32",
    }
    d = describe_model(whisper)
    assert kinds(d) == {"full_attention": 12, "cross_attention": 12}
    assert d.layer_to_spec["decoder.layers.0.encoder_attn"] == CrossAttentionSpec(16, 12, 64, 4)
    assert (d.max_position_embeddings, d.max_num_encoder_input_tokens) == (448, 1500)
    bart = {
        "model_type": "bart",
        "d_model": 1024,
        "decoder_attention_heads": 16,
        "decoder_layers": 12,
        "max_position_embeddings": 1024,
    }
    d = describe_model(bart)
    assert (d.max_position_embeddings, d.max_num_encoder_input_tokens) == (1024, 1024)


def test_deepseek_v2():
    config = {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 27,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    assert set(describe_model(config).layer_to_spec.values()) == {MLAAttentionSpec(16, 1, 576, 2)}


# --------------------------------------------------------------------------- errors


def test_missing_field_names_file_and_field(tmp_path):
    config = json.loads(load_config_text("llama-3.1-8b"))
    del config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        load_model_description(path)
    assert str(caught.value) == f"{path}: field 'num_hidden_layers' is missing"


def test_missing_nested_field_names_its_path():
    with pytest.raises(ConfigError, match=r"field 'text_config.num_hidden_layers' is missing"):
        describe_model({"model_type": "gemma3", "text_config": {"num_attention_heads": 8}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"num_attention_heads": "32"},
            "field 'num_attention_heads' must be an integer >= 1, got '32'",
        ),
        ({"num_key_value_heads": 0}, "field 'num_key_value_heads' must be an integer >= 1, got 0"),
        ({"hidden_size": 250}, "field 'hidden_size' 250 is not divisible by 4 heads"),
        ({"torch_dtype": "int4"}, "field 'torch_dtype' names an unknown dtype 'int4'"),
        ({"model_type": "gpt2"}, "field 'model_type' names an unsupported model type 'gpt2'"),
        ({"layer_types": ["full_attention"]}, "field 'layer_types' must be a list of"),
        (
            {"layer_types": ["full_attention"] * 3 + ["linear_attention"]},
            "field 'layer_types' has unsupported entry 'linear_attention'",
        ),
    ],
)
def test_malformed_fields(change, message):
    with pytest.raises(ConfigError, match="^<config>: " + re.escape(message)):
        describe_model(LLAMA_LIKE | change)


def test_jamba_missing_mamba_field():
    config = json.loads(load_config_text("jamba-v0.1"))
    del config["mamba_d_state"]
    with pytest.raises(ConfigError, match="field 'mamba_d_state' is missing"):
        describe_model(config, source="jamba.json")


def test_missing_model_type_and_non_object():
    with pytest.raises(ConfigError, match="field 'model_type' is missing"):
        describe_model({"num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        describe_model([1, 2])


def test_invalid_json_and_unknown_name(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{path}: not valid JSON"):
        load_model_description(path)
    with pytest.raises(ConfigError, match=r"no-such-model: no such file and no shipped config"):
        load_model_description("no-such-model")


def test_dtype_names():
    assert get_dtype_bytes("bf16") == get_dtype_bytes("torch.bfloat16") == 2
    assert get_dtype_bytes("FP32") == 4
    assert get_dtype_bytes("fp8_e4m3") == 1
    with pytest.raises(ConfigError, match="unknown dtype 'int3'"):
        get_dtype_bytes("int3")
    with pytest.raises(ConfigError, match="block_size must be a positive int, got 0"):
        describe_model(LLAMA_LIKE, block_size=0)
