"""Adapter (extra `[torch]`): run a Hugging Face causal LM with its KV cache in pagedkv's blocks.

Never imported by the core. Modules: `paged_kv` (the paged KV tensors and slot mapping),
`attention` (attention over block tables), `model_runner` (a transformers Llama-family model
whose attention reads and writes the paged store), `sampling` and `engine` (the loop driving
pagedkv's scheduler and KV-cache manager).
"""

from __future__ import annotations

import os
import sys

from pagedkv.errors import MissingDependencyError, install_hint

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"pagedkv.engine needs PyTorch and transformers: {install_hint('torch')}"
    ) from exc


def choose_triton_mode() -> None:
    """Select Triton's interpreter when there is no GPU, before triton is first imported.

    Triton decides when it decorates a function (its own library functions too, at import)
    whether it is compiled or interpreted, and without a GPU only the interpreter can run a
    kernel. Building a transformers model imports triton (through torch._dynamo), so this runs
    when `pagedkv.engine` is imported; it changes nothing once triton is loaded or the user
    chose a mode.
    """
    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


choose_triton_mode()
