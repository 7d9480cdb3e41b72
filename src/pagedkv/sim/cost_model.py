"""Simulator layer: how long a scheduler step takes (a linear cost model) and built-in profiles.

The coefficients of each profile are roofline estimates from public datasheet numbers (peak
dense BF16 FLOP/s, HBM bandwidth) and model shapes, scaled by assumed efficiencies; they were
not measured on the hardware. Derivation in docs/simulate.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.sched.output import StepRecord


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """`step_time = step_overhead_s + prefill_token_s * prefill tokens
    + decode_seq_s * decode sequences + kv_token_read_s * KV tokens read
    + prefill_attention_pair_s * prefill query-key pairs` (seconds).

    Features come from the step's `StepRecord`; all coefficients are >= 0.
    """

    step_overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    kv_token_read_s: float
    prefill_attention_pair_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(
                    f"cost coefficient {name} must be a finite number >= 0, got {value!r}"
                )

    def step_time_s(self, record: StepRecord) -> float:
        return (
            self.step_overhead_s
            + self.prefill_token_s * record.num_prefill_tokens
            + self.decode_seq_s * record.num_decode_tokens
            + self.kv_token_read_s * record.num_kv_tokens_read
            + self.prefill_attention_pair_s * record.num_prefill_attention_pairs
        )

    def with_overrides(self, overrides: dict[str, float]) -> LinearCostModel:
        unknown = set(overrides) - set(asdict(self))
        if unknown:
            raise ConfigError(
                f"unknown cost coefficient(s) {sorted(unknown)}; known: {sorted(asdict(self))}"
            )
        return replace(self, **overrides)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A model on some GPUs, reduced to the numbers the cost model and the pool size need.

    Efficiencies are assumptions: the fraction of peak FLOP/s a prefill reaches and the
    fraction of peak HBM bandwidth a decode step reaches.
    """

    name: str
    description: str
    num_params: float
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int
    num_gpus: int
    peak_flops_per_gpu: float
    hbm_bytes_per_s_per_gpu: float
    memory_bytes_per_gpu: float
    weight_dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes_per_gpu: float = 2e9
    # Host link per GPU, one direction (datasheet; PCIe Gen5 x16 64 GB/s, Gen4 x16 32 GB/s).
    pcie_bytes_per_s_per_gpu: float = 64e9

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.weight_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: `2 * layers * kv_heads * head_size * dtype_bytes`."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.kv_dtype_bytes

    @property
    def achievable_flops(self) -> float:
        return self.num_gpus * self.peak_flops_per_gpu * self.compute_efficiency

    @property
    def achievable_bytes_per_s(self) -> float:
        return self.num_gpus * self.hbm_bytes_per_s_per_gpu * self.bandwidth_efficiency

    @property
    def kv_cache_bytes(self) -> float:
        """Memory left for the KV cache: utilised memory minus activations and weights."""
        per_gpu = self.memory_bytes_per_gpu * self.gpu_memory_utilization
        return self.num_gpus * (per_gpu - self.activation_reserve_bytes_per_gpu) - self.weight_bytes

    @property
    def host_load_s_per_token(self) -> float:
        """Seconds to load one token's KV from host memory: every GPU loads its shard over
        its own link, at the assumed `bandwidth_efficiency` of the link's peak."""
        link_bytes_per_s = self.num_gpus * self.pcie_bytes_per_s_per_gpu * self.bandwidth_efficiency
        return self.kv_bytes_per_token / link_bytes_per_s

    def num_kv_blocks(self, block_size: int) -> int:
        """Usable blocks of `block_size` tokens that fit in `kv_cache_bytes`."""
        return int(self.kv_cache_bytes // (self.kv_bytes_per_token * block_size))

    def cost_model(self) -> LinearCostModel:
        """Roofline coefficients (each term alone; real kernels overlap some of them)."""
        flop_per_token = 2.0 * self.num_params  # one multiply-add per weight
        attention_flop_per_pair = 4.0 * self.num_layers * self.num_attention_heads * self.head_size
        return LinearCostModel(
            step_overhead_s=self.weight_bytes / self.achievable_bytes_per_s,
            prefill_token_s=flop_per_token / self.achievable_flops,
            decode_seq_s=flop_per_token / self.achievable_flops,
            kv_token_read_s=self.kv_bytes_per_token / self.achievable_bytes_per_s,
            prefill_attention_pair_s=attention_flop_per_pair / self.achievable_flops,
        )


# Datasheet peaks (dense BF16, no sparsity): H100 SXM 989.4 TFLOP/s, 3.35 TB/s, 80 GB;
# H200 SXM 989.4 TFLOP/s, 4.8 TB/s, 141 GB; A100 SXM 80GB 312 TFLOP/s, 2.039 TB/s, 80 GB.
_H100: dict[str, Any] = {
    "peak_flops_per_gpu": 989.4e12,
    "hbm_bytes_per_s_per_gpu": 3.35e12,
    "memory_bytes_per_gpu": 80e9,
}
_H200: dict[str, Any] = {
    "peak_flops_per_gpu": 989.4e12,
    "hbm_bytes_per_s_per_gpu": 4.8e12,
    "memory_bytes_per_gpu": 141e9,
}
_A100: dict[str, Any] = {
    "peak_flops_per_gpu": 312e12,
    "hbm_bytes_per_s_per_gpu": 2.039e12,
    "memory_bytes_per_gpu": 80e9,
    "pcie_bytes_per_s_per_gpu": 32e9,  # PCIe Gen4 x16
}
# Model shapes from the published configs (params, layers, attention heads, KV heads, head size).
_LLAMA_8B: dict[str, Any] = {
    "num_params": 8.03e9,
    "num_layers": 32,
    "num_attention_heads": 32,
    "num_kv_heads": 8,
    "head_size": 128,
    "max_model_len": 131072,
}
_LLAMA_70B: dict[str, Any] = {
    "num_params": 70.6e9,
    "num_layers": 80,
    "num_attention_heads": 64,
    "num_kv_heads": 8,
    "head_size": 128,
    "max_model_len": 131072,
}
_QWEN_7B: dict[str, Any] = {
    "num_params": 7.62e9,
    "num_layers": 28,
    "num_attention_heads": 28,
    "num_kv_heads": 4,
    "head_size": 128,
    "max_model_len": 32768,
}

PROFILES: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in (
        HardwareProfile(
            "llama3.1-8b-h100",
            "Llama-3.1-8B, BF16, one H100 SXM 80GB",
            **_LLAMA_8B,
            num_gpus=1,
            **_H100,
        ),
        HardwareProfile(
            "llama3.1-8b-h200",
            "Llama-3.1-8B, BF16, one H200 SXM 141GB",
            **_LLAMA_8B,
            num_gpus=1,
            **_H200,
        ),
        HardwareProfile(
            "llama3.1-70b-h100x4",
            "Llama-3.1-70B, BF16, four H100 SXM 80GB, tensor parallel (communication ignored)",
            **_LLAMA_70B,
            num_gpus=4,
            **_H100,
        ),
        HardwareProfile(
            "qwen2.5-7b-a100",
            "Qwen2.5-7B, BF16, one A100 SXM 80GB",
            **_QWEN_7B,
            num_gpus=1,
            **_A100,
        ),
    )
}
DEFAULT_PROFILE = "llama3.1-8b-h100"


def get_profile(name: str) -> HardwareProfile:
    profile = PROFILES.get(name)
    if profile is None:
        raise ConfigError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    return profile


def parse_cost_overrides(text: str) -> dict[str, float]:
    """Parse `name=value,name=value` (seconds) into coefficient overrides."""
    overrides: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"cost override {item!r} is not name=value")
        try:
            overrides[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"cost override {item!r}: {value!r} is not a number") from None
    return overrides
