"""pagedkv's options and KV hints in vLLM 0.33: `additional_config["pagedkv"]` and
`Request.kv_hints`, through vLLM's real `Scheduler` (pagedkv's subclass). Needs the `[vllm]`
extra: `.ci/vllm-suites` runs it in its vLLM venv; elsewhere it is skipped."""

from __future__ import annotations

import logging

import pytest

vllm = pytest.importorskip("vllm", reason="no vLLM in this venv: .ci/vllm-suites runs this")
torch = pytest.importorskip("torch")

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from pagedkv import ConfigError  # noqa: E402
from pagedkv.integrations.vllm import Scheduler  # noqa: E402
from pagedkv.integrations.vllm.kv_hints import (  # noqa: E402
    KvHintReader,
    MalformedHint,
    parse_retention_payload,
)
from pagedkv.integrations.vllm.options import PagedKVOptions, parse_options  # noqa: E402
from pagedkv.retention import RetentionConfig, TokenRangeRetention  # noqa: E402
from pagedkv.sim.vllm_serve import write_model_config  # noqa: E402

init_none_hash(sha256)
BS = 16
HASHER = get_request_block_hasher(BS, sha256)


def make_scheduler(tmp_path, num_blocks: int, pagedkv: dict | None = None) -> Scheduler:
    model_config = ModelConfig(
        model=write_model_config(str(tmp_path), 1024),
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=1024,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config={} if pagedkv is None else {"pagedkv": pagedkv},
    )
    vllm_config.scheduler_config.async_scheduling = False
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
    )


def request(request_id: str, tokens: list[int], kv_hints=None) -> Request:
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=1, ignore_eos=True),
        None,
        block_hasher=HASHER,
        kv_hints=kv_hints,
    )


def run_to_completion(scheduler: Scheduler, *requests: Request) -> None:
    """Serve the requests: each step samples one token for every scheduled request."""
    for item in requests:
        scheduler.add_request(item)
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            return
        output = scheduler.schedule()
        request_ids = list(output.num_scheduled_tokens)
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=request_ids,
                req_id_to_index={rid: i for i, rid in enumerate(request_ids)},
                sampled_token_ids=[[7] for _ in request_ids],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            ),
        )
    raise AssertionError("the requests did not finish")


def retention_hints(*actions: KvHintAction) -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version="1", message_id="m1", actions=list(actions))


KEEP_PROMPT = KvHintAction(
    action_id="a1",
    action_type="pagedkv.retention",
    action_version="1",
    payload={"ranges": [{"start": 0, "end": None, "priority": 100, "duration_s": None}]},
)


def hit_tokens(scheduler: Scheduler, tokens: list[int]) -> int:
    probe = request("probe", tokens)
    return scheduler.kv_cache_manager.get_computed_blocks(probe)[1]


@pytest.mark.parametrize("hinted", [False, True])
def test_retained_blocks_survive_eviction_pressure_in_vllms_scheduler(tmp_path, hinted):
    scheduler = make_scheduler(tmp_path, 1 + 8, {"retention": True})
    kept = list(range(1000, 1033))  # 2 full blocks + 1 token
    hints = retention_hints(KEEP_PROMPT) if hinted else None
    run_to_completion(scheduler, request("kept", kept, hints))
    assert hit_tokens(scheduler, kept + [5]) == 32
    # Pressure: four prompts of 3 blocks each, one after another, through an 8-block pool.
    for index in range(4):
        run_to_completion(
            scheduler, request(f"flood{index}", list(range(index * 100, index * 100 + 40)))
        )
    assert hit_tokens(scheduler, kept + [5]) == (32 if hinted else 0)
    manager = scheduler.kv_cache_manager
    assert manager.kv_hints.num_applied == (1 if hinted else 0)
    assert manager.core.get_eviction_stats().num_retained_blocks == (2 if hinted else 0)
    manager.core.check_invariants()


