"""Builders shared by the engine tests (not a test module): tiny seeded transformers models."""

from __future__ import annotations

import torch
import transformers

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A randomly initialised float32 model of `model_type`, seeded, in eval mode."""
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation: at most `max_new_tokens`, stopping at the model's
    EOS (no `min_new_tokens`: the engine must stop where transformers stops)."""
    output = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


def require_triton():
    """The kernel module (which picks Triton's interpreter without a GPU), or skip; in CI (env
    `CI` set) a missing Triton fails instead, so the kernel tests can never be skipped there
    unnoticed (the [dev] extra installs it)."""
    import os

    import pytest

    try:
        from pagedkv.engine import triton_kernels
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI runs the Triton kernel tests: install the [dev] extra (triton)")
        pytest.skip("triton is not installed (the [gpu] extra)", allow_module_level=True)
    return triton_kernels
