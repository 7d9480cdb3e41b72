"""Engine adapter: decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode batch of n sequences is padded to the smallest bucket B >= n: padding sequences hold
one key in the null block and write nowhere (`PAD_SLOT_ID`). The host packs the step into
static device buffers (one copy per KV-cache group plus one for the token ids); the graph
replays the metadata derivation, every layer and the LM head, and leaves `[B, vocab]` logits
in a static buffer. Only a graph-safe backend (no host syncs, grid fixed by host bounds) may
be captured. Off CUDA the "graph" reruns the captured function on the same static buffers:
the padding logic is then testable on CPU. Knows nothing of scheduling.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.attention_metadata import derive_metadata
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.paged_kv import NULL_BLOCK_ID
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.specs import cdiv


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_num_seqs` (always included)."""
    buckets = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    buckets.update(range(16, max_num_seqs, 16))
    buckets.add(max_num_seqs)
    return tuple(sorted(buckets))


@dataclass(frozen=True)
class _Graph:
    replay: Callable[[], torch.Tensor]  # runs the step, returns its `[bucket, vocab]` logits


class DecodeGraphs:
    """Captured decode forwards of a `ModelRunner`, keyed by batch-size bucket.

    Invariants: each bucket's graph reads only the static buffers below, sized for the
    largest bucket; a bucket is captured once, on first use, into one shared memory pool.
    """

    def __init__(self, runner: ModelRunner, *, max_num_seqs: int, max_model_len: int) -> None:
        if not runner.backend.graph_safe:
            raise ConfigError(
                f"attention backend {runner.backend.name!r} cannot be captured in a CUDA graph"
            )
        self.runner = runner
        self.buckets = default_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.device = runner.device
        largest = self.buckets[-1]
        self._max_blocks = [cdiv(max_model_len, size) for size in runner.block_sizes]
        self._input_ids = torch.zeros(largest, dtype=torch.long, device=self.device)
        self._packed = [
            torch.zeros(3 * largest + 2 + largest * blocks, dtype=torch.int32, device=self.device)
            for blocks in self._max_blocks
        ]
        self._graphs: dict[int, _Graph] = {}
        self._last_bucket: int | None = None
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding `num_seqs` sequences, or None past the largest."""
        index = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[index] if index < len(self.buckets) else None

    def execute(
        self,
        input_ids: Sequence[int],
        block_tables: Sequence[Sequence[Sequence[int]]],
        seq_lens: Sequence[int],
    ) -> torch.Tensor:
        """Logits `[num_seqs, vocab]` of a decode step (one new token a sequence).

        Args:
            input_ids: the token each sequence computes.
            block_tables: per KV-cache group, one table a sequence.
            seq_lens: each sequence's length after this step (<= max_model_len).
        """
        num_seqs = len(input_ids)
        bucket = self.bucket_for(num_seqs)
        if bucket is None or max(seq_lens) > self.max_model_len:
            raise InvalidArgumentError(
                f"decode batch of {num_seqs} sequences up to {max(seq_lens)} tokens exceeds "
                f"the graphs' {self.buckets[-1]} sequences of {self.max_model_len} tokens"
            )
        graph = self._graphs.get(bucket)
        if graph is None:  # capturing overwrites the static buffers: before filling them
            graph = self._graphs[bucket] = self._capture(bucket)
        # Hot path: host packing in C-level array ops, one non-blocking copy a buffer.
        padding = bucket - num_seqs
        ids = torch.frombuffer(array("q", input_ids), dtype=torch.long)
        self._input_ids[:num_seqs].copy_(_pinned(ids), non_blocking=True)
        for tables, block_size, packed in zip(
            block_tables, self.runner.block_sizes, self._packed, strict=True
        ):
            host = _pack_decode(tables, seq_lens, block_size, padding)
            packed[: host.numel()].copy_(_pinned(host), non_blocking=True)
        self._last_bucket = bucket
        return graph.replay()[:num_seqs]

    def replay_last(self) -> torch.Tensor:
        """Replay the last executed step again (benchmarks time the graph alone with this).

        Only the last bucket's graph may run: the static buffers hold that bucket's layout,
        and another bucket's graph would read them as a different batch (out of bounds).
        """
        if self._last_bucket is None:
            raise InvalidArgumentError("no decode step has run through the graphs yet")
        return self._graphs[self._last_bucket].replay()

    def _forward(self, bucket: int) -> torch.Tensor:
        metadata = [
            derive_metadata(
                packed[: 3 * bucket + 2 + bucket * max_blocks],
                block_size=block_size,
                num_seqs=bucket,
                num_tokens=bucket,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                max_num_blocks=max_blocks,
            )
            for packed, block_size, max_blocks in zip(
                self._packed, self.runner.block_sizes, self._max_blocks, strict=True
            )
        ]
        logits_indices = torch.arange(bucket, device=self.device)
        return self.runner.forward(self._input_ids[:bucket], metadata, logits_indices)

    def _capture(self, bucket: int) -> _Graph:
        # While capturing, the buffers hold a batch of padding only: nothing is written.
        self._input_ids[:bucket].zero_()
        for packed, block_size in zip(self._packed, self.runner.block_sizes, strict=True):
            host = _pack_decode([], [], block_size, bucket)
            packed[: host.numel()].copy_(host.to(self.device))
        if self.device.type != "cuda":
            return _Graph(lambda: self._forward(bucket))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket)  # warm-up: compile kernels, initialise cuBLAS workspaces
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits  # a static buffer: read it before the next replay

        return _Graph(replay)

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))


def _pinned(host: torch.Tensor) -> torch.Tensor:
    return host.pin_memory() if torch.cuda.is_available() else host


def _pack_decode(
    tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int, padding: int
) -> torch.Tensor:
    """`PackedStep.host` layout for a decode batch plus `padding` one-key null sequences."""
    num_seqs = len(tables) + padding
    seq_lens_out = array("i", seq_lens)
    seq_lens_out.extend([1] * padding)
    starts = array("i", [0])
    block_ids = array("i")
    for table, seq_len in zip(tables, seq_lens, strict=True):
        needed = cdiv(seq_len, block_size)
        if len(table) < needed or table[needed - 1] == NULL_BLOCK_ID:
            raise InvalidArgumentError(
                f"block table {list(table)} has no real block for token {seq_len - 1} "
                f"(block size {block_size})"
            )
        part = table if len(table) == needed else table[:needed]
        if type(part) is list:  # Hot path: fromlist copies a list fastest
            block_ids.fromlist(part)
        else:
            block_ids.extend(part)
        starts.append(len(block_ids))
    for _ in range(padding):
        block_ids.append(NULL_BLOCK_ID)
        starts.append(len(block_ids))
    query_start_loc = array("i", range(num_seqs + 1))
    return torch.frombuffer(query_start_loc + seq_lens_out + starts + block_ids, dtype=torch.int32)
