"""Simulator layer: prefix-cache block keys computed from a trace prompt's token runs.

A trace prompt is stored as runs of consecutive token ids. The key of a block names the runs
before it and its end offset in the run it ends in, so it is equal for two prompts exactly
when their tokens up to the block's end are equal, as a chained token hash is (barring
SHA-256 collisions). Replay feeds these ints to the manager instead of hashing 145 M tokens.
Knows nothing of the manager.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.traces import MAX_TOKEN_ID, TokenRun, TraceRequest

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
        if request.explicit_prompt is not None:
            runs: Sequence[TokenRun] = runs_of_token_ids(request.explicit_prompt)
        else:
            runs = request.prompt_runs
        block_size = self.block_size
        run_ids = self._run_ids
        prefix_ids = self._prefix_ids
        keys: list[int] = []
        prefix_id = 0  # the empty prefix
        num_tokens_before = 0
        for first, num_tokens in canonical_runs(runs):
            if not 0 <= first <= MAX_TOKEN_ID - num_tokens + 1:
                raise InvalidArgumentError(
                    f"request {request.request_id}: token run ({first}, {num_tokens}) leaves "
                    f"[0, {MAX_TOKEN_ID}]"
                )
            run_key = prefix_id * _SPREAD + first
            run_id = run_ids.get(run_key)
            if run_id is None:
                run_id = run_ids[run_key] = len(run_ids) + 1
            base = run_id * _SPREAD
            # Hot path: the blocks ending inside this run are one C-level range of keys.
            first_end = block_size - num_tokens_before % block_size
            keys += range(base + first_end, base + num_tokens + 1, block_size)
            prefix_key = base + num_tokens
            complete = prefix_ids.get(prefix_key)
            if complete is None:
                complete = prefix_ids[prefix_key] = len(prefix_ids) + 1
            prefix_id = complete
            num_tokens_before += num_tokens
        return keys
