"""Model descriptions: a Hugging Face `config.json` read as JSON into one KV-cache spec per layer.

Knows each supported family's layer pattern (sliding, chunked, Mamba, MLA, cross-attention) and
its config fields; knows nothing of grouping or memory (`pagedkv.sizing`). Stdlib only: the file
is read with `json`, never with transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pagedkv.bounded_read import InputTooLargeError, read_at_most
from pagedkv.errors import ConfigError
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

DTYPE_TO_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# Hugging Face's default when a config names no dtype.
DEFAULT_DTYPE = "float32"
# Forty times the deepest published model: a bigger layer count is a broken config, and would
# build one spec entry per layer (about 150 bytes each) before anything else is checked.
MAX_NUM_LAYERS = 10_000
SHIPPED_CONFIGS_PACKAGE = "pagedkv"
_SHIPPED_CONFIGS_DIR = ("data", "configs")
# A config.json is a few KB (DeepSeek-V3's: 1.7 KB); anything this long is not one.
MAX_CONFIG_BYTES = 16 * 2**20


def get_dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (`bf16`, `bfloat16`, `torch.float16`, `fp8`, ...)."""
    key = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else dtype
    if key not in DTYPE_TO_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_TO_BYTES)}")
    return DTYPE_TO_BYTES[key]


@dataclass(frozen=True)
class ModelDescription:
    """What sizing needs to know about a model: its layers' specs, in model order.

    Layers that keep no KV cache (MLP-only, encoder) are absent from `layer_to_spec`.
    `max_num_encoder_input_tokens` is non-zero only for encoder-decoder models.
    """

    name: str
    source: str
    model_type: str
    dtype: str
    dtype_bytes: int
    layer_to_spec: dict[str, KVCacheSpec] = field(repr=False)
    max_position_embeddings: int | None
    max_num_encoder_input_tokens: int = 0


_MISSING: Any = object()


