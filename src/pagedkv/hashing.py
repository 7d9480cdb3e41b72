"""Leaf: prefix-cache block hashing (chained hashes, extra keys, root seed, algorithms).

`h_i = H(h_{i-1} or ROOT, tokens_i, extra_keys_i)`. The request owns its hashes and extends them
as tokens arrive (`RequestBlockHasher`); the pool only reads them. Knows nothing of blocks.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, overload

from pagedkv.block import BlockHash
from pagedkv.canonical_cbor import cbor_head, encode_token_blocks
from pagedkv.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    MissingDependencyError,
    UnknownHashAlgorithmError,
    install_hint,
)


class HashedRequest(Protocol):
    """What hashing reads from (and writes to) a request; `pagedkv.request.Request` is one.

    A protocol, so this leaf knows no request class: the request imports the hasher, never the
    other way round.
    """

    block_hashes: list[BlockHash]
    mm_hash_cursor: int

    # Read-only here (properties), so a request may hold its tokens in any sequence type.
    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def has_extra_keys(self) -> bool: ...
    @property
    def lora_request(self) -> Any: ...
    @property
    def mm_features(self) -> Sequence[Any]: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def prompt_embeds(self) -> Any: ...
    def prompt_embeds_digest(self, start: int, end: int) -> bytes: ...


HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxh3_128")
_ALIASES = {"xxhash": "xxh3_128"}

# The seed the reference uses for its deterministic cryptographic hashes. `sha256_cbor` must use
# the same one to be byte-identical with the reference.
REFERENCE_SEED = "vllm-none-hash"
PAGEDKV_SEED = "pagedkv-none-hash"
# Version tag of our compact encoding; bump it if the byte layout below ever changes.
ENCODING_VERSION = b"pagedkv-block-hash/v1"

MAX_TOKEN_ID = 2**32 - 1
# sha256_cbor: shorter runs than this use cbor2 per block (encode_token_blocks' fixed cost).
CBOR_VECTOR_MIN_BLOCKS = 4
assert array("I").itemsize == 4, "pagedkv needs a 4-byte C unsigned int"
_NEEDS_BYTESWAP = sys.byteorder != "little"

ExtraKey = tuple[Any, ...]
ExtraKeys = tuple[ExtraKey, ...]


def canonical_algorithm(name: str) -> str:
    """Return the canonical algorithm name, or raise `UnknownHashAlgorithmError`."""
    canonical = _ALIASES.get(name, name)
    if canonical not in HASH_ALGORITHMS:
        raise UnknownHashAlgorithmError(
            f"unknown prefix-cache hash algorithm {name!r}; choose one of {HASH_ALGORITHMS}"
        )
    return canonical


def resolve_root_seed(algorithm: str, seed: str | None = None) -> str:
    """The root seed: `seed` if given, else `$PYTHONHASHSEED`, else a default per algorithm.

    As in the reference, the cryptographic algorithms default to a fixed string so that
    independent processes and nodes agree on hashes; `xxh3_128` (not collision resistant)
    defaults to 32 random bytes per process, so collisions cannot be crafted offline.
    """
    algorithm = canonical_algorithm(algorithm)
    if seed is not None:
        return seed
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None:
        return env_seed
    if algorithm == "sha256_cbor":
        return REFERENCE_SEED
    if algorithm == "sha256":
        return PAGEDKV_SEED
    return os.urandom(32).hex()


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32; raise naming the first bad token id."""
    try:
        packed = array("I", token_ids)
    except (TypeError, OverflowError) as exc:
        _raise_bad_token(token_ids, exc)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


_MIN_BOOL_PROBES = 64