def test_unknown_and_malformed_hints_are_counted_logged_once_and_never_raise(tmp_path, caplog):
    scheduler = make_scheduler(tmp_path, 1 + 16, {"retention": True})
    bad = [
        KvHintAction("b1", "other.vendor", "1", {}),
        KvHintAction("b2", "pagedkv.retention", "2", {}),
        KvHintAction("b3", "pagedkv.retention", "1", {"ranges": [{"start": -1, "priority": 1}]}),
        KvHintAction("b4", "pagedkv.retention", "1", {"ranges": "all"}),
        KvHintAction("b5", "other.vendor", "9", {"x": 1}),
    ]
    import prometheus_client

    def sample(name, **labels):
        return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0

    before_type = sample("pagedkv:kv_hints_skipped_total", kind="unknown_type")
    before_applied = sample("pagedkv:kv_hints_applied_total")
    with caplog.at_level(logging.WARNING, logger="pagedkv.integrations.vllm"):
        run_to_completion(
            scheduler,
            request("r1", list(range(40)), retention_hints(*bad)),
            request("r2", list(range(100, 140)), retention_hints(KEEP_PROMPT, KEEP_PROMPT)),
        )
    reader = scheduler.kv_cache_manager.kv_hints
    assert reader.num_skipped == {
        "unknown_type": 2,
        "unknown_version": 1,
        "malformed": 2,
        "retention_off": 0,
        "duplicate": 1,
    }
    assert reader.num_applied == 1
    # The same counts in Prometheus (vLLM's /metrics registry).
    assert sample("pagedkv:kv_hints_skipped_total", kind="unknown_type") - before_type == 2
    assert sample("pagedkv:kv_hints_applied_total") - before_applied == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "pagedkv.integrations.vllm"]
    assert len(messages) == 4  # one line per kind seen
    assert any("ranges[0].start=-1" in m for m in messages)


def test_hints_without_retention_are_skipped_with_the_option_to_turn_it_on(tmp_path, caplog):
    scheduler = make_scheduler(tmp_path, 1 + 16)
    with caplog.at_level(logging.WARNING, logger="pagedkv.integrations.vllm"):
        run_to_completion(scheduler, request("r", list(range(40)), retention_hints(KEEP_PROMPT)))
    assert scheduler.kv_cache_manager.kv_hints.num_skipped["retention_off"] == 1
    assert '"retention": true' in caplog.text
    # The default options build the plain LRU queue (no policy object).
    assert scheduler.kv_cache_manager.core.block_pool.eviction_policy is None


def test_options_choose_the_policy_and_the_lookahead(tmp_path):
    scheduler = make_scheduler(tmp_path, 1 + 16, {"eviction": "hazard", "lookahead": True})
    core = scheduler.kv_cache_manager.core
    assert core.get_eviction_stats().policy == "hazard"
    run_to_completion(scheduler, request("a", list(range(40))))
    # The subclass registered the waiting request (a session policy heard of it).
    waiting = request("w", list(range(32)) + [1, 2])
    scheduler.add_request(waiting)
    assert core.get_eviction_stats().num_protected_blocks == 2
    core.check_invariants()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"evction": "lfu"}, "unknown option 'evction'; known: eviction, lookahead"),
        ({"eviction": "belady"}, "eviction='belady'; choose one of lru, lfu"),
        ({"lookahead": 1}, "lookahead=1 must be true or false"),
        ({"max_retained_fraction": 2}, "in [0, 1]"),
        ({"host_num_blocks": 100}, "vLLM's loads through KV connectors"),
        ("lru", "expected an object of options"),
    ],
)
def test_a_bad_option_stops_start_up_with_one_line(tmp_path, section, message):
    with pytest.raises(ConfigError) as info:
        make_scheduler(tmp_path, 17, section)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert text.startswith('additional_config["pagedkv"]: ')


def test_parse_options_defaults_and_values():
    assert parse_options({}) == PagedKVOptions()
    assert parse_options(object()) == PagedKVOptions()
    options = parse_options({"pagedkv": {"eviction": "s3fifo", "retention": True}})
    assert options.eviction_config().policy == "s3fifo"
    assert options.eviction_config().retention and not options.is_default


def test_retention_payload_schema():
    assert parse_retention_payload(
        {
            "ranges": [
                {"start": 0, "end": 512, "priority": 90, "duration_s": 60},
                {"start": 512, "end": None, "priority": 10, "duration_s": None},
            ],
            "decode_priority": 0,
        }
    ) == RetentionConfig(
        (TokenRangeRetention(0, 512, 90, 60.0), TokenRangeRetention(512, None, 10, None)), 0
    )
    for payload, where in (
        ({"ranges": [{"start": 0, "priority": 101}]}, "priority=101"),
        ({"ranges": [{"start": 5, "end": 5, "priority": 1}]}, "end=5"),
        ({"ranges": [{"start": 0, "priority": 1, "duration_s": 0}]}, "duration_s=0"),
        (
            {"ranges": [{"start": 0, "end": 9, "priority": 1}, {"start": 4, "priority": 1}]},
            "overlap",
        ),
        ({"decode_priority": "high"}, "decode_priority='high'"),
        ({"extra": 1}, "unknown payload key 'extra'"),
        ([], "payload must be an object"),
    ):
        with pytest.raises(MalformedHint, match=where):
            parse_retention_payload(payload)
    reader = KvHintReader(retention_enabled=True)
    assert reader.retention_for("not an envelope") is None
    assert reader.num_skipped["malformed"] == 1
