"""Simulator layer: serve mode driven by vLLM 0.33's own `Scheduler` (extra `[vllm]`).

The same trace, clock, cost model and report as `serve`, but each step is vLLM's `schedule()`
and `update_from_output()` with a simulated `ModelRunnerOutput` (one token per request whose
prompt is done: the trace's deterministic output ids). The KV-cache manager is pagedkv's
(`pagedkv.integrations.vllm`) or vLLM's own. With async scheduling, batches overlap as in vLLM's
engine core (`step_with_batch_queue`, a queue of two): the next batch is scheduled while the
previous one runs, before its tokens are known. Imports vLLM (and torch) at import time.
"""

# ruff: noqa: E402 - the environment default above the imports must come first
from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, cast

# vLLM's CPU platform wherever this runs: no model runs, and a platform adjusts the config (the
# results would depend on the machine). Set before vLLM is imported: it reads it then.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.structured_output import StructuredOutputManager

from pagedkv.errors import InvariantViolation
from pagedkv.integrations.vllm import AsyncScheduler as PagedKVAsyncScheduler
from pagedkv.integrations.vllm import Scheduler as PagedKVScheduler
from pagedkv.sched import StepRecord
from pagedkv.sim.inputs.block_keys import TraceBlockHasher
from pagedkv.sim.inputs.traces import Trace, TraceRequest
from pagedkv.sim.serve import ProgressCallback, ServeConfig, ServeResult, ServeRun, StopCallback
from pagedkv.sim.vllm_options import VllmOptions, check_supported
from pagedkv.stats import PrefixCacheStats

# vLLM's engine core keeps this many batches in flight with async scheduling (its batch queue).
ASYNC_BATCH_QUEUE_SIZE = 2
# vLLM's hash functions by `--hash-algorithm` (`--hash-tokens`: vLLM hashes every block).
_HASH_FUNCTIONS = {"sha256": "sha256", "sha256_cbor": "sha256_cbor", "xxh3_128": "xxhash_cbor"}


class _Batch:
    """A scheduled step on its way through the simulated GPU."""

    __slots__ = ("output", "request_ids", "samples", "first_ids", "end_s")

    def __init__(
        self,
        output: Any,
        request_ids: list[str],
        samples: list[bool],
        first_ids: list[str],
        end_s: float,
    ) -> None:
        self.output = output
        self.request_ids = request_ids  # in the batch's order
        self.samples = samples  # per request: it samples a token at the batch's end
        self.first_ids = first_ids  # sampling requests that had no output token yet
        self.end_s = end_s


class _PrefixCacheTotals:
    """The run's prefix-cache counters, summed over vLLM's per-step `PrefixCacheStats`."""

    def __init__(self) -> None:
        self.totals = PrefixCacheStats()

    def add(self, stats: Any) -> None:
        totals = self.totals
        totals.requests += stats.requests
        totals.queries += stats.queries
        totals.hits += stats.hits
        totals.preempted_requests += stats.preempted_requests
        totals.preempted_queries += stats.preempted_queries
        totals.preempted_hits += stats.preempted_hits

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self.totals


