"""Adapter (extra `[torch]`): run a Hugging Face causal LM with its KV cache in pagedkv's blocks.

Never imported by the core. Modules: `paged_kv` (the paged KV tensors and slot mapping),
`attention` (attention over block tables), `model_runner` (a transformers Llama-family model
whose attention reads and writes the paged store), `sampling` and `engine` (the loop driving
pagedkv's scheduler and KV-cache manager).
"""

from __future__ import annotations

from pagedkv.errors import MissingDependencyError

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "pagedkv.engine needs PyTorch and transformers: pip install 'pagedkv[torch]'"
    ) from exc