def check_no_bool_tokens(token_ids: Sequence[int], packed: bytes) -> None:
    """Raise `InvalidTypeError` naming the first bool among `token_ids` (`array` packs True
    and False as 1 and 0 without a word); `packed` is `pack_token_ids(token_ids)`."""
    # Hot path: only an id packed as 0 or 1 can be a bool, and its low byte is 0 or 1. Find
    # those low bytes at C speed (every 4th byte, little-endian) and look at those ids alone
    # (about 1 in 128 ids of a real prompt); where there are many, one C pass over the types.
    low_bytes = packed[::4]
    find = low_bytes.find
    num_probes = 0
    max_probes = _MIN_BOOL_PROBES + len(low_bytes) // 16  # a probe costs ~10 ids' C pass
    for low in (0, 1):
        position = find(low)
        while position >= 0:
            if type(token_ids[position]) is bool:
                _raise_bool_token(token_ids)
            num_probes += 1
            if num_probes > max_probes:
                if bool in set(map(type, token_ids)):
                    _raise_bool_token(token_ids)
                return
            position = find(low, position + 1)


def _raise_bool_token(token_ids: Sequence[int]) -> None:
    for position, token in enumerate(token_ids):
        if type(token) is bool:
            raise InvalidTypeError(
                f"token id at position {position} is {token!r} (bool); token ids must be int"
            )


def _raise_bad_token(token_ids: Sequence[int], exc: Exception) -> None:
    for position, token in enumerate(token_ids):
        if not isinstance(token, int) or isinstance(token, bool):
            raise InvalidTypeError(
                f"token id at position {position} is {token!r} ({type(token).__name__}); "
                "token ids must be int"
            ) from exc
        if not 0 <= token <= MAX_TOKEN_ID:
            raise InvalidArgumentError(
                f"token id at position {position} is {token}; token ids must be in "
                f"[0, {MAX_TOKEN_ID}]"
            ) from exc
    raise InvalidTypeError(f"token ids could not be packed: {exc}") from exc


def _encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """Injective byte encoding of tagged extra keys: tag, then length-prefixed fields."""
    out = bytearray()
    for key in extra_keys:
        tag = key[0]
        out += len(tag).to_bytes(1, "little") + tag.encode()
        for field_value in key[1:]:
            if isinstance(field_value, str):
                data = field_value.encode()
                out += b"s" + len(data).to_bytes(4, "little") + data
            elif isinstance(field_value, bytes):
                out += b"b" + len(field_value).to_bytes(4, "little") + field_value
            elif isinstance(field_value, int):
                out += b"i" + field_value.to_bytes(8, "little", signed=True)
            elif field_value is None:
                out += b"n"
            else:
                raise InvalidTypeError(f"unsupported extra-key field {field_value!r}")
        out += b";"
    return bytes(out)