class VllmServeRun(ServeRun):
    """One serve simulation with vLLM's `Scheduler`; the tallies and the summary are serve's.

    Invariants: a request is in `vllm_requests` from `add_request` until it is finished and
    accounted; at most `ASYNC_BATCH_QUEUE_SIZE` batches (1 without async scheduling) are in
    flight, and they end in the order they were scheduled. With FCFS, arrived requests are
    built only while at most `max_num_seqs` wait (as in serve; vLLM admits from the head).
    """

    # ServeRun's constructor builds pagedkv's scheduler; this one builds vLLM's instead and
    # sets the same tallies. TODO(#21): share one base once serve.py is split.
    def __init__(
        self,
        trace: Trace,
        config: ServeConfig,
        options: VllmOptions,
        model_dir: str,
        *,
        defer_arrivals: bool = True,
    ) -> None:
        check_supported(config)
        self.options = options
        # `vllm` is vLLM's scheduler, typed as vLLM types it (not as pagedkv's `Scheduler`,
        # which `scheduler` is typed as in ServeRun's methods that read it).
        self.vllm: Any = make_scheduler(config, options, model_dir)
        self.scheduler = self.vllm
        self.prefix_cache = _PrefixCacheTotals()
        self.manager = cast(Any, self.prefix_cache)  # what `summary()` asks for the stats
        self.hasher: Any
        self.trace_hasher: TraceBlockHasher | None = None
        if not config.enable_prefix_caching:
            self.hasher = None
        elif config.hash_tokens:
            hash_fn = _vllm_hash_function(config.hash_algorithm)
            init_none_hash(hash_fn)
            self.hasher = get_request_block_hasher(config.block_size, hash_fn)
        else:
            self.trace_hasher = TraceBlockHasher(config.block_size)
            self.hasher = _block_hasher(self.trace_hasher, options.kv_manager)
        self.config = config
        self.requests = trace.requests
        self.arrivals = [request.arrival_time_s * config.time_scale for request in self.requests]
        self.next_index = 0
        self.arrived: deque[tuple[TraceRequest, float]] = deque()
        self.defer_arrivals = defer_arrivals and config.policy == "fcfs"
        self.start_s = self.now = self.arrivals[0] if self.arrivals else 0.0
        self.result = ServeResult(summary={})
        self.timings = {}
        self.ttfts = []
        self.tpots = []
        self.latencies = []
        self.totals = dict.fromkeys(self.totals_keys(), 0)
        self.preempted_ids = set()
        self.area = {"usage": 0.0, "running": 0.0, "waiting": 0.0}
        self.peak = {"usage": 0.0, "running": 0, "waiting": 0}
        self.kv_loads = []
        self.num_kv_loads = self.num_loaded_tokens = 0
        self.interrupted = False
        self.vllm_requests: dict[str, VllmRequest] = {}
        self.in_flight: deque[_Batch] = deque()
        self.gpu_free_s = self.now  # when the simulated GPU finishes the batches in flight
        self.batch_queue_size = ASYNC_BATCH_QUEUE_SIZE if options.async_scheduling else 1
        self.num_empty_batches = 0  # consecutive batches that scheduled nothing

    @staticmethod
    def totals_keys() -> tuple[str, ...]:
        from pagedkv.sim.serve import _TOTALS

        return _TOTALS

    def run(
        self, progress: ProgressCallback | None, should_stop: StopCallback | None = None
    ) -> None:
        """Serve to completion, or until `should_stop()` (then `self.interrupted` is set).

        One turn is one call of vLLM's `step_with_batch_queue` (a queue of one without async
        scheduling, `EngineCore.step`): schedule if the queue has room, and return at once
        while it still has room; otherwise wait for the oldest batch and update from it.
        """
        scheduler = self.vllm
        in_flight = self.in_flight
        num_requests = len(self.requests)
        while (
            self.next_index < num_requests or scheduler.has_requests() or self.arrived or in_flight
        ):
            if should_stop is not None and should_stop():
                self.interrupted = True
                return
            self.admit_arrivals()
            if self.arrived:
                self.queue_arrived()
            if len(in_flight) < self.batch_queue_size and scheduler.has_requests():
                batch = self.launch(scheduler.schedule())
                in_flight.append(batch)
                if len(in_flight) < self.batch_queue_size:
                    continue  # the engine schedules the next batch before waiting
            if in_flight:
                self.complete(in_flight.popleft())
            elif self.next_index < num_requests:
                self.now = max(self.now, self.arrivals[self.next_index])  # idle until then
            if progress is not None:
                progress(self.num_done)

    def queue_arrived(self) -> None:
        """Build and queue arrived requests while at most `max_num_seqs` are waiting."""
        arrived = self.arrived
        scheduler = self.vllm
        max_num_seqs = scheduler.scheduler_config.max_num_seqs
        while arrived and len(scheduler.waiting) <= max_num_seqs:
            trace_request, arrival_s = arrived.popleft()
            self.add_request(self.make_request(trace_request, arrival_s), trace_request, arrival_s)

    def make_request(self, trace_request: TraceRequest, arrival_s: float) -> Any:
        """vLLM's request for `trace_request`: its output length as max_tokens, no EOS."""
        if self.trace_hasher is not None:
            self.trace_hasher.register(trace_request.request_id, trace_request)
        return VllmRequest(
            trace_request.request_id,
            trace_request.prompt_token_ids(),
            SamplingParams(max_tokens=trace_request.num_output_tokens, ignore_eos=True),
            None,
            arrival_time=arrival_s,
            priority=trace_request.priority,
            block_hasher=self.hasher,
        )

    def add_request(self, request: Any, trace_request: TraceRequest, arrival_s: float) -> None:
        super().add_request(request, trace_request, arrival_s)
        self.vllm_requests[request.request_id] = request

    def launch(self, output: Any) -> _Batch:
        """Put a scheduled batch on the simulated GPU: after the batches before it, for as long
        as the cost model says; record the step as serve does."""
        scheduler = self.vllm
        requests = scheduler.requests
        num_prefill = num_decode = num_kv_read = num_pairs = 0
        request_ids: list[str] = []
        token_counts: list[int] = []
        samples: list[bool] = []
        first_ids: list[str] = []
        # Hot path: one pass over the batch for the cost model's counts and the sampling list.
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = requests[request_id]
            # vLLM advanced num_computed_tokens when it scheduled the batch.
            num_computed = request.num_computed_tokens - num_new
            request_ids.append(request_id)
            token_counts.append(num_new)
            if num_new == 1 and num_computed >= request.num_prompt_tokens:
                num_decode += 1
            else:
                num_prefill += num_new
                num_pairs += num_new * num_computed + num_new * (num_new + 1) // 2
            num_kv_read += num_computed + num_new
            if request.is_prefill_chunk:
                samples.append(False)
            else:
                samples.append(True)
                if not request.num_output_tokens:
                    first_ids.append(request_id)
        if not request_ids:
            self.num_empty_batches += 1
            if self.num_empty_batches > self.batch_queue_size and not self.in_flight:
                self.wait_for_arrival(output)
            return _Batch(output, request_ids, samples, first_ids, max(self.now, self.gpu_free_s))
        self.num_empty_batches = 0
        num_running, num_waiting = scheduler.get_request_counts()
        preempted = output.preempted_req_ids or ()
        record = StepRecord(
            step_index=scheduler.current_step,
            scheduled_request_ids=tuple(request_ids),
            num_scheduled_tokens=tuple(token_counts),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_kv_tokens_read=num_kv_read,
            num_prefill_attention_pairs=num_pairs,
            num_admitted=len(output.scheduled_new_reqs),
            num_prefix_hit_tokens=0,  # vLLM reports hits per step through its stats instead
            preempted_request_ids=tuple(sorted(preempted)),
            usage=scheduler.kv_cache_manager.usage,
            num_running=num_running,
            num_waiting=num_waiting,
        )
        start_s = max(self.now, self.gpu_free_s)
        duration_s = self.config.cost_model.step_time_s(record)
        self.account_batch(record, start_s, duration_s)
        self.gpu_free_s = start_s + duration_s
        return _Batch(output, request_ids, samples, first_ids, self.gpu_free_s)

    def wait_for_arrival(self, output: Any) -> None:
        """Nothing can be scheduled and nothing is in flight: the next arrival is all that can
        change that (vLLM waits for it); with none left, the run cannot finish."""
        if self.next_index >= len(self.requests) and not self.arrived:
            raise InvariantViolation(
                f"vLLM's scheduler scheduled nothing at step {self.vllm.current_step} "
                f"with {self.vllm.get_num_unfinished_requests()} requests unfinished and "
                "none left to arrive"
            )
        if not self.arrived:
            self.now = max(self.now, self.arrivals[self.next_index])

    def account_batch(self, record: StepRecord, start_s: float, duration_s: float) -> None:
        """Record the step's state (it holds from `start_s` for `duration_s`)."""
        now = self.now
        self.now = start_s
        self.account_step(record, duration_s)  # advances the clock to the batch's end
        self.now = now

    def complete(self, batch: _Batch) -> None:
        """The batch's end: the clock moves there, vLLM updates from its simulated output."""
        self.now = max(self.now, batch.end_s)
        output = batch.output
        requests = self.vllm_requests
        timings = self.timings
        request_ids = batch.request_ids
        sampled: list[list[int]] = []
        # Hot path: one token per sampling request, the trace's next output id.
        for request_id, samples in zip(request_ids, batch.samples, strict=True):
            request = requests.get(request_id) if samples else None
            if request is None:  # a prefill chunk, or finished by an earlier batch (async)
                sampled.append([])
                continue
            start = timings[request_id].trace_request.output_token_start
            sampled.append([start + request.num_output_tokens])
        engine_outputs = self.vllm.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=request_ids,
                req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            ),
        )
        now = self.now
        for request_id in batch.first_ids:
            timing = timings.get(request_id)
            request = requests.get(request_id)
            # Unset if an earlier batch delivered it (async), or if the token was dropped.
            if timing and request and timing.first_token_s is None and request.num_output_tokens:
                timing.first_token_s = now
        for engine_output in engine_outputs.values():
            if engine_output.scheduler_stats is not None:
                stats = engine_output.scheduler_stats.prefix_cache_stats
                if stats is not None:
                    self.prefix_cache.add(stats)
            # Hot path: the requests vLLM finished in this update, not a pass over the batch.
            for request_id in engine_output.finished_requests or ():
                self.account_finished(requests.pop(request_id))


