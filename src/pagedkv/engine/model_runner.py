"""Engine adapter: a transformers Llama-family causal LM whose attention uses the paged store.

The model, its weights and every module (embedding, q/k/v/o projections, q/k norms, rotary
embedding, RMS norms, MLP, lm_head) are transformers' own; only the attention core and its
cache handling are replaced: new keys and values go to the `PagedKVStore`, attention reads them
back through block tables. Knows nothing of scheduling.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.engine.attention import get_attention_backend
from pagedkv.engine.attention_metadata import AttentionMetadata
from pagedkv.engine.paged_kv import PagedKVStore
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.sizing import get_kv_cache_config, get_kv_cache_layout, get_num_blocks
from pagedkv.specs import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
# Architectures whose attention reads `config.sliding_window` for every layer (in transformers,
# Llama ignores the field; Qwen2/Qwen3 decide per layer and say so on the module).
_CONFIG_WINDOW_ARCHITECTURES = ("MistralForCausalLM",)


def _config_file(model_path: str | Path) -> Path:
    path = Path(model_path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise InvalidArgumentError(f"model path {str(model_path)!r} has no config.json")
    return config_file


def _has_weights(model_path: str | Path) -> bool:
    path = Path(model_path)
    return path.is_dir() and any(
        next(path.glob(pattern), None) is not None for pattern in _WEIGHT_FILE_PATTERNS
    )


def load_config(model_path: str | Path):
    """The transformers config of a checkpoint directory or a `config.json` (no weights read).

    Raises `InvalidArgumentError` without a config.json and `ConfigError` for one transformers
    cannot read.
    """
    from transformers import AutoConfig

    config_file = _config_file(model_path)
    try:
        config_dict = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{config_file} is not a readable JSON config: {exc}") from exc
    model_type = config_dict.pop("model_type", None) if isinstance(config_dict, dict) else None
    if model_type is None:
        raise ConfigError(f"{config_file} has no model_type")
    try:
        return AutoConfig.for_model(model_type, **config_dict)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{config_file}: transformers cannot build this config: {exc}") from exc


def count_parameters(config) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def load_model(
    model_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
):
    """A transformers causal LM from a local checkpoint directory or a config alone.

    `model_path` is a directory with `config.json` and weights (loaded with `from_pretrained`,
    offline), or a `config.json` file / a directory holding only one (the model is built with
    `from_config` and random weights drawn after `torch.manual_seed(seed)`).
    """
    from transformers import AutoModelForCausalLM

    if _has_weights(model_path):
        model = AutoModelForCausalLM.from_pretrained(
            Path(model_path), dtype=dtype, local_files_only=True
        )
    else:
        config = load_config(model_path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # transformers wraps `PreTrainedModel.to` in a decorator whose annotation drops `self`.
    return model.to(device).eval()  # type: ignore[arg-type]


@dataclass(frozen=True)
class LayerPlan:
    """How one decoder layer's attention maps onto the KV cache."""

    layer_name: str
    group_id: int
    sliding_window: int | None


def layer_sliding_windows(model) -> list[int | None]:
    """The sliding window of each decoder layer, as the model's own attention applies it."""
    config = model.config
    config_window = None
    if type(model).__name__ in _CONFIG_WINDOW_ARCHITECTURES:
        config_window = getattr(config, "sliding_window", None)
    windows = []
    for layer in model.model.layers:
        attn = layer.self_attn
        # Qwen2/Qwen3 decide per layer (config.layer_types) and keep it on the module.
        windows.append(attn.sliding_window if hasattr(attn, "sliding_window") else config_window)
    return windows


def _rope_types(config) -> list[str]:
    """Every RoPE type a config names (transformers 5 may keep one per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return []
    values = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
    return [str(p.get("rope_type") or p.get("type") or "default") for p in values]


def check_rope(config) -> None:
    """Raise `ConfigError` for RoPE types whose frequencies depend on the batch.

    transformers' `dynamic` and `longrope` recompute the frequencies from the longest position
    in the forward pass, so a request's keys would depend on what it is batched with (and,
    in transformers itself, on the path its cache took); the engine refuses them.
    """
    for rope_type in _rope_types(config):
        if "dynamic" in rope_type or rope_type == "longrope":
            raise ConfigError(
                f"RoPE type {rope_type!r} rescales frequencies by the batch's longest position; "
                "the paged engine supports only position-independent RoPE (default, linear, "
                "llama3, yarn)"
            )


def eos_token_ids(model) -> tuple[int, ...]:
    """The EOS ids transformers' `generate` stops at (generation config, else model config)."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_kv_cache_specs(model, *, block_size: int, dtype_bytes: int) -> dict[str, KVCacheSpec]:
    """One spec per decoder layer (named `model.layers.{i}.self_attn`), in model order.

    A layer with a sliding window gets a `SlidingWindowSpec`, the others a `FullAttentionSpec`.
    """
    config = model.config
    num_kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = _head_dim(config)
    layer_to_spec: dict[str, KVCacheSpec] = {}
    for index, window in enumerate(layer_sliding_windows(model)):
        name = f"model.layers.{index}.self_attn"
        if window is None:
            layer_to_spec[name] = FullAttentionSpec(block_size, num_kv_heads, head_dim, dtype_bytes)
        else:
            layer_to_spec[name] = SlidingWindowSpec(
                block_size, num_kv_heads, head_dim, dtype_bytes, window
            )
    return layer_to_spec


