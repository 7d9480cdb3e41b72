"""vLLM 0.33's own Scheduler on pagedkv's KV-cache manager, configured by vLLM's own config
classes, without a model (docs/vllm.md). In a deployment it is one flag:

    vllm serve MODEL --scheduler-cls pagedkv.integrations.vllm.Scheduler

Here two requests sharing a 32-token prefix go through one `schedule()`: the second one hits
the blocks the first one just cached. Needs the [vllm] extra (vLLM 0.33 and its torch):

    VLLM_TARGET_DEVICE=cpu python examples/vllm_scheduler.py
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU needed: no model runs

import torch  # noqa: E402 - after the environment default, which vLLM reads at import
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from pagedkv.integrations.vllm import Scheduler  # noqa: E402 - the drop-in

BLOCK_SIZE = 16


def main() -> None:
    with tempfile.TemporaryDirectory() as model_dir:
        # A config-only model: the scheduler reads the length limit and the model's kind.
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 1,
                  "num_hidden_layers": 1, "num_key_value_heads": 1, "vocab_size": 32000,
                  "max_position_embeddings": 2048, "torch_dtype": "float16"}  # fmt: skip
        with open(os.path.join(model_dir, "config.json"), "w") as file:
            json.dump(config, file)
        model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16")
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_model_len=2048,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        )
        vllm_config.cache_config.num_gpu_blocks = 64
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        register_all_kvcache_specs(vllm_config)
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        print("KV-cache manager:", type(scheduler.kv_cache_manager).__name__)

        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        prefix = list(range(32))
        for request_id, suffix in (("a", [100, 101, 102]), ("b", [200])):
            scheduler.add_request(
                Request(
                    request_id,
                    prefix + suffix,
                    SamplingParams(max_tokens=4),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:
            num = output.num_scheduled_tokens[new.req_id]
            tokens = "1 token" if num == 1 else f"{num} tokens"
            print(f"{new.req_id}: {tokens} scheduled, blocks {new.block_ids[0]}, "
                  f"{new.num_computed_tokens} computed tokens from the prefix cache")  # fmt: skip


if __name__ == "__main__":
    main()
