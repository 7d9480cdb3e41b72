"""Block hashing: the chain, extra keys, root seeds, the three algorithms, incremental hashing."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pagedkv import (
    ConfigError,
    InvalidArgumentError,
    LoRARequest,
    MultiModalFeature,
    Request,
    UnknownHashAlgorithmError,
    make_request_block_hasher,
)
from pagedkv.hashing import (
    BlockHasher,
    CoarseBlockHashes,
    canonical_algorithm,
    generate_block_hash_extra_keys,
    resolve_block_hashes,
    resolve_root_seed,
    to_event_extra_keys,
)

ALGORITHMS = ["sha256", "sha256_cbor", "xxh3_128"]


def needs_extra(algorithm: str) -> None:
    if algorithm == "sha256_cbor":
        pytest.importorskip("cbor2")
    elif algorithm == "xxh3_128":
        pytest.importorskip("xxhash")


@pytest.fixture(autouse=True)
def no_env_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def mm_request(**kwargs) -> Request:
    """The reference's multimodal example: items (0, 5) "hash1" and (10, 5) "hash2"."""
    features = [MultiModalFeature("hash1", 0, 5), MultiModalFeature("hash2", 10, 5)]
    return Request("mm", list(range(20)), mm_features=features, **kwargs)


# ---------------------------------------------------------------------------- chain


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_chain_each_hash_covers_parent_and_block(algorithm):
    needs_extra(algorithm)
    hasher = make_request_block_hasher(4, algorithm, seed="fixed")
    tokens = list(range(1000, 1014))  # 3 full blocks, 2 tokens left over
    req = Request("r", tokens, block_hasher=hasher)
    assert len(req.block_hashes) == 3  # the partial tail is never hashed
    single = hasher.hasher
    expected = []
    parent = None
    for i in range(3):
        parent = single.hash_block_tokens(parent, tokens[i * 4 : (i + 1) * 4])
        expected.append(parent)
    assert req.block_hashes == expected
    assert len(set(expected)) == 3
    # The first block hashes against the root, not against an empty parent.
    assert single.hash_block_tokens(None, tokens[:4]) == single.hash_block_tokens(
        single.none_hash, tokens[:4]
    )
    # Same block tokens under a different parent hash differently.
    assert single.hash_block_tokens(expected[0], tokens[:4]) != expected[0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_digest_sizes(algorithm):
    needs_extra(algorithm)
    hasher = BlockHasher(algorithm, 4, seed="s")
    size = 16 if algorithm == "xxh3_128" else 32
    assert len(hasher.none_hash) == size
    assert len(hasher.hash_block_tokens(None, [1, 2, 3, 4])) == size


def test_sha256_compact_encoding_formula():
    """Our default: sha256(parent || LE uint32 tokens), root over a versioned header."""
    seed = "s33d"
    hasher = BlockHasher("sha256", 4, seed=seed)
    root = hashlib.sha256(b"pagedkv-block-hash/v1" + struct.pack("<I", 4) + seed.encode()).digest()
    assert hasher.none_hash == root
    tokens = [1, 2, 70000, 2**32 - 1]
    h0 = hashlib.sha256(root + struct.pack("<4I", *tokens)).digest()
    assert hasher.hash_block_tokens(None, tokens) == h0
    h1 = hashlib.sha256(h0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert hasher.hash_block_tokens(h0, [5, 6, 7, 8]) == h1
    # The root depends on the block size.
    assert BlockHasher("sha256", 8, seed=seed).none_hash != root


def test_sha256_default_seed_is_fixed_across_instances():
    a = make_request_block_hasher(16)
    b = make_request_block_hasher(16)
    assert a.none_hash == b.none_hash
    assert a.hasher.seed == "pagedkv-none-hash"


# ---------------------------------------------------------------------------- sha256_cbor


def reference_cbor_hash(obj) -> bytes:
    cbor2 = pytest.importorskip("cbor2")
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def test_sha256_cbor_matches_reference_formula():
    pytest.importorskip("cbor2")
    root = reference_cbor_hash("vllm-none-hash")
    hasher = make_request_block_hasher(4, "sha256_cbor")
    assert hasher.none_hash == root
    tokens = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    req = Request("r", tokens, block_hasher=hasher)
    h0 = reference_cbor_hash((root, (7, 8, 9, 10), None))
    h1 = reference_cbor_hash((h0, (11, 12, 13, 14), None))
    assert req.block_hashes == [h0, h1]
    req.append_output_token_ids([17, 18])
    assert req.block_hashes == [h0, h1, reference_cbor_hash((h1, (15, 16, 17, 18), None))]


def test_sha256_cbor_with_extra_keys_matches_reference_formula():
    pytest.importorskip("cbor2")
    root = reference_cbor_hash("vllm-none-hash")
    hasher = make_request_block_hasher(4, "sha256_cbor")
    lora = LoRARequest("adapter", "/path/a", adapter_id=3)
    req = Request(
        "r",
        list(range(12)),
        block_hasher=hasher,
        lora_request=lora,
        cache_salt="salt",
        mm_features=[MultiModalFeature("img", 2, 4)],
    )
    h0 = reference_cbor_hash(
        (
            root,
            (0, 1, 2, 3),
            (("lora", "adapter", "/path/a"), ("mm", "img", 2), ("cache_salt", "salt")),
        )
    )
    h1 = reference_cbor_hash(
        (h0, (4, 5, 6, 7), (("lora", "adapter", "/path/a"), ("mm", "img", -2)))
    )
    h2 = reference_cbor_hash((h1, (8, 9, 10, 11), (("lora", "adapter", "/path/a"),)))
    assert req.block_hashes == [h0, h1, h2]


def test_sha256_cbor_root_honours_pythonhashseed(monkeypatch):
    pytest.importorskip("cbor2")
    monkeypatch.setenv("PYTHONHASHSEED", "python hash seed")
    hasher = BlockHasher("sha256_cbor", 4)
    assert hasher.seed == "python hash seed"
    assert hasher.none_hash == reference_cbor_hash("python hash seed")


# ---------------------------------------------------------------------------- root seed


def test_resolve_root_seed_defaults_and_env(monkeypatch):
    assert resolve_root_seed("sha256") == "pagedkv-none-hash"
    assert resolve_root_seed("sha256_cbor") == "vllm-none-hash"
    assert resolve_root_seed("sha256", seed="given") == "given"
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert resolve_root_seed("sha256") == "123"
    assert resolve_root_seed("sha256_cbor") == "123"
    assert resolve_root_seed("xxh3_128") == "123"
    assert resolve_root_seed("sha256", seed="given") == "given"  # an explicit seed wins


def test_sha256_root_honours_pythonhashseed(monkeypatch):
    default_root = BlockHasher("sha256", 4).none_hash
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    env_root = BlockHasher("sha256", 4).none_hash
    assert env_root != default_root
    assert env_root == BlockHasher("sha256", 4, seed="0").none_hash
    # The whole chain follows the root.
    tokens = list(range(8))
    with_env = Request("a", tokens, block_hasher=make_request_block_hasher(4)).block_hashes
    monkeypatch.delenv("PYTHONHASHSEED")
    without_env = Request("a", tokens, block_hasher=make_request_block_hasher(4)).block_hashes
    assert with_env[0] != without_env[0] and with_env[1] != without_env[1]


def test_xxh3_seeds_differ_per_resolution():
    pytest.importorskip("xxhash")
    seeds = {resolve_root_seed("xxh3_128") for _ in range(5)}
    assert len(seeds) == 5
    assert all(len(seed) == 64 for seed in seeds)  # 32 random bytes, hex
    roots = {BlockHasher("xxh3_128", 4).none_hash for _ in range(5)}
    assert len(roots) == 5


def test_xxh3_given_seed_or_env_is_deterministic(monkeypatch):
    pytest.importorskip("xxhash")
    a = BlockHasher("xxh3_128", 4, seed="k")
    b = BlockHasher("xxh3_128", 4, seed="k")
    assert a.none_hash == b.none_hash
    assert a.hash_block_tokens(None, [1, 2, 3, 4]) == b.hash_block_tokens(None, [1, 2, 3, 4])
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert BlockHasher("xxh3_128", 4).none_hash == BlockHasher("xxh3_128", 4).none_hash


def test_xxhash_alias():
    assert canonical_algorithm("xxhash") == "xxh3_128"


# ---------------------------------------------------------------------------- algorithms


@pytest.mark.parametrize("name", ["md5", "SHA256", "", "sha256_pickle"])
def test_unknown_algorithm(name):
    with pytest.raises(UnknownHashAlgorithmError, match=repr(name)) as info:
        make_request_block_hasher(16, name)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownHashAlgorithmError):
        BlockHasher(name, 16)
    with pytest.raises(UnknownHashAlgorithmError):
        resolve_root_seed(name)


@pytest.mark.parametrize("block_size", [0, -4, 2.0, None])
def test_bad_hash_block_size(block_size):
    with pytest.raises(InvalidArgumentError, match=repr(block_size)):
        BlockHasher("sha256", block_size)


def test_algorithms_disagree():
    pytest.importorskip("cbor2")
    pytest.importorskip("xxhash")
    tokens = list(range(8))
    hashes = {
        algorithm: Request(
            "a", tokens, block_hasher=make_request_block_hasher(4, algorithm, seed="x")
        ).block_hashes[0]
        for algorithm in ALGORITHMS
    }
    assert len(set(hashes.values())) == 3


# ---------------------------------------------------------------------------- extra keys


def test_mm_extra_keys_reference_examples():
    req = mm_request()
    assert generate_block_hash_extra_keys(req, 0, 5)[0] == (("mm", "hash1", 0),)
    assert generate_block_hash_extra_keys(req, 3, 8)[0] == (("mm", "hash1", -3),)
    assert generate_block_hash_extra_keys(req, 6, 10)[0] is None
    assert generate_block_hash_extra_keys(req, 0, 15)[0] == (
        ("mm", "hash1", 0),
        ("mm", "hash2", 10),
    )
    assert generate_block_hash_extra_keys(req, 12, 16)[0] == (("mm", "hash2", -2),)
    assert generate_block_hash_extra_keys(req, 15, 20)[0] is None


def test_mm_extra_keys_cursor_skips_finished_items():
    req = mm_request()
    keys, cursor = generate_block_hash_extra_keys(req, 6, 10, 0)
    assert keys is None and cursor == 1
    keys, cursor = generate_block_hash_extra_keys(req, 10, 15, cursor)
    assert keys == (("mm", "hash2", 0),) and cursor == 1
    keys, cursor = generate_block_hash_extra_keys(req, 15, 20, cursor)
    assert keys is None and cursor == 2


def test_salt_and_mm_on_first_block():
    req = mm_request(cache_salt="salt")
    assert generate_block_hash_extra_keys(req, 0, 5)[0] == (
        ("mm", "hash1", 0),
        ("cache_salt", "salt"),
    )
    # The salt goes on the block starting at token 0 only.
    assert generate_block_hash_extra_keys(req, 3, 8)[0] == (("mm", "hash1", -3),)
    assert generate_block_hash_extra_keys(req, 6, 10)[0] is None


def test_lora_on_every_block_with_name_and_path():
    lora = LoRARequest("foo", "/adapters/foo", adapter_id=1)
    req = Request("r", list(range(12)), lora_request=lora)
    for start in (0, 4, 8):
        keys, _ = generate_block_hash_extra_keys(req, start, start + 4)
        assert keys == (("lora", "foo", "/adapters/foo"),)


def test_lora_path_enters_the_hash():
    hasher = make_request_block_hasher(4)
    tokens = list(range(8))
    a = Request("a", tokens, block_hasher=hasher, lora_request=LoRARequest("foo", "/v1"))
    b = Request("b", tokens, block_hasher=hasher, lora_request=LoRARequest("foo", "/v2"))
    c = Request("c", tokens, block_hasher=hasher, lora_request=LoRARequest("foo", "/v1", 9))
    plain = Request("d", tokens, block_hasher=hasher)
    assert a.block_hashes[0] != b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes == c.block_hashes  # the adapter id is not part of the identity
    assert a.block_hashes[0] != plain.block_hashes[0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lora_foo_and_salt_foo_do_not_collide(algorithm):
    needs_extra(algorithm)
    hasher = make_request_block_hasher(4, algorithm, seed="x")
    tokens = list(range(4))
    with_lora = Request("a", tokens, block_hasher=hasher, lora_request=LoRARequest("foo", ""))
    with_salt = Request("b", tokens, block_hasher=hasher, cache_salt="foo")
    assert with_lora.block_hashes[0] != with_salt.block_hashes[0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_extra_key_encoding_is_injective_on_field_boundaries(algorithm):
    needs_extra(algorithm)
    single = BlockHasher(algorithm, 4, seed="x")
    tokens = [1, 2, 3, 4]
    a = single.hash_block_tokens(None, tokens, (("lora", "ab", "c"),))
    b = single.hash_block_tokens(None, tokens, (("lora", "a", "bc"),))
    c = single.hash_block_tokens(None, tokens, (("mm", "x", 1), ("mm", "y", 2)))
    d = single.hash_block_tokens(None, tokens, (("mm", "y", 2), ("mm", "x", 1)))
    e = single.hash_block_tokens(None, tokens, (("mm", "x", -1),))
    f = single.hash_block_tokens(None, tokens, (("mm", "x", 1),))
    none = single.hash_block_tokens(None, tokens, None)
    empty = single.hash_block_tokens(None, tokens, ())
    assert len({a, b, c, d, e, f, none}) == 7
    assert empty == none  # no keys and an empty tuple are the same block


def test_salt_changes_first_hash_and_chains_through():
    hasher = make_request_block_hasher(4)
    tokens = list(range(12))
    salted = Request("a", tokens, block_hasher=hasher, cache_salt="tenant-1")
    other = Request("b", tokens, block_hasher=hasher, cache_salt="tenant-2")
    plain = Request("c", tokens, block_hasher=hasher)
    assert len({salted.block_hashes[i] for i in range(3)} & set(plain.block_hashes)) == 0
    assert salted.block_hashes[2] != other.block_hashes[2]
    # Block 1 carries no salt key: it is the plain hash of its tokens under the salted parent.
    assert generate_block_hash_extra_keys(salted, 4, 8)[0] is None
    single = hasher.hasher
    assert salted.block_hashes[1] == single.hash_block_tokens(salted.block_hashes[0], tokens[4:8])


def test_mm_identifier_and_offset_enter_the_hash():
    hasher = make_request_block_hasher(4)
    tokens = list(range(8))

    def hashes(features):
        return Request("r", tokens, block_hasher=hasher, mm_features=features).block_hashes

    base = hashes([MultiModalFeature("img", 2, 4)])
    assert base != hashes([MultiModalFeature("img2", 2, 4)])
    assert base[0] != hashes([MultiModalFeature("img", 1, 4)])[0]
    assert base[0] != hashes(None)[0]
    # Block 1 sees the item at offset -2 (it began 2 tokens before the block).
    single = hasher.hasher
    assert base[1] == single.hash_block_tokens(base[0], tokens[4:8], (("mm", "img", -2),))


def embeds(num_tokens: int, fill: int = 0) -> memoryview:
    """A (num_tokens, 8) byte buffer: row t is bytes fill+t repeated."""
    raw = bytearray()
    for t in range(num_tokens):
        raw += bytes([(fill + t) % 256]) * 8
    return memoryview(raw).cast("B", [num_tokens, 8])


def test_prompt_embeds_digest_key():
    tokens = [0] * 10
    req = Request("r", tokens, prompt_embeds=embeds(10))
    keys, _ = generate_block_hash_extra_keys(req, 4, 8)
    expected = hashlib.sha256(bytes(embeds(10).cast("B"))[32:64]).digest()
    assert keys == (("prompt_embeds", expected),)
    assert req.prompt_embeds_digest(4, 8) == expected


def test_prompt_embeds_enter_hash_only_for_prompt_blocks():
    hasher = make_request_block_hasher(4)
    tokens = [0] * 8
    a = Request("a", tokens, block_hasher=hasher, prompt_embeds=embeds(8, fill=0))
    b = Request("b", tokens, block_hasher=hasher, prompt_embeds=embeds(8, fill=100))
    plain = Request("c", tokens, block_hasher=hasher)
    assert a.block_hashes[0] != b.block_hashes[0] != plain.block_hashes[0]
    a.append_output_token_ids([1, 2, 3, 4])
    assert generate_block_hash_extra_keys(a, 8, 12)[0] is None
    assert a.block_hashes[2] == hasher.hasher.hash_block_tokens(a.block_hashes[1], [1, 2, 3, 4])


def test_prompt_embeds_with_wrong_length_rejected():
    with pytest.raises(InvalidArgumentError, match=r"\(3, 8\)"):
        Request("r", [0] * 4, prompt_embeds=embeds(3))


def test_to_event_extra_keys_strips_tags():
    keys = (("lora", "adapter", "/path"), ("mm", "hash1", 2), ("cache_salt", "salt"))
    assert to_event_extra_keys(keys) == ("adapter", ("hash1", 2), "salt")
    assert to_event_extra_keys((("prompt_embeds", b"\x01\x02"),)) == (b"\x01\x02",)
    assert to_event_extra_keys(None) is None
    assert to_event_extra_keys(()) is None


# ---------------------------------------------------------------------------- incremental


def request_variants():
    lora = LoRARequest("lo", "/lo", 2)
    return {
        "plain": {},
        "lora": {"lora_request": lora},
        "salt": {"cache_salt": "s"},
        "mm": {
            "mm_features": [
                MultiModalFeature("a", 1, 6),
                MultiModalFeature("b", 9, 2),
                MultiModalFeature("c", 14, 10),
            ]
        },
        "all": {
            "lora_request": lora,
            "cache_salt": "s",
            "mm_features": [MultiModalFeature("a", 3, 20)],
            "prompt_embeds": embeds(25),
        },
    }


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("variant", list(request_variants()))
def test_incremental_hashing_equals_fresh_hashing(algorithm, variant):
    needs_extra(algorithm)
    kwargs = request_variants()[variant]
    hasher = make_request_block_hasher(4, algorithm, seed="inc")
    prompt = list(range(500, 525))  # 25 tokens: 6 full blocks + 1
    outputs = list(range(900, 923))  # 23 more: 48 tokens, 12 blocks
    one_by_one = Request("one", prompt, block_hasher=hasher, **kwargs)
    for token in outputs:
        one_by_one.append_output_token_ids(token)
    chunked = Request("chunk", prompt, block_hasher=hasher, **kwargs)
    for start, end in ((0, 1), (1, 4), (4, 11), (11, 11), (11, 23)):
        chunked.append_output_token_ids(outputs[start:end])
    # Fresh: every block hashed from scratch (no multimodal cursor carried over).
    single = hasher.hasher
    tokens = prompt + outputs
    fresh = []
    parent = None
    for index in range(12):
        extra, _ = generate_block_hash_extra_keys(one_by_one, index * 4, index * 4 + 4)
        parent = single.hash_block_tokens(parent, tokens[index * 4 : index * 4 + 4], extra)
        fresh.append(parent)
    assert one_by_one.block_hashes == fresh
    assert chunked.block_hashes == fresh
    if "prompt_embeds" not in kwargs:
        # A request built with every token at once agrees too.
        full = Request("full", tokens, block_hasher=hasher, **kwargs)
        assert full.block_hashes == fresh


def test_partial_block_is_hashed_once_full():
    hasher = make_request_block_hasher(4)
    req = Request("r", [1, 2, 3], block_hasher=hasher)
    assert req.block_hashes == []
    req.append_output_token_ids(4)
    assert len(req.block_hashes) == 1
    assert req.block_hashes[0] == hasher.hasher.hash_block_tokens(None, [1, 2, 3, 4])
    req.append_output_token_ids([5, 6, 7])
    assert len(req.block_hashes) == 1
    assert hasher(req) == []  # calling the hasher again is a no-op


def test_request_without_hasher_has_no_hashes():
    req = Request("r", list(range(32)))
    req.append_output_token_ids(list(range(16)))
    assert req.block_hashes == []


# ---------------------------------------------------------------------------- coarse view


def test_coarse_view_takes_last_fine_hash_of_each_block():
    fine = [bytes([i]) * 4 for i in range(7)]
    coarse = resolve_block_hashes(fine, 4, 8)
    assert isinstance(coarse, CoarseBlockHashes)
    assert len(coarse) == 3
    assert list(coarse) == [fine[1], fine[3], fine[5]]
    assert coarse[-1] == fine[5]
    assert coarse[1:] == [fine[3], fine[5]]
    with pytest.raises(IndexError):
        coarse[3]
    assert resolve_block_hashes(fine, 4, 4) is fine
    with pytest.raises(InvalidArgumentError, match="12 is not a multiple of hash_block_size 8"):
        resolve_block_hashes(fine, 8, 12)
