"""Engine adapter: the generation loop (pagedkv's scheduler and KV-cache manager + the runner).

Each step: the scheduler picks requests and token counts and the manager hands out blocks; the
engine flattens the scheduled tokens into one forward over the paged store, samples a token for
every request whose known tokens are now all computed, and reports them back to the scheduler.
Prefix hits, preemption and recompute, and chunked prefill all come from the scheduler and the
manager; the engine only honours the block tables they give.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine.attention_metadata import build_attention_metadata, to_device
from pagedkv.engine.cuda_graphs import DecodeGraphs
from pagedkv.engine.model_runner import ModelRunner, eos_token_ids, make_kv_cache_config
from pagedkv.engine.paged_kv import NULL_BLOCK_ID
from pagedkv.engine.sampling import SamplingParams, make_generator, sample_tokens
from pagedkv.errors import (
    ConfigError,
    InvalidArgumentError,
    InvariantViolation,
    RequestStateError,
)
from pagedkv.hashing import make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request, RequestStatus
from pagedkv.sched import FCFSPolicy, Scheduler, SchedulerConfig

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class EngineConfig:
    """Cache and batching settings. Give `num_blocks` or `kv_cache_memory_bytes`.

    `attention_backend` "auto" is `triton` on a GPU when Triton is installed, else `sdpa`.
    Requests stop at `stop_token_ids` and, unless `ignore_eos`, at the model's EOS ids (as
    transformers' `generate` does). `cuda_graphs` replays decode steps from CUDA graphs when
    the backend allows it (on CPU the same padded path runs eagerly: for tests).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    hash_algorithm: str = "sha256"
    hybrid_kv_cache: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cuda_graphs: bool = True
    seed: int = 0
    record_logits: bool = False

    def __post_init__(self) -> None:
        if (self.num_blocks is None) == (self.kv_cache_memory_bytes is None):
            raise ConfigError(
                f"give exactly one of num_blocks ({self.num_blocks!r}) and "
                f"kv_cache_memory_bytes ({self.kv_cache_memory_bytes!r})"
            )


@dataclass
class RequestOutput:
    """What a request produced. `logits[i]` (if recorded) produced `output_token_ids[i]`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class EngineStats:
    """Counters and host/device time split since the engine started."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_queried_tokens: int = 0
    num_computed_tokens: int = 0
    num_sampled_tokens: int = 0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    update_s: float = 0.0