def make_kv_cache_config(
    model,
    *,
    block_size: int,
    num_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    hybrid: bool = False,
) -> KVCacheConfig:
    """The model's `KVCacheConfig`, grouped and sized by `pagedkv.sizing`.

    Give `num_blocks`, or `kv_cache_memory_bytes` to fit as many blocks as the budget holds.
    With `hybrid=False` a model mixing full and sliding-window layers is managed as full
    attention (the window stays on the spec; compute still applies it); a model whose layers
    are all windowed keeps its sliding-window manager either way, as in the reference.
    """
    if (num_blocks is None) == (kv_cache_memory_bytes is None):
        raise ConfigError(
            f"give exactly one of num_blocks ({num_blocks!r}) and "
            f"kv_cache_memory_bytes ({kv_cache_memory_bytes!r})"
        )
    dtype_bytes = next(model.parameters()).element_size()
    layer_to_spec = layer_kv_cache_specs(model, block_size=block_size, dtype_bytes=dtype_bytes)
    layout = get_kv_cache_layout(layer_to_spec, disable_hybrid=not hybrid)
    if num_blocks is None:
        num_blocks = get_num_blocks(layout, kv_cache_memory_bytes or 0)
    return get_kv_cache_config(layout, num_blocks)


class ModelRunner:
    """Runs one flattened step of a supported model on the paged store.

    Invariants: the store holds a tensor for every decoder layer; each layer reads the
    metadata of its KV-cache group; the model's own modules are used unchanged.
    """

    def __init__(
        self, model, kv_cache_config: KVCacheConfig, *, attention_backend: str = "sdpa"
    ) -> None:
        architecture = type(model).__name__
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"model architecture {architecture} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        check_rope(model.config)
        self.backend = get_attention_backend(attention_backend)
        self.store = PagedKVStore(kv_cache_config, dtype=self.dtype, device=self.device)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        windows = layer_sliding_windows(model)
        self.layer_plans: list[LayerPlan] = []
        for index, window in enumerate(windows):
            layer_name = f"model.layers.{index}.self_attn"
            group_id = self.store.layer_to_group.get(layer_name)
            if group_id is None:
                raise ConfigError(f"the KV-cache config has no group for layer {layer_name!r}")
            self.layer_plans.append(LayerPlan(layer_name, group_id, window))
        self.block_sizes = tuple(
            g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
        )
        self.head_dim = _head_dim(model.config)
        modeling = importlib.import_module(type(model).__module__)
        self._apply_rotary = modeling.apply_rotary_pos_emb

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: Sequence[AttentionMetadata],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[len(logits_indices), vocab]` for the chosen rows of a flattened step.

        Args:
            input_ids: `[num_tokens]` the step's tokens, sequence after sequence.
            metadata: one `AttentionMetadata` per KV-cache group (same token layout).
            logits_indices: flattened rows whose next-token logits are wanted.
        """
        if len(metadata) != self.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"{len(metadata)} metadata objects for {self.num_kv_cache_groups} KV-cache groups"
            )
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)  # [num_tokens, hidden]
        positions = metadata[0].positions
        cos, sin = inner.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0], sin[0]  # [num_tokens, head_dim]
        for layer, plan in zip(inner.layers, self.layer_plans, strict=True):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = residual + self._attention(
                layer.self_attn, hidden, cos, sin, plan, metadata[plan.group_id]
            )
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = inner.norm(hidden.index_select(0, logits_indices))
        return self.model.lm_head(hidden)

    def _attention(
        self,
        attn,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: LayerPlan,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        shape = (num_tokens, -1, self.head_dim)
        query = attn.q_proj(hidden).view(shape)
        key = attn.k_proj(hidden).view(shape)
        value = attn.v_proj(hidden).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm over each head before rotary
            query = attn.q_norm(query)
            key = attn.k_norm(key)
        query, key = self._apply_rotary(query, key, cos, sin, unsqueeze_dim=1)
        kv_cache = self.store.kv_caches[plan.layer_name]
        self.backend.write_kv(kv_cache, key, value, metadata.slot_mapping)
        out = self.backend.attend(query, kv_cache, metadata, attn.scaling, plan.sliding_window)
        return attn.o_proj(out.reshape(num_tokens, -1))
