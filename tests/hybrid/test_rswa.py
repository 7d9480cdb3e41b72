"""R-SWA (reference sliding-window attention, vLLM 0.33): the prompt stays visible, generated
tokens only within the last `rswa_window`; the gap between the prompt's last block and the
decode window is freed as the window moves (newest first, once), the prompt is prefix-cached as
full attention. Values checked call for call against vLLM's manager in
tests/integrations/test_vllm_parity.py."""

from __future__ import annotations

import pytest

from pagedkv import ConfigError, InvalidTypeError, RSWASpec
from pagedkv.managers import RSWAManager
from tests.support.hybrid import make_manager, make_request


def rswa(block_size: int, window: int) -> RSWASpec:
    return RSWASpec(block_size, 1, 8, 2, rswa_window=window)


def decode(manager, request, num_tokens: int) -> dict[int, list[int]]:
    """Decode `num_tokens` one at a time; the table after each, by computed tokens."""
    tables = {}
    for token in range(num_tokens):
        request.append_output_token_ids(1000 + token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        tables[request.num_computed_tokens] = manager.get_block_ids(request.request_id)[0]
    return tables


def test_the_gap_is_freed_as_the_window_moves() -> None:
    manager = make_manager(40, rswa(4, 8))
    assert isinstance(manager.coordinator.single_type_managers[0], RSWAManager)
    request = make_request("a", range(10), 4)  # the prompt: blocks 1-3 (tokens 0-11)
    assert manager.allocate_slots(request, 10).get_block_ids() == ([1, 2, 3],)
    request.num_computed_tokens = 10
    tables = decode(manager, request, 22)
    assert tables[24] == [1, 2, 3, 4, 5, 6]  # the window (16-23) still reaches block 4
    # 24 processed: the window starts at 16, so block 4 (tokens 12-15) is the gap.
    assert tables[25] == [1, 2, 3, 0, 5, 6, 7]
    assert tables[32] == [1, 2, 3, 0, 0, 6, 7, 8]
    # Full decode blocks were cached, so freed ones wait at the tail, evictable.
    assert manager.block_pool.free_block_ids()[-2:] == [4, 5]
    manager.check_invariants()
    manager.free(request)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(make_request("b", range(10), 4))
    assert (hits.get_block_ids(), num_hit_tokens) == (([1, 2],), 8)


def test_without_the_prompt_length_nothing_is_freed() -> None:
    manager = make_manager(40, rswa(4, 4))
    request = make_request("a", range(4), 4)
    manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    # Slots for 16 tokens straight from the group's manager: no allocate_slots frees a gap.
    manager.coordinator.single_type_managers[0].allocate_new_blocks("a", 16)
    manager.remove_skipped_blocks("a", 16)
    assert manager.get_block_ids("a") == ([1, 2, 3, 4],)
    manager.remove_skipped_blocks("a", 16, num_prompt_tokens=4)  # window 12-15: 4-11 are gap
    assert manager.get_block_ids("a") == ([1, 0, 0, 4],)
    manager.check_invariants()


def test_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="rswa_window must be a positive int, got 0"):
        RSWASpec(4, 1, 8, 2)
    manager = make_manager(40, rswa(4, 4))
    with pytest.raises(InvalidTypeError, match="num_prompt_tokens must be an int, got '4'"):
        manager.remove_skipped_blocks("a", 16, num_prompt_tokens="4")