class BlockHasher:
    """One hash algorithm with its root: hashes single blocks of a fixed size.

    Invariant: `none_hash` (the root that replaces a missing parent) is computed at run time
    from the resolved seed, never a constant.
    """

    __slots__ = (
        "algorithm",
        "block_size",
        "seed",
        "none_hash",
        "_digest_packed",
        "_is_sha256",
        "_block_struct",
        "_cbor_state",
    )

    def __init__(self, algorithm: str = "sha256", block_size: int = 16, seed: str | None = None):
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(
                f"hash block_size must be a positive int, got {block_size!r}"
            )
        self.algorithm = canonical_algorithm(algorithm)
        self.block_size = block_size
        self.seed = resolve_root_seed(self.algorithm, seed)
        self._block_struct = struct.Struct(f"{block_size * 4}s")
        self._digest_packed: Callable[[bytes], bytes] | None
        self._is_sha256 = self.algorithm == "sha256"
        if self.algorithm == "sha256":
            sha256 = hashlib.sha256
            self._digest_packed = lambda data: sha256(data).digest()
            root_input = ENCODING_VERSION + block_size.to_bytes(4, "little") + self.seed.encode()
            self.none_hash = BlockHash(sha256(root_input).digest())
        elif self.algorithm == "xxh3_128":
            try:
                import xxhash
            except ImportError as exc:
                raise MissingDependencyError(
                    f"hash algorithm 'xxh3_128' needs xxhash: {install_hint('hashing')}"
                ) from exc
            self._digest_packed = xxhash.xxh3_128_digest
            root_input = ENCODING_VERSION + block_size.to_bytes(4, "little") + self.seed.encode()
            self.none_hash = BlockHash(xxhash.xxh3_128_digest(root_input))
        else:  # sha256_cbor: the reference's canonical-CBOR tuple, byte for byte
            self._digest_packed = None
            self.none_hash = BlockHash(hashlib.sha256(_cbor_dumps(self.seed)).digest())
            # A block's payload: array(3) head, bytes(32) head, parent, array(block_size)
            # head, the token ids, null. SHA-256 of the first two heads, copied per block.
            self._cbor_state = hashlib.sha256(cbor_head(4, 3) + cbor_head(2, 32))

    def hash_block_tokens(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
    ) -> BlockHash:
        """Hash one full block given its parent's hash (None for the first block)."""
        parent = parent_hash if parent_hash else self.none_hash
        if self._digest_packed is None:
            payload = (parent, tuple(token_ids), extra_keys or None)
            return BlockHash(hashlib.sha256(_cbor_dumps(payload)).digest())
        data = parent + pack_token_ids(token_ids)
        if extra_keys:
            data += _encode_extra_keys(extra_keys)
        return BlockHash(self._digest_packed(data))

    def hash_cbor_blocks(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        num_blocks: int,
        packed: bytes | None = None,
    ) -> list[BlockHash]:
        """sha256_cbor of `num_blocks` consecutive blocks of `token_ids` without extra keys.

        Equal to `hash_block_tokens` block by block. `packed`, if given, is
        `pack_token_ids(token_ids)`: with it, long runs skip the cbor2 call per block (the
        payload bytes are the same; tests compare them).
        """
        parent = parent_hash if parent_hash else self.none_hash
        block_size = self.block_size
        tails = None
        if packed is not None and num_blocks >= CBOR_VECTOR_MIN_BLOCKS and len(parent) == 32:
            tails = encode_token_blocks(packed, token_ids, block_size)
        hashes: list[BlockHash] = []
        append = hashes.append
        if tails is None:
            dumps = _cbor2().dumps
            sha256 = hashlib.sha256
            for start in range(0, num_blocks * block_size, block_size):
                payload = (parent, tuple(token_ids[start : start + block_size]), None)
                parent = BlockHash(sha256(dumps(payload, canonical=True)).digest())
                append(parent)
            return hashes
        # Hot path: the SHA-256 state of the payload's first two heads is copied per block,
        # then takes the parent and the block's token array.
        copy_state = self._cbor_state.copy
        for tail in tails:
            state = copy_state()
            state.update(parent)
            state.update(tail)
            parent = BlockHash(state.digest())
            append(parent)
        return hashes

    def hash_packed_blocks(
        self, parent_hash: BlockHash | None, packed: bytes, num_blocks: int
    ) -> list[BlockHash]:
        """Hash `num_blocks` consecutive blocks of packed tokens that carry no extra keys."""
        digest = self._digest_packed
        assert digest is not None
        # Raw digests, typed as bytes: wrapping each in BlockHash() would add a call a block.
        parent: bytes = parent_hash if parent_hash else self.none_hash
        hashes: list[bytes] = []
        append = hashes.append
        # Hot path: the blocks are cut in C (struct.iter_unpack), and hashlib is called
        # directly, not through a wrapper: a Python-level call per block costs as much as the
        # SHA-256 itself. Only the first num_blocks blocks of `packed` are hashed.
        num_bytes = num_blocks * self.block_size * 4
        whole = packed if len(packed) == num_bytes else memoryview(packed)[:num_bytes]
        chunks = self._block_struct.iter_unpack(whole)
        if self._is_sha256:
            sha256 = hashlib.sha256
            for (chunk,) in chunks:
                state = sha256(parent)
                state.update(chunk)
                parent = state.digest()
                append(parent)
        else:
            for (chunk,) in chunks:
                parent = digest(parent + chunk)
                append(parent)
        # Every digest is a chained block hash; the cast costs one call, not one a block.
        return cast(list[BlockHash], hashes)


def _cbor2() -> Any:
    try:
        import cbor2
    except ImportError as exc:
        raise MissingDependencyError(
            f"hash algorithm 'sha256_cbor' needs cbor2: {install_hint('hashing')}"
        ) from exc
    return cbor2


def _cbor_dumps(obj: object) -> bytes:
    return _cbor2().dumps(obj, canonical=True)


# ----------------------------------------------------------------------------- extra keys