def _block_hasher(trace_hasher: TraceBlockHasher, kv_manager: str) -> Any:
    """vLLM's `block_hasher` callable from the trace's block keys.

    pagedkv's manager takes the int keys as they are (opaque keys, as in serve); vLLM's
    appends a group id to each hash's bytes, so it gets each key as 8 bytes (keys stay below
    2**63, so equal bytes exactly when equal keys).
    """
    if kv_manager == "pagedkv":
        return trace_hasher

    def keys_as_bytes(request: Any) -> list[bytes]:
        return [cast(int, key).to_bytes(8, "little") for key in trace_hasher(request)]

    return keys_as_bytes


def _vllm_hash_function(hash_algorithm: str) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(_HASH_FUNCTIONS[hash_algorithm])


def write_model_config(directory: str, max_model_len: int) -> str:
    """A config-only decoder (Llama-shaped; no weights, no tokenizer) for vLLM's `ModelConfig`.

    vLLM's scheduler reads only the length limit and the model's kind (decoder-only, no
    multimodal inputs) from it; step times come from pagedkv's cost model, not this shape.
    """
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 1,
        "num_hidden_layers": 1,
        "num_key_value_heads": 1,
        "vocab_size": 32000,
        "max_position_embeddings": max_model_len,
        "torch_dtype": "float16",
    }
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(config))
    return directory