class _Reader:
    """Typed access to one (possibly nested) config dict; errors name the file and the field."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = "") -> None:
        self.data = data
        self.source = source
        self.prefix = prefix

    def error(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{self.prefix}{name}' {problem}")

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def get_int(
        self, name: str, default: Any = _MISSING, *, minimum: int = 1, maximum: int | None = None
    ) -> int:
        value = self.data.get(name)
        if value is None:
            if default is _MISSING:
                raise self.error(name, "is missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(name, f"must be an integer >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.error(name, f"must be at most {maximum:,}, got {value:,}")
        return value

    def get_num_layers(self, name: str, default: Any = _MISSING) -> int:
        return self.get_int(name, default, maximum=MAX_NUM_LAYERS)

    def nested(self, name: str) -> _Reader:
        """The reader of sub-dict `name` (Gemma 3, Llama 4 `text_config`), or self if absent."""
        value = self.data.get(name)
        if value is None:
            return self
        if not isinstance(value, dict):
            raise self.error(name, f"must be an object, got {type(value).__name__}")
        return _Reader(value, self.source, f"{self.prefix}{name}.")


@dataclass(frozen=True)
class _Context:
    block_size: int
    dtype_bytes: int
    mamba_cache_mode: str = "none"


# Family builders return (layer_to_spec, max_position_embeddings, max_num_encoder_input_tokens).
_Built = tuple[dict[str, KVCacheSpec], int | None, int]

_LAYER_TYPE_TO_KIND = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
}


def _kinds_from_layer_types(r: _Reader, num_layers: int) -> list[str] | None:
    """Per-layer kinds from a `layer_types` list (newer configs of every family), if present."""
    layer_types = r.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise r.error("layer_types", f"must be a list of num_hidden_layers={num_layers} entries")
    kinds = []
    for value in layer_types:
        if not isinstance(value, str) or value not in _LAYER_TYPE_TO_KIND:
            raise r.error(
                "layer_types",
                f"has unsupported entry {value!r} (known: {', '.join(_LAYER_TYPE_TO_KIND)})",
            )
        kinds.append(_LAYER_TYPE_TO_KIND[value])
    return kinds


def _attention_dims(r: _Reader, default_head_dim: int | None = None) -> tuple[int, int]:
    """(num_kv_heads, head_dim): kv heads default to the query heads; head_dim to hidden/heads."""
    num_heads = r.get_int("num_attention_heads")
    num_kv_heads = r.get_int("num_key_value_heads", num_heads)
    if r.has("head_dim"):
        return num_kv_heads, r.get_int("head_dim")
    if default_head_dim is not None:
        return num_kv_heads, default_head_dim
    hidden_size = r.get_int("hidden_size")
    if hidden_size % num_heads:
        raise r.error("hidden_size", f"{hidden_size} is not divisible by {num_heads} heads")
    return num_kv_heads, hidden_size // num_heads


def _decoder_specs(
    r: _Reader,
    ctx: _Context,
    kinds: list[str],
    *,
    default_head_dim: int | None = None,
    default_sliding_window: int | None = None,
) -> dict[str, KVCacheSpec]:
    """One self-attention spec per layer of a decoder-only model, from its kinds."""
    num_kv_heads, head_dim = _attention_dims(r, default_head_dim)
    args = (ctx.block_size, num_kv_heads, head_dim, ctx.dtype_bytes)
    kind_to_spec: dict[str, KVCacheSpec] = {"full": FullAttentionSpec(*args)}
    if "sliding" in kinds:
        window = r.get_int("sliding_window", default_sliding_window)
        kind_to_spec["sliding"] = SlidingWindowSpec(*args, sliding_window=window)
    if "chunked" in kinds:
        chunk = r.get_int("attention_chunk_size")
        kind_to_spec["chunked"] = ChunkedLocalAttentionSpec(*args, attention_chunk_size=chunk)
    return {f"layers.{i}.self_attn": kind_to_spec[kind] for i, kind in enumerate(kinds)}


def _llama(r: _Reader, ctx: _Context) -> _Built:
    num_layers = r.get_num_layers("num_hidden_layers")
    kinds = _kinds_from_layer_types(r, num_layers) or ["full"] * num_layers
    return _decoder_specs(r, ctx, kinds), r.get("max_position_embeddings"), 0


def _mistral(r: _Reader, ctx: _Context) -> _Built:
    """Every layer windowed when `sliding_window` is set (Mistral 7B v0.1), else full."""
    num_layers = r.get_num_layers("num_hidden_layers")
    kinds = _kinds_from_layer_types(r, num_layers)
    if kinds is None:
        kinds = ["sliding" if r.has("sliding_window") else "full"] * num_layers
    return _decoder_specs(r, ctx, kinds), r.get("max_position_embeddings"), 0


def _qwen(r: _Reader, ctx: _Context) -> _Built:
    """Qwen2/Qwen3: windowed from layer `max_window_layers` on, only if `use_sliding_window`."""
    num_layers = r.get_num_layers("num_hidden_layers")
    kinds = _kinds_from_layer_types(r, num_layers)
    if kinds is None:
        kinds = ["full"] * num_layers
        if r.get("use_sliding_window", False) and r.has("sliding_window"):
            first_windowed = r.get_int("max_window_layers", minimum=0)
            kinds = ["sliding" if i >= first_windowed else "full" for i in range(num_layers)]
    return _decoder_specs(r, ctx, kinds), r.get("max_position_embeddings"), 0


def _gemma2(r: _Reader, ctx: _Context) -> _Built:
    """Gemma 2: even layers windowed, odd layers global."""
    num_layers = r.get_num_layers("num_hidden_layers")
    kinds = _kinds_from_layer_types(r, num_layers)
    if kinds is None:
        kinds = ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
    specs = _decoder_specs(r, ctx, kinds, default_head_dim=256, default_sliding_window=4096)
    return specs, r.get("max_position_embeddings", 8192), 0


def _gemma3(r: _Reader, ctx: _Context) -> _Built:
    """Gemma 3: every `sliding_window_pattern`-th layer global (default 6), others windowed.

    Published text configs leave out fields at their Gemma3TextConfig defaults (head_dim 256,
    sliding_window 4096, max_position_embeddings 131072); those defaults apply here too.
    """
    r = r.nested("text_config")
    num_layers = r.get_num_layers("num_hidden_layers")
    kinds = _kinds_from_layer_types(r, num_layers)
    if kinds is None:
        pattern = r.get_int("sliding_window_pattern", 6)
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
    specs = _decoder_specs(r, ctx, kinds, default_head_dim=256, default_sliding_window=4096)
    return specs, r.get("max_position_embeddings", 131072), 0


def _llama4(r: _Reader, ctx: _Context) -> _Built:
    """Llama 4: RoPE layers use chunked local attention, NoPE layers (every 4th) are global.

    `no_rope_layers[i]` is 1 for a RoPE layer; an empty list means the default interval.
    """
    r = r.nested("text_config")
    num_layers = r.get_num_layers("num_hidden_layers")
    kinds = _kinds_from_layer_types(r, num_layers)
    if kinds is None:
        uses_rope = r.get("no_rope_layers") or []
        if not isinstance(uses_rope, list) or (uses_rope and len(uses_rope) != num_layers):
            raise r.error("no_rope_layers", f"must be a list of {num_layers} 0/1 entries")
        if not uses_rope:
            interval = r.get_int("no_rope_layer_interval", 4)
            uses_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
        chunked = r.has("attention_chunk_size")
        kinds = ["chunked" if chunked and rope else "full" for rope in uses_rope]
    return _decoder_specs(r, ctx, kinds), r.get("max_position_embeddings"), 0


def _jamba(r: _Reader, ctx: _Context) -> _Built:
    """Jamba: attention where `i % attn_layer_period == attn_layer_offset`, Mamba elsewhere.

    Mamba state per layer: conv `(d_inner, d_conv - 1)` and SSM `(d_inner, d_state)` with
    `d_inner = mamba_expand × hidden_size`, both in the model dtype.
    """
    num_layers = r.get_num_layers("num_hidden_layers")
    period = r.get_int("attn_layer_period")
    offset = r.get_int("attn_layer_offset", minimum=0)
    if offset >= period:
        raise r.error("attn_layer_offset", f"{offset} must be below attn_layer_period={period}")
    d_inner = r.get_int("mamba_expand") * r.get_int("hidden_size")
    conv_shape = (d_inner, r.get_int("mamba_d_conv", minimum=2) - 1)
    mamba = MambaSpec(
        ctx.block_size,
        (conv_shape, (d_inner, r.get_int("mamba_d_state"))),
        ctx.dtype_bytes,
        mamba_cache_mode=ctx.mamba_cache_mode,
    )
    attention = next(iter(_decoder_specs(r, ctx, ["full"]).values()))
    specs: dict[str, KVCacheSpec] = {}
    for i in range(num_layers):
        if i % period == offset:
            specs[f"layers.{i}.self_attn"] = attention
        else:
            specs[f"layers.{i}.mamba"] = mamba
    return specs, r.get("max_position_embeddings"), 0


def _nemotron_h(r: _Reader, ctx: _Context) -> _Built:
    """Nemotron-H: `hybrid_override_pattern` marks Mamba-2 (M), attention (*), MLP (- or E).

    Mamba-2 state: conv `(H·P + 2·G·N, conv_kernel - 1)` and SSM `(H, P, N)` for H heads of
    size P, G groups and state size N.
    """
    num_layers = r.get_num_layers("num_hidden_layers")
    pattern = r.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or len(pattern) != num_layers or set(pattern) - set("M*-E"):
        raise r.error("hybrid_override_pattern", f"must be {num_layers} characters of M, *, - or E")
    num_heads, head_dim = r.get_int("mamba_num_heads"), r.get_int("mamba_head_dim")
    state_size, num_groups = r.get_int("ssm_state_size"), r.get_int("n_groups")
    conv_dim = num_heads * head_dim + 2 * num_groups * state_size
    shapes = (
        (conv_dim, r.get_int("conv_kernel", minimum=2) - 1),
        (num_heads, head_dim, state_size),
    )
    # vLLM 0.33's Mamba-2 layers export their prefill checkpoint from inside a chunk, at any
    # token: in mode "align" each request may hold one more state block.
    align = ctx.mamba_cache_mode == "align"
    mamba = MambaSpec(
        ctx.block_size,
        shapes,
        ctx.dtype_bytes,
        mamba_cache_mode=ctx.mamba_cache_mode,
        num_prefill_checkpoint_blocks=int(align),
        prefill_checkpoint_alignment=1 if align else None,
    )
    default_head_dim = r.get("attention_head_dim")
    specs: dict[str, KVCacheSpec] = {}
    for i, mark in enumerate(pattern):
        if mark == "M":
            specs[f"layers.{i}.mamba"] = mamba
        elif mark == "*":
            num_kv_heads, attn_head_dim = _attention_dims(r, default_head_dim)
            specs[f"layers.{i}.self_attn"] = FullAttentionSpec(
                ctx.block_size, num_kv_heads, attn_head_dim, ctx.dtype_bytes
            )
    return specs, r.get("max_position_embeddings"), 0


def _deepseek(r: _Reader, ctx: _Context) -> _Built:
    """DeepSeek-V2/V3 MLA: one latent of `kv_lora_rank + qk_rope_head_dim` per token and layer.

    The multi-token-prediction layers (`num_nextn_predict_layers`) are not counted.
    """
    num_layers = r.get_num_layers("num_hidden_layers")
    latent_size = r.get_int("kv_lora_rank") + r.get_int("qk_rope_head_dim")
    spec = MLAAttentionSpec(ctx.block_size, 1, latent_size, ctx.dtype_bytes)
    specs: dict[str, KVCacheSpec] = {f"layers.{i}.self_attn": spec for i in range(num_layers)}
    return specs, r.get("max_position_embeddings"), 0


def _encoder_decoder(
    ctx: _Context, num_layers: int, num_heads: int, head_dim: int
) -> dict[str, KVCacheSpec]:
    """Decoder self-attention (full) and cross-attention specs, layer by layer."""
    args = (ctx.block_size, num_heads, head_dim, ctx.dtype_bytes)
    self_attn, cross_attn = FullAttentionSpec(*args), CrossAttentionSpec(*args)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(num_layers):
        specs[f"decoder.layers.{i}.self_attn"] = self_attn
        specs[f"decoder.layers.{i}.encoder_attn"] = cross_attn
    return specs


def _t5(r: _Reader, ctx: _Context) -> _Built:
    """T5: relative positions, so no hard length; the encoder side defaults to 512 tokens."""
    num_layers = r.get_num_layers("num_decoder_layers", r.get_num_layers("num_layers"))
    specs = _encoder_decoder(ctx, num_layers, r.get_int("num_heads"), r.get_int("d_kv"))
    return specs, None, r.get_int("n_positions", 512)


def _whisper_or_bart(r: _Reader, ctx: _Context) -> _Built:
    """Whisper (audio encoder, 1500 frames) and BART: heads of `d_model / heads` each."""
    num_heads = r.get_int("decoder_attention_heads")
    d_model = r.get_int("d_model")
    if d_model % num_heads:
        raise r.error("d_model", f"{d_model} is not divisible by {num_heads} heads")
    specs = _encoder_decoder(
        ctx, r.get_num_layers("decoder_layers"), num_heads, d_model // num_heads
    )
    if r.get("model_type") == "whisper":
        return specs, r.get_int("max_target_positions"), r.get_int("max_source_positions")
    max_len = r.get_int("max_position_embeddings")
    return specs, max_len, max_len


MODEL_TYPE_TO_BUILDER: dict[str, Callable[[_Reader, _Context], _Built]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mistral,
    "qwen2": _qwen,
    "qwen2_moe": _qwen,
    "qwen3": _qwen,
    "qwen3_moe": _qwen,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "jamba": _jamba,
    "nemotron_h": _nemotron_h,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "t5": _t5,
    "mt5": _t5,
    "whisper": _whisper_or_bart,
    "bart": _whisper_or_bart,
}


def _config_dtype(r: _Reader) -> str:
    """The dtype a config names (`dtype`, else `torch_dtype`, also under `text_config`)."""
    for reader in (r, r.nested("text_config")):
        for name in ("dtype", "torch_dtype"):
            if reader.has(name):
                value = reader.get(name)
                if not isinstance(value, str) or value.lower().removeprefix("torch.") not in (
                    DTYPE_TO_BYTES
                ):
                    raise reader.error(name, f"names an unknown dtype {value!r}")
                return value.lower().removeprefix("torch.")
    return DEFAULT_DTYPE


def describe_model(
    config: dict[str, Any],
    *,
    source: str = "<config>",
    name: str | None = None,
    block_size: int = 16,
    dtype: str | None = None,
    mamba_cache_mode: str = "none",
) -> ModelDescription:
    """Per-layer KV-cache specs of the model a parsed `config.json` describes.

    Args:
        dtype: KV-cache dtype override (`bf16`, `fp16`, `fp32`, `fp8`); default: the config's.
        mamba_cache_mode: of Mamba layers, as the reference's `--mamba-cache-mode`: "none"
            (its default without prefix caching), or "align" (what it picks with caching).

    Raises `ConfigError` naming `source` and the field for an unknown `model_type` or a
    missing or malformed field.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    r = _Reader(config, source)
    model_type = r.get("model_type")
    if model_type is None:
        raise r.error("model_type", "is missing")
    if not isinstance(model_type, str):
        raise r.error("model_type", f"must be a string, got {model_type!r}")
    builder = MODEL_TYPE_TO_BUILDER.get(model_type)
    if builder is None:
        known = ", ".join(sorted(MODEL_TYPE_TO_BUILDER))
        raise r.error(
            "model_type", f"names an unsupported model type {model_type!r} (known: {known})"
        )
    dtype_name = _config_dtype(r) if dtype is None else dtype.lower().removeprefix("torch.")
    dtype_bytes = get_dtype_bytes(dtype_name)
    layer_to_spec, max_len, encoder_len = builder(
        r, _Context(block_size, dtype_bytes, mamba_cache_mode)
    )
    if max_len is not None and (not isinstance(max_len, int) or max_len <= 0):
        raise ConfigError(f"{source}: field 'max_position_embeddings' must be a positive integer")
    return ModelDescription(
        name=name or model_type,
        source=source,
        model_type=model_type,
        dtype=dtype_name,
        dtype_bytes=dtype_bytes,
        layer_to_spec=layer_to_spec,
        max_position_embeddings=max_len,
        max_num_encoder_input_tokens=encoder_len,
    )


