"""Router layer (extra `[router]`): the prefix index in Redis, shared by several routers.

Layout under a namespace `ns` (one Redis database, not a cluster: the clear script touches
keys it derives):
- `ns:h:<hash>`: a Redis hash, field `<instance>|<medium>|<group>` -> copies cached;
- `ns:i:<instance>`: a set of `<hash>|<medium>|<group>`, what the instance holds.
`<hash>` is the decimal int (64-bit hashes) or `x` + hex (digests); a None medium or group is
written as the empty string. Updates go in one pipeline per `apply_events` call; each copy's
increment or decrement is one small Lua script, so counts and sets stay consistent.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any

from pagedkv.errors import InvalidArgumentError, MissingDependencyError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.router.index import CacheKey, IndexUnavailableError, check_instance_id

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "The Redis index needs redis-py: pip install 'pagedkv[router]'"
    ) from exc

_STORE = """
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""

_REMOVE = """
local count = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if count <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('SREM', KEYS[2], ARGV[2])
end
return count
"""

_CLEAR = """
local members = redis.call('SMEMBERS', KEYS[1])
for _, member in ipairs(members) do
  local token, rest = string.match(member, '^([^|]*)|(.*)$')
  redis.call('HDEL', ARGV[1] .. ':h:' .. token, ARGV[2] .. '|' .. rest)
end
redis.call('DEL', KEYS[1])
return #members
"""

_LOOKUP_CHUNK = 64


def _hash_token(block_hash: Hashable) -> str:
    if type(block_hash) is int:
        return str(block_hash)
    if type(block_hash) is bytes:
        return "x" + block_hash.hex()
    raise InvalidArgumentError(f"block hash must be an int or bytes, got {block_hash!r}")


def _parse_token(token: str) -> int | bytes:
    return bytes.fromhex(token[1:]) if token.startswith("x") else int(token)


def _where(medium: str | None, group_idx: int | None) -> str:
    if medium is not None and "|" in medium:
        raise InvalidArgumentError(f"medium {medium!r} contains '|', which the layout reserves")
    return f"{medium or ''}|{'' if group_idx is None else group_idx}"


class RedisPrefixIndex:
    """`PrefixIndex` stored in Redis. Every Redis failure surfaces as `IndexUnavailableError`.

    Args:
        client: a `redis.Redis`; by default one for `url` with short timeouts and no retries,
            so an outage is noticed in `socket_timeout_s` and the router can fall back.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "pagedkv",
        client: Any = None,
        socket_timeout_s: float = 0.5,
    ) -> None:
        if not namespace or "|" in namespace:
            raise InvalidArgumentError(f"namespace must be non-empty without '|': {namespace!r}")
        self.namespace = namespace
        self.client = client or redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._store = self.client.register_script(_STORE)
        self._remove = self.client.register_script(_REMOVE)
        self._clear = self.client.register_script(_CLEAR)
        self.num_unknown_removals = 0

    def _hash_key(self, token: str) -> str:
        return f"{self.namespace}:h:{token}"

    def _instance_key(self, instance_id: str) -> str:
        return f"{self.namespace}:i:{instance_id}"

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> None:
        check_instance_id(instance_id)
        instance_key = self._instance_key(instance_id)
        pipe = self.client.pipeline(transaction=False)
        removals = 0
        for event in events:
            kind = type(event)
            if kind is BlockStored or kind is BlockRemoved:
                where = _where(event.medium, event.group_idx)
                field = f"{instance_id}|{where}"
                script = self._store if kind is BlockStored else self._remove
                for block_hash in event.block_hashes:
                    token = _hash_token(block_hash)
                    script(
                        keys=[self._hash_key(token), instance_key],
                        args=[field, f"{token}|{where}"],
                        client=pipe,
                    )
                if kind is BlockRemoved:
                    removals += len(event.block_hashes)
            elif kind is AllBlocksCleared:
                self._clear(keys=[instance_key], args=[self.namespace, instance_id], client=pipe)
        if not len(pipe):
            return
        results = self._execute(pipe)
        if removals:
            # A removal script returns the new count: below 0 means the copy was unknown.
            self.num_unknown_removals += sum(1 for r in results if isinstance(r, int) and r < 0)

    def clear_instance(self, instance_id: str) -> None:
        check_instance_id(instance_id)
        try:
            self._clear(keys=[self._instance_key(instance_id)], args=[self.namespace, instance_id])
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc

    def match_lengths(
        self,
        block_hashes: Sequence[Hashable],
        instance_ids: Iterable[str],
        media: Collection[str | None] | None = None,
    ) -> dict[str, int]:
        lengths = dict.fromkeys(instance_ids, 0)
        alive = set(lengths)
        depth = 0
        # Pipelined in chunks: one round trip per chunk, stopping at the first chunk that
        # leaves no instance alive.
        for start in range(0, len(block_hashes), _LOOKUP_CHUNK):
            chunk = block_hashes[start : start + _LOOKUP_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for block_hash in chunk:
                pipe.hkeys(self._hash_key(_hash_token(block_hash)))
            for fields in self._execute(pipe):
                holders: set[str] = set()
                for field in fields:
                    instance_id, medium, _ = field.split("|")
                    if media is None or (medium or None) in media:
                        holders.add(instance_id)
                alive &= holders
                if not alive:
                    return lengths
                depth += 1
                for instance_id in alive:
                    lengths[instance_id] = depth
        return lengths

    def instance_contents(self, instance_id: str) -> dict[CacheKey, int]:
        check_instance_id(instance_id)
        try:
            members = sorted(self.client.smembers(self._instance_key(instance_id)))
            pipe = self.client.pipeline(transaction=False)
            for member in members:
                token, where = member.split("|", 1)
                pipe.hget(self._hash_key(token), f"{instance_id}|{where}")
            counts = pipe.execute()
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc
        out: dict[CacheKey, int] = {}
        for member, count in zip(members, counts, strict=True):
            token, medium, group = member.split("|")
            key = (medium or None, int(group) if group else None, _parse_token(token))
            out[key] = int(count)
        return out

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc

    def drop_namespace(self) -> int:
        """Delete every key of this namespace (tests, fresh deployments); returns the count."""
        try:
            keys = list(self.client.scan_iter(match=f"{self.namespace}:*", count=1000))
            if keys:
                self.client.delete(*keys)
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc
        return len(keys)

    def _execute(self, pipe: Any) -> list:
        try:
            return pipe.execute()
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc
