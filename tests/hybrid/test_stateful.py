"""Random lookups, admissions, chunked prefills, decodes, frees, preemptions, evictions and
resets on a hybrid model (full attention + sliding window + Mamba "align", three block sizes'
worth of alignment), with every invariant checked after each step. The Mamba blocks are larger
than a hash block and every other group can look up finely, so sub-block hits are on: hits end
on any hash block, and a hit (or a chunk) ending inside a block is copied."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import Request, RequestStatus
from pagedkv.specs import cdiv
from tests.support.hybrid import full, make_manager, make_request, mamba, swa

NUM_BLOCKS = 32
MAX_MODEL_LEN = 96
HASH_BLOCK_SIZE = 4  # where hits end (sub-block hits)
WINDOW = 12
WINDOW_BLOCKS = cdiv(WINDOW - 1, 4)  # cached blocks a window hit ends with
PREFIXES = [list(range(100 + 50 * i, 140 + 50 * i)) for i in range(3)]


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(
            NUM_BLOCKS,
            full(8),
            swa(4, WINDOW),
            mamba(8),
            hash_block_size=HASH_BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.prompts: list[list[int]] = []
        self.num_requests = 0

    def _new_request(self, prefix: int, prefix_len: int, suffix: list[int]) -> Request:
        tokens = (PREFIXES[prefix][:prefix_len] + suffix) or [7]
        self.prompts.append(tokens)
        self.num_requests += 1
        return make_request(f"r{self.num_requests}", tokens, HASH_BLOCK_SIZE)

    def _lookup(self, request: Request):
        """Look up and check the hit's shape in every group; nothing may change."""
        manager = self.manager
        free_before = manager.block_pool.free_block_ids()
        hit_blocks, num_hit, _ = manager.get_computed_blocks(request)
        assert manager.block_pool.free_block_ids() == free_before
        assert num_hit % HASH_BLOCK_SIZE == 0 and num_hit <= max(request.num_tokens - 1, 0)
        full_hits, window_hits, mamba_hits = hit_blocks.blocks
        hashes = request.block_hashes
        pool = manager.block_pool
        assert len(full_hits) == cdiv(num_hit, 8)
        for position in range(num_hit // 8):
            assert full_hits[position].block_hash == hashes[2 * position + 1]
        if num_hit % 8:
            # The hit ends inside the last block: a sub-block entry there, or a full block the
            # reconciled hit was cut back into (any prefix of a full-attention hit is one).
            last = full_hits[-1]
            assert last in pool.get_cached_blocks(hashes[num_hit // 4 - 1], 0) or (
                last.block_hash == hashes[2 * len(full_hits) - 1]
            )
        assert len(window_hits) == num_hit // 4
        num_real = min(WINDOW_BLOCKS, len(window_hits))
        assert all(b.is_null for b in window_hits[: len(window_hits) - num_real])
        for position in range(len(window_hits) - num_real, len(window_hits)):
            assert window_hits[position].block_hash == hashes[position]
        # The state at num_hit tokens, in the block of its position.
        assert len(mamba_hits) == cdiv(num_hit, 8)
        if mamba_hits:
            assert all(b.is_null for b in mamba_hits[:-1])
            assert mamba_hits[-1] in pool.get_cached_blocks(hashes[num_hit // 4 - 1], 2)
        return hit_blocks, num_hit

    def _admit(self, request: Request, chunk: int) -> bool:
        hit_blocks, num_hit = self._lookup(request)
        num_new = min(chunk, request.num_tokens - num_hit)
        free_before = self.manager.block_pool.get_num_free_blocks()
        if self.manager.allocate_slots(request, num_new, num_hit, hit_blocks) is None:
            assert self.manager.get_block_ids(request.request_id) == ([], [], [])
            assert self.manager.block_pool.get_num_free_blocks() == free_before
            return False
        self._run_copies()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_new
        self.running.append(request)
        return True

    def _run_copies(self) -> None:
        """The worker copies the step's shared blocks, then their ends are released."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        assert len(retained) == 2 * len(copies)
        self.manager.check_invariants(retained)
        self.manager.block_pool.free_blocks(retained)

    @rule(
        prefix=st.integers(0, 2),
        prefix_len=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 3), max_size=12),
        chunk=st.integers(1, 48),
    )
    def arrive(self, prefix: int, prefix_len: int, suffix: list[int], chunk: int) -> None:
        """A new request is looked up and admitted in the current step, or waits."""
        request = self._new_request(prefix, prefix_len, suffix)
        if not self._admit(request, chunk):
            self.waiting.append(request)

    @rule(
        prefix=st.integers(0, 2),
        prefix_len=st.integers(5, 40),
        suffix=st.lists(st.integers(0, 3), max_size=12),
    )
    def arrive_to_tail(self, prefix: int, prefix_len: int, suffix: list[int]) -> None:
        """A new request whose first chunk ends at its prompt's last reusable hash boundary,
        where its state is entered (inside a Mamba block unless the boundary is aligned)."""
        request = self._new_request(prefix, prefix_len, suffix)
        boundary = (request.num_tokens - 1) // HASH_BLOCK_SIZE * HASH_BLOCK_SIZE
        if not self._admit(request, boundary or request.num_tokens):
            self.waiting.append(request)

    @precondition(lambda self: self.prompts)
    @rule(index=st.integers(0, 15), extra=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def arrive_sibling(self, index: int, extra: list[int]) -> None:
        """A request extending an earlier prompt: it can hit where that prompt's tail was
        entered (inside a block: a sub-block hit and a copy)."""
        self.num_requests += 1
        tokens = self.prompts[index % len(self.prompts)] + extra
        request = make_request(f"r{self.num_requests}", tokens, HASH_BLOCK_SIZE)
        if not self._admit(request, request.num_tokens):
            self.waiting.append(request)

    @rule(prefix=st.integers(0, 2), prefix_len=st.integers(1, 40))
    def lookup(self, prefix: int, prefix_len: int) -> None:
        self._lookup(self._new_request(prefix, prefix_len, [9]))

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 48))
    def resume(self, chunk: int) -> None:
        if self._admit(self.waiting[0], chunk):
            self.waiting.pop(0)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 15), chunk=st.integers(1, 16), token=st.integers(0, 3))
    def step(self, index: int, chunk: int, token: int) -> None:
        """A new scheduler step: a chunk of the prompt, or one decode step after it."""
        self.manager.new_step_starts()
        self._advance(self.running[index % len(self.running)], chunk, token)

    def _advance(self, request: Request, chunk: int, token: int) -> None:
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens == MAX_MODEL_LEN:
                self._finish(request)
                return
            request.append_output_token_ids(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.manager.allocate_slots(request, num_new) is None:
            self._preempt(request)
            return
        self._run_copies()
        request.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(chunk=st.integers(1, 16), token=st.integers(0, 3))
    def step_all(self, chunk: int, token: int) -> None:
        """A new scheduler step advancing every running request."""
        self.manager.new_step_starts()
        for request in list(self.running):
            if request in self.running:
                self._advance(request, chunk, token)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 15))
    def finish(self, index: int) -> None:
        self._finish(self.running[index % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 15))
    def preempt(self, index: int) -> None:
        self._preempt(self.running[index % len(self.running)])

    @rule(block_ids=st.sets(st.integers(1, NUM_BLOCKS - 1), max_size=4))
    def evict(self, block_ids: set[int]) -> None:
        # Only blocks nobody holds: evicting a held block breaks the base manager's check that
        # blocks below num_cached_block are hashed (reported to the core).
        blocks = self.manager.block_pool.blocks
        self.manager.evict_blocks({i for i in block_ids if blocks[i].ref_cnt == 0})

    @rule()
    def reset(self) -> None:
        pool = self.manager.block_pool
        num_cached = pool.num_cached_blocks()
        all_free = pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert self.manager.reset_prefix_cache() == all_free
        assert pool.num_cached_blocks() == (0 if all_free else num_cached)

    @rule()
    def new_step(self) -> None:
        self.manager.new_step_starts()

    def _finish(self, request: Request) -> None:
        self.manager.free(request)
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.insert(0, request)

    @invariant()
    def invariants_hold(self) -> None:
        manager = self.manager
        manager.check_invariants()
        for request in self.running:
            tables = manager.get_block_ids(request.request_id)
            for table, block_size in zip(tables, (8, 4, 8), strict=True):
                assert len(table) == cdiv(request.num_computed_tokens, block_size)
            full_table, window_table, mamba_table = tables
            assert 0 not in full_table
            num_null = window_table.count(0)  # nulls only before the live blocks
            assert window_table[:num_null] == [0] * num_null
            # Mamba "align": at most the last state and the one being written are real.
            assert len(mamba_table) - mamba_table.count(0) <= 2
        for request in self.waiting:
            assert manager.get_block_ids(request.request_id) == ([], [], [])


TestHybridStateMachine = HybridMachine.TestCase
TestHybridStateMachine.settings = settings(
    derandomize=True, max_examples=100, stateful_step_count=40, deadline=None
)
