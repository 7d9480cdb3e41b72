"""Simulator report layer: the built-in hardware profiles of the cost model, as text
(`pagedkv simulate --list-profiles`)."""

from __future__ import annotations

from pagedkv.sim import cost_model


def render_profiles() -> str:
    """Each profile: its description, KV capacity and cost-model coefficients."""
    lines = []
    for name, profile in sorted(cost_model.PROFILES.items()):
        model = profile.cost_model()
        lines.append(f"{name}: {profile.description}")
        lines.append(
            f"  KV {profile.kv_bytes_per_token:,} bytes/token, "
            f"{profile.num_kv_blocks(16) * 16:,} KV tokens, max_model_len {profile.max_model_len:,}"
        )
        lines.append(
            f"  step_overhead_s={model.step_overhead_s:.4g} prefill_token_s="
            f"{model.prefill_token_s:.4g} decode_seq_s={model.decode_seq_s:.4g} "
            f"kv_token_read_s={model.kv_token_read_s:.4g} "
            f"prefill_attention_pair_s={model.prefill_attention_pair_s:.4g}"
        )
    return "\n".join(lines) + "\n"