def _mm_extra_keys(request: HashedRequest, start: int, end: int, cursor: int) -> tuple[list, int]:
    """Multimodal keys for features overlapping [start, end); returns keys and a new cursor."""
    features = request.mm_features
    keys: list[ExtraKey] = []
    index = cursor
    # Features are sorted by offset; skip the ones that ended before this block.
    while index < len(features) and features[index].offset + features[index].length <= start:
        index += 1
    next_cursor = index
    while index < len(features) and features[index].offset < end:
        feature = features[index]
        if feature.offset + feature.length > start:
            keys.append(("mm", feature.identifier, feature.offset - start))
        index += 1
    return keys, next_cursor


def generate_block_hash_extra_keys(
    request: HashedRequest, start: int, end: int, mm_cursor: int = 0
) -> tuple[ExtraKeys | None, int]:
    """Tagged extra keys of the block [start, end): LoRA, multimodal, salt, prompt embeds.

    Returns the keys (None when there are none) and the multimodal cursor for the next block.
    """
    keys: list[ExtraKey] = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.name, lora.path))
    if request.mm_features:
        mm_keys, mm_cursor = _mm_extra_keys(request, start, end, mm_cursor)
        keys.extend(mm_keys)
    if start == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    if request.prompt_embeds is not None and end <= request.num_prompt_tokens:
        keys.append(("prompt_embeds", request.prompt_embeds_digest(start, end)))
    return (tuple(keys) if keys else None), mm_cursor


def to_event_extra_keys(extra_keys: ExtraKeys | None) -> tuple | None:
    """Strip tags for events: LoRA → name, salt → salt, embeds → digest, mm → (id, offset)."""
    if not extra_keys:
        return None
    out: list[Any] = []
    for key in extra_keys:
        tag = key[0]
        if tag == "mm":
            out.append((key[1], key[2]))
        else:
            out.append(key[1])
    return tuple(out)


# ----------------------------------------------------------------------------- request hasher