class LLMEngine:
    """Generates with a `ModelRunner`, scheduled by pagedkv.

    Invariants: every running request's KV lives in the blocks the manager gave it; a token is
    sampled for a request only when all of its known tokens have been computed; sampled ids go
    back to the scheduler in the step that produced them.
    """

    def __init__(self, model, config: EngineConfig) -> None:
        self.config = config
        self.kv_cache_config = make_kv_cache_config(
            model,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            hybrid=config.hybrid_kv_cache,
        )
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        self.runner = ModelRunner(
            model, self.kv_cache_config, attention_backend=resolve_backend(config, model)
        )
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.stop_token_ids = tuple(config.stop_token_ids) + (
            () if config.ignore_eos else eos_token_ids(model)
        )
        self.graphs = None
        if config.cuda_graphs and self.runner.backend.graph_safe:
            self.graphs = DecodeGraphs(
                self.runner, max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len
            )
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config,
            self.max_model_len,
            enable_caching=config.enable_prefix_caching,
            log_stats=True,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                stop_token_ids=self.stop_token_ids,
            ),
            policy=FCFSPolicy(),
        )
        self._block_hasher = (
            make_request_block_hasher(
                self.kv_cache_manager.hash_block_size, config.hash_algorithm, str(config.seed)
            )
            if config.enable_prefix_caching
            else None
        )
        self.stats = EngineStats()
        self._outputs: dict[str, RequestOutput] = {}
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._requests: dict[str, Request] = {}
        self._seen: set[str] = set()
        # Each running request's block ids per group, extended by the blocks each step adds
        # (reading whole tables every step costs O(context) Python per request).
        self._tables: dict[str, tuple[list[int], ...]] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt; returns its request id."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._outputs:
            raise RequestStateError(f"request id {request_id!r} is already in use")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad or not prompt_token_ids:
            raise InvalidArgumentError(
                f"request {request_id!r}: token ids {bad[:5]!r} are outside the vocabulary "
                f"[0, {self.vocab_size})"
                if bad
                else f"request {request_id!r}: the prompt is empty"
            )
        num_tokens = len(prompt_token_ids) + params.max_tokens
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r}: {len(prompt_token_ids)} prompt + {params.max_tokens} "
                f"output tokens exceed max_model_len={self.max_model_len}"
            )
        request = Request(
            request_id,
            prompt_token_ids,
            max_tokens=params.max_tokens,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        self._params[request_id] = params
        self._generators[request_id] = None
        if not params.is_greedy:
            seed = params.seed
            if seed is None:  # deterministic per engine seed and request id
                seed = zlib.crc32(f"{self.config.seed}:{request_id}".encode())
            self._generators[request_id] = make_generator(seed, self.runner.device)
        self._outputs[request_id] = RequestOutput(request_id, tuple(request.prompt_token_ids), [])
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_output(self, request_id: str) -> RequestOutput:
        """What the request has produced so far (complete once it finished)."""
        output = self._outputs.get(request_id)
        if output is None:
            raise InvalidArgumentError(f"unknown request id {request_id!r}")
        return output

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the requests that finished in it."""
        stats = self.stats
        started = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        stats.schedule_s += scheduled_at - started
        stats.num_steps += 1
        stats.num_preemptions += len(out.preempted_request_ids)
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        if prefix_stats is not None:
            stats.num_prefix_hit_tokens += prefix_stats.hits
            stats.num_prefix_queried_tokens += prefix_stats.queries
        for request_id in out.preempted_request_ids:  # their blocks are gone
            self._tables.pop(request_id, None)
        # Hits that end inside a block continue in private copies: copy before the forward.
        self.runner.store.copy_blocks(out.kv_cache_block_copies)
        sampled: dict[str, list[int]] = {}
        if out.scheduled:
            sampled = self._execute(out.scheduled)
        elif self.scheduler.has_unfinished_requests():
            raise RequestStateError(
                "the scheduler scheduled nothing while requests wait: the KV cache "
                f"({self.kv_cache_config.num_blocks} blocks) cannot hold one request"
            )
        executed_at = time.perf_counter()
        stats.forward_s += executed_at - scheduled_at
        finished = self.scheduler.update_from_output(out, sampled)
        stats.update_s += time.perf_counter() - executed_at
        return [self._finish(request) for request in finished]

    def _execute(self, scheduled: Sequence) -> dict[str, list[int]]:
        """One forward over every scheduled token; sample where a request's tokens are done."""
        input_ids: list[int] = []
        num_computed: list[int] = []
        num_new: list[int] = []
        tables: list[tuple[list[int], ...]] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for item in scheduled:
            request = item.request
            start = item.num_computed_tokens
            end = start + item.num_scheduled_tokens
            input_ids.extend(request.all_token_ids[start:end])
            num_computed.append(start)
            num_new.append(item.num_scheduled_tokens)
            tables.append(self._block_tables(item))
            output = self._outputs[request.request_id]
            if request.request_id not in self._seen:
                self._seen.add(request.request_id)
                output.num_cached_tokens = start
            if item.is_prefill_chunk_complete:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(request)
        self.stats.num_computed_tokens += len(input_ids)
        # A step of prefill chunks that complete no prompt still runs: it writes their KV.
        logits = self._forward(input_ids, num_computed, num_new, tables, sample_rows)
        if not sample_rows:
            return {}
        ids = [request.request_id for request in sample_requests]
        tokens = sample_tokens(
            logits, [self._params[i] for i in ids], [self._generators[i] for i in ids]
        )
        self.stats.num_sampled_tokens += len(tokens)
        if self.config.record_logits:
            for row, request_id in enumerate(ids):
                self._outputs[request_id].logits.append(logits[row].float().cpu())
        sampled = {}
        for request_id, token in zip(ids, tokens, strict=True):
            self._outputs[request_id].output_token_ids.append(token)
            sampled[request_id] = [token]
        return sampled

    def _block_tables(self, item) -> tuple[list[int], ...]:
        """The request's block ids per group, as the manager gave them up to this step.

        Blocks the manager later swaps for the null block (behind a sliding window) keep
        their old id here; they lie outside every window this request still reads.
        """
        request_id = item.request.request_id
        rows = self._tables.get(request_id)
        if rows is None:
            rows = self._tables[request_id] = tuple(list(ids) for ids in item.block_ids)
        else:
            for row, new_ids in zip(rows, item.new_block_ids, strict=True):
                row.extend(new_ids)
        return rows

    def _forward(
        self,
        input_ids: list[int],
        num_computed: list[int],
        num_new: list[int],
        tables: list[tuple[list[int], ...]],
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Logits of `sample_rows`: a CUDA-graph replay for decode batches, else eager."""
        runner = self.runner
        graphs = self.graphs
        if (
            graphs is not None
            and len(input_ids) == len(num_new)  # one new token a sequence: decode only
            and graphs.bucket_for(len(num_new)) is not None
        ):
            seq_lens = [computed + 1 for computed in num_computed]
            group_tables = [[row[g] for row in tables] for g in range(len(runner.block_sizes))]
            logits = graphs.execute(input_ids, group_tables, seq_lens)  # one row a sequence
            # A one-token prefill chunk that leaves its prompt unfinished samples nothing.
            return logits if len(sample_rows) == len(input_ids) else logits[sample_rows]
        device = runner.device
        metadata = [
            build_attention_metadata(
                [row[group_id] for row in tables], num_computed, num_new, block_size, device
            )
            for group_id, block_size in enumerate(runner.block_sizes)
        ]
        # Hot path: token ids and sampled rows travel in one copy.
        host = torch.frombuffer(array("q", input_ids + sample_rows), dtype=torch.long)
        ids_and_rows = to_device(host, device)
        return runner.forward(
            ids_and_rows[: len(input_ids)], metadata, ids_and_rows[len(input_ids) :]
        )

    def _finish(self, request: Request) -> RequestOutput:
        request_id = request.request_id
        del self._params[request_id], self._generators[request_id], self._requests[request_id]
        self._tables.pop(request_id, None)
        output = self._outputs[request_id]
        output.finish_reason = _FINISH_REASONS.get(request.status, request.status.name.lower())
        return output

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidArgumentError(f"{len(params)} sampling params for {len(prompts)} prompts")
        request_ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.has_unfinished_requests():
            self.step()
        return [self._outputs[request_id] for request_id in request_ids]

    def check_invariants(self) -> None:
        """Check the manager, the store (the null block untouched) and the engine's copies of
        the block tables (equal to the manager's wherever the manager's are not null)."""
        self.kv_cache_manager.check_invariants()
        self.runner.store.check_invariants()
        for request_id, rows in self._tables.items():
            for row, ids in zip(rows, self.kv_cache_manager.get_block_ids(request_id), strict=True):
                if len(row) != len(ids) or any(
                    b not in (a, NULL_BLOCK_ID) for a, b in zip(row, ids, strict=True)
                ):
                    raise InvariantViolation(
                        f"request {request_id!r}: engine table {row} != manager table {ids}"
                    )


def resolve_backend(config: EngineConfig, model) -> str:
    """The attention backend to use: `config.attention_backend`, with "auto" resolved."""
    if config.attention_backend != "auto":
        return config.attention_backend
    if next(model.parameters()).device.type != "cuda":
        return "sdpa"
    return "triton" if importlib.util.find_spec("triton") is not None else "sdpa"
