"""Leaf: the request as the KV-cache manager sees it (no sampling, no tensors).

A `Request` owns its token ids and its chained block hashes; it extends the hashes itself as
tokens are appended, through the `RequestBlockHasher` given at construction.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.block import BlockHash
from pagedkv.errors import InvalidArgumentError, InvalidTypeError, RequestStateError
from pagedkv.hashing import (
    MAX_TOKEN_ID,
    RequestBlockHasher,
    check_no_bool_tokens,
    pack_token_ids,
)
from pagedkv.retention import RetentionConfig


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every value above PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_PREEMPTED = RequestStatus.PREEMPTED


class OwnerExtendsHashes:
    """The block hasher of an external request: its owner extends the hashes, never pagedkv."""

    __slots__ = ("hash_block_size",)

    num_hash_lookahead_tokens = 0  # never consulted: nothing appends through pagedkv

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size

    def __call__(self, request: Request, packed_tokens: bytes | None = None) -> list[BlockHash]:
        raise RequestStateError(
            f"request {request.request_id!r} is external: its owner appends tokens and extends "
            "its block hashes"
        )


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter. Name *and* path enter the hash, so re-pointing a name never reuses KV."""

    name: str
    path: str
    adapter_id: int = 0


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """A multimodal item occupying prompt positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise InvalidArgumentError(
                f"multimodal feature {self.identifier!r}: offset {self.offset} must be >= 0 and "
                f"length {self.length} > 0"
            )


class Request:
    """A generation request.

    Invariants: `num_tokens == len(all_token_ids)`; `block_hashes` holds exactly the hashes of
    the first `num_tokens // hash_block_size` blocks when a hasher is set (else stays empty);
    `0 <= num_computed_tokens <= num_tokens`.
    """

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "num_tokens",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "max_tokens",
        "status",
        "num_preemptions",
        "priority",
        "arrival_time",
        "lora_request",
        "cache_salt",
        "mm_features",
        "prompt_embeds",
        "skip_reading_prefix_cache",
        "block_hashes",
        "block_hasher",
        "has_extra_keys",
        "mm_hash_cursor",
        "session_id",
        "shared_prefix_boundary",
        "retention",
        "_embeds_digests",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        block_hasher: RequestBlockHasher | None = None,
        priority: int = 0,
        arrival_time: float = 0.0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] | None = None,
        prompt_embeds: Any = None,
        skip_reading_prefix_cache: bool = False,
        session_id: str | None = None,
        retention: RetentionConfig | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        tokens = list(prompt_token_ids)
        if not tokens:
            raise InvalidArgumentError(f"request {request_id!r}: the prompt has no tokens")
        packed = pack_token_ids(tokens)  # validates every token id, naming the first bad one
        check_no_bool_tokens(tokens, packed)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise InvalidArgumentError(f"request {request_id!r}: max_tokens={max_tokens!r}")
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.priority = priority
        self.arrival_time = arrival_time
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        features = sorted(mm_features or (), key=lambda f: f.offset)
        for feature in features:
            if feature.offset + feature.length > len(tokens):
                raise InvalidArgumentError(
                    f"request {request_id!r}: multimodal feature {feature.identifier!r} ends at "
                    f"{feature.offset + feature.length}, past the {len(tokens)}-token prompt"
                )
        self.mm_features = tuple(features)
        self.prompt_embeds = _check_prompt_embeds(request_id, prompt_embeds, len(tokens))
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.session_id = session_id
        # Token position of a prefix shared with other requests that a sparse-retention group
        # must keep cached (set by the scheduler from `get_computed_blocks`); 0 if none.
        self.shared_prefix_boundary = 0
        if retention is not None and not isinstance(retention, RetentionConfig):
            raise InvalidTypeError(
                f"request {request_id!r}: retention must be a RetentionConfig, got {retention!r}"
            )
        # Retention hints, honoured by a manager built with retention on (see pagedkv.eviction).
        self.retention = retention
        self.has_extra_keys = bool(
            lora_request is not None or cache_salt or features or prompt_embeds is not None
        )
        self.mm_hash_cursor = 0
        self._embeds_digests: dict[tuple[int, int], bytes] = {}
        self.block_hashes: list[BlockHash] = []
        self.block_hasher: RequestBlockHasher | OwnerExtendsHashes | None = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self, packed))

    @classmethod
    def external(
        cls,
        request_id: str,
        all_token_ids: list[int],
        block_hashes: list[BlockHash],
        hash_block_size: int,
        *,
        num_prompt_tokens: int,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        prompt_embeds: memoryview | None = None,
        skip_reading_prefix_cache: bool = False,
        session_id: str | None = None,
    ) -> Request:
        """A request over another engine's token and hash lists: nothing is copied or checked.

        The owner appends tokens and extends `block_hashes` itself (chained hashes of
        `hash_block_size`-token blocks, used as opaque keys), and sets the counters the manager
        reads (`num_tokens`, `num_prompt_tokens`, `num_computed_tokens`,
        `num_in_flight_tokens`, `status`, `num_preemptions`, `shared_prefix_boundary`) before
        each manager call. `mm_features` must be sorted by offset.
        """
        self = object.__new__(cls)
        self.request_id = request_id
        self.all_token_ids = all_token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = len(all_token_ids)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.max_tokens = None
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.priority = 0
        self.arrival_time = 0.0
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.mm_features = tuple(mm_features)
        self.prompt_embeds = prompt_embeds
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.session_id = session_id
        self.shared_prefix_boundary = 0
        self.retention = None
        self.has_extra_keys = bool(
            lora_request is not None or cache_salt or mm_features or prompt_embeds is not None
        )
        self.mm_hash_cursor = 0
        self._embeds_digests = {}
        self.block_hashes = block_hashes
        self.block_hasher = OwnerExtendsHashes(hash_block_size)
        return self

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        if self.status > _PREEMPTED:
            raise RequestStateError(
                f"request {self.request_id!r} is {self.status.name}; cannot append tokens"
            )
        if type(token_ids) is int:
            # Hot path: one token per decode step; hash only when it completes a block.
            if not 0 <= token_ids <= MAX_TOKEN_ID:
                raise InvalidArgumentError(f"token id {token_ids} is outside [0, {MAX_TOKEN_ID}]")
            self.all_token_ids.append(token_ids)
            num_tokens = self.num_tokens = self.num_tokens + 1
            hasher = self.block_hasher
            if (
                hasher is not None
                and (num_tokens - hasher.num_hash_lookahead_tokens) % hasher.hash_block_size == 0
            ):
                self.block_hashes.extend(hasher(self))
            return
        else:
            if isinstance(token_ids, (str, bytes, bool)) or not isinstance(token_ids, Sequence):
                raise InvalidTypeError(
                    f"token_ids must be an int or a sequence of int: {token_ids!r}"
                )
            check_no_bool_tokens(token_ids, pack_token_ids(token_ids))
            self.all_token_ids.extend(token_ids)
            self.num_tokens += len(token_ids)
        hasher = self.block_hasher
        if hasher is not None and (
            self.num_tokens - hasher.num_hash_lookahead_tokens
        ) // hasher.hash_block_size > len(self.block_hashes):
            self.block_hashes.extend(hasher(self))

    def prompt_embeds_digest(self, start: int, end: int) -> bytes:
        """SHA-256 of the raw bytes of the prompt embeddings of tokens [start, end), memoised."""
        key = (start, end)
        digest = self._embeds_digests.get(key)
        if digest is None:
            view = self.prompt_embeds
            if view is None:
                raise RequestStateError(f"request {self.request_id!r} has no prompt embeddings")
            bytes_per_token = view.nbytes // len(view)  # len: the first dimension (tokens)
            raw = view.cast("B")[start * bytes_per_token : end * bytes_per_token]
            digest = hashlib.sha256(raw).digest()
            self._embeds_digests[key] = digest
        return digest

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )


def _check_prompt_embeds(request_id: str, embeds: Any, num_tokens: int) -> memoryview | None:
    """Accept any C-contiguous buffer whose first dimension is the prompt length."""
    if embeds is None:
        return None
    try:
        view = memoryview(embeds)
    except TypeError as exc:
        raise InvalidTypeError(
            f"request {request_id!r}: prompt_embeds must support the buffer protocol "
            f"(bytes, array, numpy array), got {type(embeds).__name__}"
        ) from exc
    shape = view.shape  # () for a 0-d buffer: no token dimension
    if not view.c_contiguous or not shape or shape[0] != num_tokens:
        raise InvalidArgumentError(
            f"request {request_id!r}: prompt_embeds shape {view.shape} does not start with the "
            f"prompt length {num_tokens} (or is not C-contiguous)"
        )
    return view
