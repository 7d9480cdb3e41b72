"""The model runner: transformers' modules + paged attention reproduce the model's own logits."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.engine.attention_metadata import build_attention_metadata  # noqa: E402
from pagedkv.engine.model_runner import (  # noqa: E402
    ModelRunner,
    layer_sliding_windows,
    load_model,
    make_kv_cache_config,
)
from pagedkv.errors import ConfigError, InvalidArgumentError  # noqa: E402
from pagedkv.specs import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from tests.support.engine import TINY, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch

ARCHITECTURES = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=6),
}


def test_sliding_windows_follow_the_model():
    assert layer_sliding_windows(tiny_model("llama")) == [None, None]
    assert layer_sliding_windows(tiny_model("qwen2", **ARCHITECTURES["qwen2"])) == [None, 5]
    assert layer_sliding_windows(tiny_model("mistral", sliding_window=6)) == [6, 6]


def test_kv_cache_config_groups_and_sizes_the_layers():
    page_size = 2 * 4 * 2 * 16 * 4  # block 4, 2 KV heads, head_dim 16, float32
    llama = make_kv_cache_config(
        tiny_model("llama"), block_size=4, kv_cache_memory_bytes=2 * 9 * page_size + 100
    )
    assert llama.num_blocks == 9
    (group,) = llama.kv_cache_groups
    assert group.layer_names == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert group.kv_cache_spec.page_size_bytes == page_size
    mistral = make_kv_cache_config(
        tiny_model("mistral", sliding_window=6), block_size=4, num_blocks=5
    )
    (group,) = mistral.kv_cache_groups  # all layers windowed: one sliding-window group
    assert isinstance(group.kv_cache_spec, SlidingWindowSpec)
    assert group.kv_cache_spec.sliding_window == 6
    qwen2 = tiny_model("qwen2", **ARCHITECTURES["qwen2"])
    promoted = make_kv_cache_config(qwen2, block_size=4, num_blocks=5)
    (group,) = promoted.kv_cache_groups  # mixed, hybrid off: managed as full attention
    assert isinstance(group.kv_cache_spec, FullAttentionSpec)
    hybrid = make_kv_cache_config(qwen2, block_size=4, num_blocks=5, hybrid=True)
    assert [g.layer_names for g in hybrid.kv_cache_groups] == [
        ("model.layers.0.self_attn",),
        ("model.layers.1.self_attn",),
    ]
    assert isinstance(hybrid.kv_cache_groups[1].kv_cache_spec, SlidingWindowSpec)
    # Both groups' layers alias one tensor: a block id belongs to one group at a time.
    (tensor,) = hybrid.kv_cache_tensors
    assert tensor.shared_by == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    runner = ModelRunner(qwen2, hybrid)
    assert runner.store.memory_bytes == 5 * page_size  # not 2 x: the layers share it
    with pytest.raises(ConfigError, match="exactly one of num_blocks"):
        make_kv_cache_config(qwen2, block_size=4)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_chunked_paged_forward_matches_transformers_logits(model_type, backend):
    model = tiny_model(model_type, **ARCHITECTURES[model_type])
    kv_cache_config = make_kv_cache_config(model, block_size=4, num_blocks=24)
    runner = ModelRunner(model, kv_cache_config, attention_backend=backend)
    generator = torch.Generator().manual_seed(1)
    seq_a = torch.randint(0, 256, (13,), generator=generator)
    seq_b = torch.randint(0, 256, (6,), generator=generator)
    with torch.no_grad():
        expected_a = model(seq_a[None]).logits[0]
        expected_b = model(seq_b[None]).logits[0]
    table_a, table_b = [17, 3, 9, 22], [5, 11]  # scrambled block ids, never block 0
    logits_a, logits_b = [], []
    # Step 1: A's first chunk alone. Step 2: A's second chunk batched with all of B.
    # Step 3: A's last chunk batched with B's last token (a decode-shaped query).
    steps = [
        ([(table_a, 0, 5)], [seq_a[0:5]]),
        ([(table_a, 5, 1), (table_b, 0, 5)], [seq_a[5:6], seq_b[0:5]]),
        ([(table_a, 6, 7), (table_b, 5, 1)], [seq_a[6:13], seq_b[5:6]]),
    ]
    for seqs, tokens in steps:
        metadata = build_attention_metadata(
            [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], 4
        )
        input_ids = torch.cat(tokens)
        logits = runner.forward(input_ids, [metadata], torch.arange(len(input_ids)))
        offset = 0
        for (_, _, num_new), sink in zip(seqs, (logits_a, logits_b), strict=False):
            sink.append(logits[offset : offset + num_new])
            offset += num_new
    torch.testing.assert_close(torch.cat(logits_a), expected_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(logits_b), expected_b, rtol=1e-4, atol=1e-5)
    runner.store.check_invariants()


def test_runner_rejects_unsupported_models_and_missing_layers():
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    )
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is not supported"):
        ModelRunner(gpt2, KVCacheConfig(4, ()))
    model = tiny_model("llama")
    (group,) = make_kv_cache_config(model, block_size=4, num_blocks=4).kv_cache_groups
    one_layer = KVCacheGroupSpec(group.layer_names[:1], group.kv_cache_spec)
    with pytest.raises(ConfigError, match="model.layers.1.self_attn"):
        ModelRunner(model, KVCacheConfig(4, (one_layer,)))
    runner = ModelRunner(model, KVCacheConfig(4, (group,)))
    metadata = build_attention_metadata([[1]], [0], [2], 4)
    with pytest.raises(InvalidArgumentError, match="2 metadata objects for 1"):
        runner.forward(torch.tensor([1, 2]), [metadata, metadata], torch.tensor([1]))


def test_load_model_from_config_file_is_seeded(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model_type": "llama", **TINY}))
    first = load_model(config_file, seed=3)
    again = load_model(tmp_path, seed=3)
    other = load_model(config_file, seed=4)
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first.state_dict()[weight], again.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])
    with pytest.raises(InvalidArgumentError, match="no config.json"):
        load_model(tmp_path / "missing")


def test_load_model_from_a_saved_checkpoint(tmp_path):
    model = tiny_model("qwen2", seed=5)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, seed=0)  # weights come from disk, not the seed
    weight = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded.state_dict()[weight], model.state_dict()[weight])