class RequestBlockHasher:
    """Extends `request.block_hashes` with the hashes of newly full blocks.

    Called by `Request` at construction and after every token append; it hashes only blocks
    `[len(request.block_hashes), (num_tokens - L) // hash_block_size)`, so calling it twice is
    a no-op. With hash lookahead (L = `num_hash_lookahead_tokens` > 0, the reference's
    EAGLE "lookahead block hashes") a block's hash also covers the L tokens after it, so it
    exists only once they do: its extra keys cover the block and those tokens, followed by the
    tokens themselves (`(keys, *tokens)` for `sha256_cbor`, byte-identical to the reference;
    a tagged `("lookahead", *tokens)` key otherwise).
    """

    __slots__ = ("hasher", "hash_block_size", "num_hash_lookahead_tokens")

    def __init__(
        self,
        hash_block_size: int,
        algorithm: str = "sha256",
        seed: str | None = None,
        num_hash_lookahead_tokens: int = 0,
    ):
        if not isinstance(num_hash_lookahead_tokens, int) or num_hash_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"num_hash_lookahead_tokens must be an int >= 0, got {num_hash_lookahead_tokens!r}"
            )
        self.hasher = BlockHasher(algorithm, hash_block_size, seed)
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens

    @property
    def algorithm(self) -> str:
        return self.hasher.algorithm

    @property
    def none_hash(self) -> BlockHash:
        return self.hasher.none_hash

    def __call__(
        self, request: HashedRequest, packed_tokens: bytes | None = None
    ) -> list[BlockHash]:
        """Return the hashes of the request's newly full blocks (does not append them).

        `packed_tokens`, if given, is `pack_token_ids(request.all_token_ids)` (the request
        packs its prompt once to validate it; hashing reuses those bytes).
        """
        block_size = self.hash_block_size
        lookahead = self.num_hash_lookahead_tokens
        start_block = len(request.block_hashes)
        end_block = (request.num_tokens - lookahead) // block_size
        if end_block <= start_block:
            return []
        parent = request.block_hashes[-1] if start_block else None
        tokens = request.all_token_ids
        hasher = self.hasher
        if lookahead:
            return self._hash_with_lookahead(request, parent, start_block, end_block)
        if not request.has_extra_keys and hasher._digest_packed is None:
            start_token, end_token = start_block * block_size, end_block * block_size
            num_blocks = end_block - start_block
            if packed_tokens is not None:
                packed_tokens = packed_tokens[start_token * 4 : end_token * 4]
            elif num_blocks >= CBOR_VECTOR_MIN_BLOCKS:
                packed_tokens = pack_token_ids(tokens[start_token:end_token])
            return hasher.hash_cbor_blocks(
                parent, tokens[start_token:end_token], num_blocks, packed_tokens
            )
        if not request.has_extra_keys:
            start_token, end_token = start_block * block_size, end_block * block_size
            if packed_tokens is None:
                packed = pack_token_ids(tokens[start_token:end_token])
            elif start_token == 0:
                packed = packed_tokens
            else:
                packed = packed_tokens[start_token * 4 : end_token * 4]
            return hasher.hash_packed_blocks(parent, packed, end_block - start_block)
        hashes: list[BlockHash] = []
        cursor = request.mm_hash_cursor
        for block_index in range(start_block, end_block):
            start = block_index * block_size
            end = start + block_size
            extra, cursor = generate_block_hash_extra_keys(request, start, end, cursor)
            parent = hasher.hash_block_tokens(parent, tokens[start:end], extra)
            hashes.append(parent)
        request.mm_hash_cursor = cursor
        return hashes

    def _hash_with_lookahead(
        self, request: HashedRequest, parent: BlockHash | None, start_block: int, end_block: int
    ) -> list[BlockHash]:
        block_size = self.hash_block_size
        lookahead = self.num_hash_lookahead_tokens
        tokens = request.all_token_ids
        hasher = self.hasher
        as_reference = hasher._digest_packed is None  # sha256_cbor: the reference's tuple
        hashes: list[BlockHash] = []
        cursor = request.mm_hash_cursor
        for block_index in range(start_block, end_block):
            start = block_index * block_size
            end = start + block_size
            keys, cursor = generate_block_hash_extra_keys(request, start, end + lookahead, cursor)
            after = tuple(tokens[end : end + lookahead])
            extra: Any = (keys, *after) if as_reference else (*(keys or ()), ("lookahead", *after))
            parent = hasher.hash_block_tokens(parent, tokens[start:end], extra)
            hashes.append(parent)
        request.mm_hash_cursor = cursor
        return hashes


def make_request_block_hasher(
    hash_block_size: int,
    algorithm: str = "sha256",
    seed: str | None = None,
    num_hash_lookahead_tokens: int = 0,
) -> RequestBlockHasher:
    """Build the hasher a `Request` calls to extend its block hashes."""
    return RequestBlockHasher(hash_block_size, algorithm, seed, num_hash_lookahead_tokens)


# ----------------------------------------------------------------------------- coarse view


class CoarseBlockHashes(Sequence[BlockHash]):
    """Hashes at a coarser block size, viewed over the fine `hash_block_size` chain.

    Element j is the fine hash at the last fine boundary inside coarse block j,
    `fine[(j + 1) * k - 1]` with `k = block_size // hash_block_size`: every fine hash already
    chains over the whole prefix, so it identifies the coarse block too. Allocates nothing.
    """

    __slots__ = ("fine_hashes", "scale")

    def __init__(self, fine_hashes: Sequence[BlockHash], scale: int) -> None:
        self.fine_hashes = fine_hashes
        self.scale = scale

    def __len__(self) -> int:
        return len(self.fine_hashes) // self.scale

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not isinstance(index, int):
            raise InvalidTypeError(f"CoarseBlockHashes index must be int or slice, got {index!r}")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.fine_hashes[(index + 1) * self.scale - 1]


def resolve_block_hashes(
    fine_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """The request's hashes as seen by a group of `block_size` (the raw list when equal)."""
    if block_size == hash_block_size:
        return fine_hashes
    if block_size % hash_block_size:
        raise InvalidArgumentError(
            f"block_size {block_size} is not a multiple of hash_block_size {hash_block_size}"
        )
    return CoarseBlockHashes(fine_hashes, block_size // hash_block_size)
