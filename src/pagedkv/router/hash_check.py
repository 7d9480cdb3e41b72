"""Router layer: catch a misconfigured instance from its own stream. The first `BlockStored`
events that carry token ids are hashed again with the router's algorithm, seed and block size;
a mismatch names the likely cause (block size, hash algorithm, `PYTHONHASHSEED`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedkv.block import to_external_hash
from pagedkv.events import BlockStored, KVCacheEvent
from pagedkv.hashing import PAGEDKV_SEED, REFERENCE_SEED, BlockHasher

_DEFAULT_SEEDS = {"sha256_cbor": REFERENCE_SEED, "sha256": PAGEDKV_SEED}

DEFAULT_NUM_CHECKS = 4
"""Stored events verified per instance (per publisher incarnation): one root block settles the
seed, the algorithm and the block size; a few more cost nothing."""


class BlockHashCheck:
    """Per instance: verify the first `num_checks` verifiable `BlockStored` events.

    Verifiable: token ids for every block, no extra keys and no LoRA, and a parent that is
    either none (a root block, hashed from the seed) or a hash this check computed itself (the
    wire carries only the low 64 bits, not enough to chain from). `reset` starts over (a new
    publisher incarnation may be configured differently).

    Invariant: `_verified[i]` counts the events of instance i checked and found equal; once it
    reaches `num_checks` nothing more is checked (the hot path pays one dict lookup a batch).
    """

    def __init__(
        self, algorithm: str, block_size: int, num_checks: int = DEFAULT_NUM_CHECKS
    ) -> None:
        self.hasher = BlockHasher(algorithm, block_size)
        self.block_size = block_size
        self.num_checks = num_checks
        self._verified: dict[str, int] = {}
        self._chains: dict[str, dict[Any, bytes]] = {}  # external hash -> our full hash

    def reset(self, instance_id: str) -> None:
        self._verified.pop(instance_id, None)
        self._chains.pop(instance_id, None)

    def done(self, instance_id: str) -> bool:
        return self._verified.get(instance_id, 0) >= self.num_checks

    def check(self, instance_id: str, events: Iterable[KVCacheEvent]) -> str | None:
        """None if the events agree (or cannot be checked); else the one-line diagnosis."""
        if self.done(instance_id):
            return None
        chain = self._chains.setdefault(instance_id, {})
        for event in events:
            if type(event) is not BlockStored:
                continue
            problem = self._check_stored(instance_id, event, chain)
            if problem is not None:
                return problem
            if self.done(instance_id):
                break
        return None

    def _check_stored(
        self, instance_id: str, event: BlockStored, chain: dict[Any, bytes]
    ) -> str | None:
        hashes = event.block_hashes
        if not hashes or not event.token_ids:
            return None  # a re-send ("full" report mode) or a store without tokens
        if event.block_size != self.block_size:
            return (
                f"instance {instance_id}: it caches blocks of {event.block_size} tokens, the "
                f"router hashes prompts in blocks of {self.block_size}: start the router with "
                f"--block-size {event.block_size} (or the engine with --block-size "
                f"{self.block_size}); not scored until then"
            )
        if event.extra_keys and any(keys for keys in event.extra_keys):
            return None
        if event.lora_id is not None or event.lora_name is not None:
            return None
        if len(event.token_ids) != len(hashes) * self.block_size:
            return None
        parent = None
        if event.parent_block_hash is not None:
            parent = chain.get(_external(event.parent_block_hash))
            if parent is None:
                return None  # chained from a block we did not hash: cannot tell
        ours = self._hash_chain(self.hasher, parent, event.token_ids, len(hashes))
        for position, (mine, theirs) in enumerate(zip(ours, hashes, strict=True)):
            if to_external_hash(mine) != _external(theirs):
                return self._diagnose(instance_id, event, parent, position)
            chain[_external(theirs)] = mine
        self._verified[instance_id] = self._verified.get(instance_id, 0) + 1
        return None

    @staticmethod
    def _hash_chain(
        hasher: BlockHasher, parent: bytes | None, tokens: list[int], num_blocks: int
    ) -> list[bytes]:
        size = hasher.block_size
        out: list[bytes] = []
        for start in range(0, num_blocks * size, size):
            parent = hasher.hash_block_tokens(parent, tokens[start : start + size])  # type: ignore[arg-type]
            out.append(parent)
        return out

    def _diagnose(
        self, instance_id: str, event: BlockStored, parent: bytes | None, position: int
    ) -> str:
        algorithm, seed = self.hasher.algorithm, self.hasher.seed
        head = (
            f"instance {instance_id}: its block hashes are not the router's ({algorithm}, "
            f"block size {self.block_size}, root seed {seed!r})"
        )
        default_seed = _DEFAULT_SEEDS.get(algorithm)
        if parent is None and position == 0 and default_seed not in (None, seed):
            # The engine may have no PYTHONHASHSEED while the router has one.
            default = BlockHasher(algorithm, self.block_size, default_seed)
            first = self._hash_chain(default, None, event.token_ids, 1)[0]
            if to_external_hash(first) == _external(event.block_hashes[0]):
                return (
                    f"{head}: the engine runs without PYTHONHASHSEED, the router with "
                    f"PYTHONHASHSEED={seed}; give both the same; not scored until then"
                )
        cause = (
            "another PYTHONHASHSEED or another --prefix-caching-hash-algo"
            if parent is None
            else "another --prefix-caching-hash-algo"
        )
        return (
            f"{head}: likely {cause} on the engine (vLLM: --prefix-caching-hash-algo "
            f"{algorithm} and the router's PYTHONHASHSEED); not scored until then"
        )


def _external(block_hash: Any) -> Any:
    return to_external_hash(block_hash) if type(block_hash) is bytes else block_hash
