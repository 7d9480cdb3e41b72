"""Chunked local attention: earlier chunks are null and count as computed, the search inside the
current chunk is left to right, and earlier chunks' blocks are freed once passed."""

from __future__ import annotations

from pagedkv import BlockPool
from pagedkv.managers import ChunkedLocalAttentionManager
from tests.support.hybrid import admit, chunked, ids, make_manager, make_request


def hit_ids(manager, request) -> tuple[list[int], int]:
    blocks, num_tokens, _ = manager.get_computed_blocks(request)
    return blocks.get_block_ids()[0], num_tokens


def test_skipped_tokens_are_the_earlier_chunks() -> None:
    manager = ChunkedLocalAttentionManager(chunked(4, 8), BlockPool(4, hash_block_size=4), 0)
    assert [manager.get_num_skipped_tokens(n) for n in (13, 8, 7, 0)] == [8, 8, 0, 0]


def test_earlier_chunks_count_as_computed() -> None:
    manager = make_manager(12, chunked(4, 8))
    prompt = list(range(30))
    first = make_request("a", prompt, 4)
    # Nothing is cached, yet the 24 tokens before the last token's chunk need no KV at all.
    assert hit_ids(manager, first) == ([0, 0, 0, 0, 0, 0], 24)
    num_hit, new_blocks = admit(manager, first)
    assert num_hit == 24 and new_blocks.get_block_ids() == ([1, 2],)
    assert manager.get_block_ids("a") == ([0, 0, 0, 0, 0, 0, 1, 2],)
    manager.check_invariants()
    # Inside the chunk the search goes left to right: block 1 (position 6) is cached.
    assert hit_ids(manager, make_request("b", prompt, 4)) == ([0, 0, 0, 0, 0, 0, 1], 28)
    manager.evict_blocks({1})
    assert hit_ids(manager, make_request("c", prompt, 4)) == ([0, 0, 0, 0, 0, 0], 24)


def test_chunk_not_a_multiple_of_the_block_size() -> None:
    # Chunk 10, blocks of 4: block 2 holds tokens 8..11 and straddles the first chunk's end.
    manager = make_manager(12, chunked(4, 10))
    first = make_request("a", range(9), 4)
    num_hit, new_blocks = admit(manager, first)
    assert num_hit == 0 and new_blocks.get_block_ids() == ([1, 2, 3],)
    manager.free(first)
    second = make_request("b", list(range(8)) + list(range(100, 106)), 4)
    # Position 13's chunk starts at 10, but its block 2 misses; a hit of 8 tokens lands in the
    # first chunk and needs blocks 0 and 1 themselves, which are cached.
    assert hit_ids(manager, second) == ([1, 2], 8)


def test_hit_is_cut_to_the_alignment_within_the_chunk() -> None:
    pool = BlockPool(16, hash_block_size=4)
    spec = chunked(4, 12)
    manager = ChunkedLocalAttentionManager(spec, pool, 0, alignment_tokens=8)
    request = make_request("a", range(22), 4)
    manager.allocate_new_blocks("a", 22)
    manager.cache_blocks(request, 20)  # positions 0..4 (blocks 1..5) cached

    def search(max_length: int) -> tuple[list[int], int]:
        blocks, num_tokens = ChunkedLocalAttentionManager.find_longest_cache_hit(
            request.block_hashes, max_length, (0,), pool, spec, 8
        )
        return ids(blocks[0]), num_tokens

    assert search(21) == ([0, 0, 0, 4], 16)  # 20 cut to 16, still in the chunk from 12
    # 13 -> 12 cut to 8 leaves the chunk: the hit must then hold blocks 0 and 1 of chunk 0.
    assert search(13) == ([1, 2], 8)


def test_decode_frees_the_previous_chunk() -> None:
    manager = make_manager(12, chunked(4, 8))
    request = make_request("a", range(7), 4)
    admit(manager, request)
    assert manager.get_block_ids("a") == ([1, 2],)
    request.append_output_token_ids(7)
    manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    assert manager.get_block_ids("a") == ([1, 2],)
    request.append_output_token_ids(8)
    manager.allocate_slots(request, 1)
    # 8 tokens processed: the next token starts chunk 1, so chunk 0's blocks go.
    assert manager.get_block_ids("a") == ([0, 0, 3],)
    manager.check_invariants()


def test_admission_cap() -> None:
    spec = chunked(4, 8)
    assert spec.max_admission_blocks(1024, 4) == 3  # cdiv(min(8 + 4, 1024), 4)
    request = make_request("a", range(100), 4)
    fits = make_manager(4, spec, max_model_len=1024, max_in_flight_tokens=4)  # 3 usable
    assert fits.allocate_slots(request, 4, full_sequence_must_fit=True) is not None
    short = make_manager(3, spec, max_model_len=1024, max_in_flight_tokens=4)  # 2 usable
    assert short.allocate_slots(request, 4, full_sequence_must_fit=True) is None
