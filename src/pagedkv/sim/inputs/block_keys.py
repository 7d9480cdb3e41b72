"""Simulator layer: prefix-cache block keys computed from a trace prompt's token runs.

A trace prompt is stored as runs of consecutive token ids. The key of a block names the runs
before it and its end offset in the run it ends in, so it is equal for two prompts exactly
when their tokens up to the block's end are equal, as a chained token hash is (barring
SHA-256 collisions). Replay feeds these ints to the manager instead of hashing 145 M tokens.
Knows nothing of the manager.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

from pagedkv.block import BlockHash
from pagedkv.errors import InvalidArgumentError
from pagedkv.hashing import HashedRequest, RequestBlockHasher
from pagedkv.sim.inputs.traces import MAX_TOKEN_ID, TokenRun, TraceRequest

# A key is `run_id * _SPREAD + end_offset`: unique, since an offset is at most 2**32 (a run's
# token ids are distinct uint32 values) and _SPREAD is larger. Hot path, two choices:
# - an int hashes to itself (below 2**61 - 1), and its low bits pick the first dict slot
#   probed; an odd multiplier with mixed bits (the golden ratio's) spreads every run's n-th
#   block over the table, where a shift would give them all one slot (2-2.5x slower probes);
# - keys stay below 2**63 (for fewer than 2**29 runs), where `range` yields machine-sized
#   ints in C instead of adding Python ints step by step.
_SPREAD = 0x2_9E37_79B9


def canonical_runs(runs: Sequence[TokenRun]) -> Iterator[TokenRun]:
    """Yield the maximal runs of a token sequence given as runs (empty runs dropped).

    Runs that continue each other (`first + num_tokens` is the next run's first id) are
    joined, so two equal token sequences always give the same runs.
    """
    run_first = run_length = -1
    for first, num_tokens in runs:
        if num_tokens <= 0:
            continue
        if run_first >= 0 and run_first + run_length == first:
            run_length += num_tokens
            continue
        if run_first >= 0:
            yield run_first, run_length
        run_first, run_length = first, num_tokens
    if run_first >= 0:
        yield run_first, run_length


def runs_of_token_ids(token_ids: Sequence[int]) -> list[TokenRun]:
    """The maximal runs of consecutive ids of an explicit prompt (one Python step a token)."""
    runs: list[TokenRun] = []
    if not token_ids:
        return runs
    first = previous = token_ids[0]
    for token in token_ids[1:]:
        if token != previous + 1:
            runs.append((first, previous - first + 1))
            first = token
        previous = token
    runs.append((first, previous - first + 1))
    return runs


class TraceBlockKeys:
    """Block keys of trace prompts at one block size, consistent across every prompt given.

    Invariant: for any two prompts keyed by the same instance, key `i` of one equals key `j`
    of the other iff `i == j` and their first `(i + 1) * block_size` tokens are equal. Proof
    sketch: the maximal runs of a prefix are those of the prompt, the last one cut at the
    prefix's end; run ids intern (previous complete prefix, first token id) and complete
    prefixes intern (run id, run length), so a key determines the prefix's runs and back.
    """

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        # complete prefix id * _SPREAD + first token id -> run id, from 1.
        self._run_ids: dict[int, int] = {}
        # run id * _SPREAD + run length -> id of the complete prefix ending there, from 1.
        self._prefix_ids: dict[int, int] = {}

    def get_keys(self, request: TraceRequest) -> list[int]:
        """The keys of every full block of the prompt, in position order."""
        block_size = self.block_size
        keys: list[int] = []
        for run_id, num_tokens_before, num_tokens in self._walk(request, _prompt_runs(request)):
            base = run_id * _SPREAD
            # Hot path: the blocks ending inside this run are one C-level range of keys.
            first_end = block_size - num_tokens_before % block_size
            keys += range(base + first_end, base + num_tokens + 1, block_size)
        return keys

    def get_output_run(self, request: TraceRequest) -> tuple[int, int]:
        """(key base, first token position) of the run holding the request's output tokens.

        The output ids continue from `output_token_start`, so the block ending at position
        `p` past that first position has key `base + p - first position`, as `get_keys` of
        the prompt followed by those tokens would give.
        """
        runs = [*_prompt_runs(request), (request.output_token_start, 1)]
        *_, (run_id, num_tokens_before, _) = self._walk(request, runs)
        return run_id * _SPREAD, num_tokens_before

    def _walk(
        self, request: TraceRequest, runs: Sequence[TokenRun]
    ) -> Iterator[tuple[int, int, int]]:
        """Yield (run id, tokens before it, its tokens) for each maximal run, interning ids.

        The prefix ending with a run is interned only once the walk moves past it.
        """
        run_ids = self._run_ids
        prefix_ids = self._prefix_ids
        prefix_id = 0  # the empty prefix
        num_tokens_before = 0
        previous_key = None
        for first, num_tokens in canonical_runs(runs):
            if not 0 <= first <= MAX_TOKEN_ID - num_tokens + 1:
                raise InvalidArgumentError(
                    f"request {request.request_id}: token run ({first}, {num_tokens}) leaves "
                    f"[0, {MAX_TOKEN_ID}]"
                )
            if previous_key is not None:
                complete = prefix_ids.get(previous_key)
                if complete is None:
                    complete = prefix_ids[previous_key] = len(prefix_ids) + 1
                prefix_id = complete
            run_key = prefix_id * _SPREAD + first
            run_id = run_ids.get(run_key)
            if run_id is None:
                run_id = run_ids[run_key] = len(run_ids) + 1
            yield run_id, num_tokens_before, num_tokens
            previous_key = run_id * _SPREAD + num_tokens
            num_tokens_before += num_tokens


def _prompt_runs(request: TraceRequest) -> Sequence[TokenRun]:
    if request.explicit_prompt is not None:
        return runs_of_token_ids(request.explicit_prompt)
    return request.prompt_runs


class TraceBlockHasher(RequestBlockHasher):
    """A request block hasher that keys trace requests by their token runs (no SHA-256).

    For serve mode: `register` each request's trace request before building its `Request`,
    `forget` it when it finishes. Prompt blocks get `TraceBlockKeys.get_keys`; blocks ending
    in the output (output token i is `output_token_start + i`, as serve mode samples) get
    keys of the output run. Same equality as hashing the tokens; never for KV events, whose
    consumers need real digests.
    """

    __slots__ = ("keys", "_requests")

    def __init__(self, hash_block_size: int) -> None:
        super().__init__(hash_block_size)
        self.keys = TraceBlockKeys(hash_block_size)
        # request id -> (trace request, output run (key base, first position) once needed)
        self._requests: dict[str, list] = {}

    def register(self, request_id: str, trace_request: TraceRequest) -> None:
        self._requests[request_id] = [trace_request, None]

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __call__(
        self, request: HashedRequest, packed_tokens: bytes | None = None
    ) -> list[BlockHash]:
        """The keys of the request's newly full blocks (see `RequestBlockHasher.__call__`)."""
        block_size = self.hash_block_size
        start_block = len(request.block_hashes)
        end_block = request.num_tokens // block_size
        if end_block <= start_block:
            return []
        entry = self._requests[request.request_id]
        trace_request = entry[0]
        keys: list[int] = []
        num_prompt_blocks = trace_request.num_prompt_tokens // block_size
        if start_block < num_prompt_blocks:
            keys = self.keys.get_keys(trace_request)[start_block:end_block]
            start_block += len(keys)
        if start_block < end_block:
            if entry[1] is None:
                entry[1] = self.keys.get_output_run(trace_request)
            base, first_position = entry[1]
            start_end = (start_block + 1) * block_size - first_position
            keys += range(
                base + start_end, base + end_block * block_size - first_position + 1, block_size
            )
        # Ints, not digests: the pool only compares keys (see TraceBlockKeys).
        return cast(list[BlockHash], keys)
