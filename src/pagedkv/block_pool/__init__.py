"""Block pool layer: every block of one device, the free blocks in eviction order, the
prefix-cache hash map, the KV event queue and the optional host tier (`BlockPool`).

`pool` holds the class; `events` builds its `BlockStored` events and `checks` its argument and
invariant checks, as functions of what the pool passes in.
"""

from pagedkv.block_pool.checks import check_pool_args, check_pool_invariants
from pagedkv.block_pool.events import block_stored_event, stored_block_positions
from pagedkv.block_pool.pool import BlockPool, BlockResidencyObserver

__all__ = [
    "BlockPool",
    "BlockResidencyObserver",
    "block_stored_event",
    "check_pool_args",
    "check_pool_invariants",
    "stored_block_positions",
]
