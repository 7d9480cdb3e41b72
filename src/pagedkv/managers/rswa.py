"""R-SWA manager (reference sliding-window attention, vLLM 0.33's `RSWAManager`): full attention
whose gap between the prompt and the decode window is freed as the window moves."""

from __future__ import annotations

from typing import Any, cast

from pagedkv.managers.full_attention import FullAttentionManager
from pagedkv.specs import KVCacheSpec, RSWASpec, cdiv


class RSWAManager(FullAttentionManager):
    """Invariant: the prompt's blocks are held until the request is freed; of the blocks after
    them, those entirely before the decode window (`rswa_window` tokens before the processed
    end, never before the prompt's end) are the null block. Hits and caching are full
    attention's."""

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.rswa_window = cast(RSWASpec, kv_cache_spec).rswa_window

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the gap `[cdiv(prompt, block_size), max(prompt, processed - window) //
        block_size)`, newest first, stopping at the first block freed before (as vLLM's)."""
        if num_prompt_tokens is None:
            return  # full attention skips nothing without the prompt's length
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        block_size = self.block_size
        first_gap_block = cdiv(num_prompt_tokens, block_size)
        window_start = max(num_prompt_tokens, num_computed_tokens - self.rswa_window)
        last_gap_block = min(window_start // block_size, len(blocks))
        if first_gap_block < last_gap_block:
            self._null_range(blocks, first_gap_block, last_gap_block)