def shipped_config_names() -> list[str]:
    """Names of the config.json files shipped in `pagedkv/data/configs/` (without `.json`)."""
    directory = resources.files(SHIPPED_CONFIGS_PACKAGE).joinpath(*_SHIPPED_CONFIGS_DIR)
    return sorted(
        entry.name.removesuffix(".json")
        for entry in directory.iterdir()
        if entry.name.endswith(".json")
    )


def _read_config_text(config: str | os.PathLike[str]) -> tuple[str, str, str]:
    """(text, source, name) of a config file, a model directory, or a shipped config name.

    A path that exists is read as the config, whatever it is (a FIFO, `/dev/stdin`), within
    `MAX_CONFIG_BYTES`; only a path that does not exist may be a shipped name.
    """
    path = Path(config)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: a directory without a config.json file")
        path = path / "config.json"
    if path.exists():
        name = path.parent.name if path.stem == "config" else path.stem
        try:
            raw = read_at_most(path, MAX_CONFIG_BYTES, "a config.json")
            return raw.decode("utf-8"), str(path), name or path.stem
        except InputTooLargeError as exc:
            raise ConfigError(str(exc)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
    shipped = shipped_config_names()
    name = str(config).removesuffix(".json")
    if name in shipped:
        entry = resources.files(SHIPPED_CONFIGS_PACKAGE).joinpath(
            *_SHIPPED_CONFIGS_DIR, f"{name}.json"
        )
        return entry.read_text(encoding="utf-8"), f"shipped config {name}", name
    raise ConfigError(
        f"{config}: no such file and no shipped config of that name (shipped: {', '.join(shipped)})"
    )


def load_model_description(
    config: str | os.PathLike[str],
    *,
    block_size: int = 16,
    dtype: str | None = None,
    mamba_cache_mode: str = "none",
) -> ModelDescription:
    """Read a `config.json` (a path, a model directory or a shipped name) and describe it."""
    text, source, name = _read_config_text(config)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # a 5,000-digit int; 100,000 nested objects
        problem = str(exc).split(";")[0]  # not the hint to raise Python's digit limit
        raise ConfigError(f"{source}: not usable JSON ({problem})") from None
    return describe_model(
        parsed,
        source=source,
        name=name,
        block_size=block_size,
        dtype=dtype,
        mamba_cache_mode=mamba_cache_mode,
    )
