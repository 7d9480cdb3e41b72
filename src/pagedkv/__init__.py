"""pagedkv: a standalone paged KV-cache block manager for LLM inference engines.

The core (this package's top level, `managers/`, the coordinators) imports only the standard
library; optional extras add simulation, events on the wire, metrics, routing and a PyTorch
engine adapter.
"""

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.errors import (
    ConfigError,
    ForeignBlockError,
    GroupIndexError,
    HostMemoryError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantViolation,
    PagedKVError,
    RequestStateError,
    UnknownHashAlgorithmError,
)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.hashing import BlockHasher, RequestBlockHasher, make_request_block_hasher
from pagedkv.kv_cache_manager import (
    ComputedBlocks,
    KVCacheBlockCopy,
    KVCacheBlocks,
    KVCacheManager,
)
from pagedkv.request import LoRARequest, MultiModalFeature, Request, RequestStatus
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    ReplayedSlidingWindowSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from pagedkv.stats import CachingMetrics, PrefixCacheStats

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CachingMetrics",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "ComputedBlocks",
    "ConfigError",
    "CrossAttentionSpec",
    "ForeignBlockError",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "GroupIndexError",
    "HostMemoryError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "InvariantViolation",
    "KVCacheBlock",
    "KVCacheBlockCopy",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "LoRARequest",
    "MLAAttentionSpec",
    "MambaSpec",
    "MultiModalFeature",
    "PagedKVError",
    "PrefixCacheStats",
    "Request",
    "RequestBlockHasher",
    "RequestStatus",
    "RequestStateError",
    "ReplayedSlidingWindowSpec",
    "RSWASpec",
    "SlidingWindowSpec",
    "UnknownHashAlgorithmError",
    "make_request_block_hasher",
]