def make_scheduler(config: ServeConfig, options: VllmOptions, model_dir: str) -> Any:
    """vLLM's `Scheduler` (async variant with async scheduling) on the chosen manager,
    configured from serve's settings, with one full-attention group of `num_blocks`."""
    sched = config.scheduler
    max_model_len = config.max_model_len
    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        policy=config.policy,
        watermark=config.watermark,
        async_scheduling=options.async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    num_blocks = config.num_blocks + 1  # the null block
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    # vLLM's CPU platform turns async scheduling off (it has no overlap to gain); the
    # simulated GPU does, and the scheduler class below is what implements it.
    vllm_config.scheduler_config.async_scheduling = options.async_scheduling
    spec = FullAttentionSpec(
        block_size=config.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    register_all_kvcache_specs(vllm_config)
    if options.kv_manager == "pagedkv":
        scheduler_cls = PagedKVAsyncScheduler if options.async_scheduling else PagedKVScheduler
    else:
        scheduler_cls = VllmAsyncScheduler if options.async_scheduling else VllmScheduler
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.block_size,
        include_finished_set=True,  # each update's outputs name the requests it finished
        log_stats=True,
    )


def simulate_serving_vllm(
    trace: Trace,
    config: ServeConfig,
    options: VllmOptions,
    progress: ProgressCallback | None = None,
    should_stop: StopCallback | None = None,
) -> ServeResult:
    """Serve the whole trace through vLLM's scheduler (or until `should_stop()`)."""
    with tempfile.TemporaryDirectory(prefix="pagedkv-vllm-model-") as directory:
        model_dir = write_model_config(directory, config.max_model_len)
        run = VllmServeRun(trace, config, options, model_dir)
        run.run(progress, should_stop)
    run.result.summary = run.summary()
    run.result.interrupted = run.interrupted
    return run.result
